"""``ExpertLoadMonitor``: how evenly each MoE layer spreads its tokens over its experts."""

from __future__ import annotations

import statistics
import warnings

import torch
from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks.step_monitor import StepMonitor, communicates
from lit_ablate.models.moe.blocks import MoEBlock, moe_blocks


def load_statistics(counts: list[float]) -> dict[str, float]:
    """Max/mean imbalance and coefficient of variation (std/mean) of per-expert token counts.

    Both are 1 and 0 for perfectly even routing; ``max_over_mean`` is the slowdown of an
    expert-parallel step that waits for its busiest expert.
    """
    values = torch.tensor(counts, dtype=torch.float64)
    mean = values.mean()
    if mean == 0:
        return {"max_over_mean": float("nan"), "cv": float("nan")}
    return {"max_over_mean": float(values.max() / mean), "cv": float(values.std(correction=0) / mean)}


class ExpertLoadMonitor(StepMonitor):
    """Per MoE layer and optimizer step: token fraction per expert, imbalance, auxiliary losses.

    Choose it for any MoE run: a router that collapses onto a few experts trains a smaller model
    than the config says, and makes expert parallelism wait on its busiest rank. It reads the
    blocks lit-ablate patches in (``moe.experts: grouped`` or ``loop``).

    Series per step (``layer{i}`` is the decoder layer): ``moe/layer{i}/expert_fraction`` (a list;
    run record only), ``moe/layer{i}/max_over_mean``, ``moe/layer{i}/cv``,
    ``moe/layer{i}/load_balance_loss`` and ``moe/layer{i}/z_loss`` (unweighted, mean over the
    step's micro-batches); over layers, ``moe/max_over_mean`` (the worst layer) and the means
    ``moe/cv``, ``moe/load_balance_loss``, ``moe/z_loss``. The logger shows this rank's counts as
    training runs; at the end, the run record's values are recomputed from all ranks' counts (one
    collective), with the losses averaged over ranks.

    Args:
        log_expert_fractions: also send each expert's fraction to the logger (``layers x
            experts`` scalars per step: turn it off for large models).
        warmup_steps: steps excluded from the end-of-fit summary line.
        log_to_logger: send the scalar series to the Lightning logger.
    """

    def __init__(
        self, log_expert_fractions: bool = True, warmup_steps: int | None = None, log_to_logger: bool = True
    ) -> None:
        super().__init__(warmup_steps=warmup_steps, log_to_logger=log_to_logger)
        self.log_expert_fractions = log_expert_fractions
        self.blocks: list[MoEBlock] = []
        self._raw: dict[int, dict[str, list[float]]] = {}  # step -> layer -> [counts..., balance, z]

    @property
    def log_prefix(self) -> str:
        return "train"

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.blocks = moe_blocks(pl_module)
        if not self.blocks:
            warnings.warn(
                "ExpertLoadMonitor: the model has no lit-ablate MoE blocks (a dense model, or "
                "moe.experts: hf); it records nothing",
                stacklevel=2,
            )

    def start_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for block in self.blocks:  # forget forwards that ran outside this step
            block.pop_load()

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        raw = {}
        for block in self.blocks:
            load = block.pop_load()
            if load is not None:
                raw[f"moe/layer{block.layer_index}"] = [*load.counts.tolist(), load.load_balance_loss, load.z_loss]
        if raw:
            self._raw[step] = raw
            self._publish(step, raw, log=True)

    def finalize(self, trainer: Trainer) -> None:
        if not communicates(trainer) or not self._raw:
            return
        steps, layers = sorted(self._raw), list(self._raw[min(self._raw)])
        local = torch.tensor(
            [[self._raw[s][layer] for layer in layers] for s in steps],
            dtype=torch.float64,
            device=trainer.strategy.root_device,
        )
        summed = trainer.strategy.reduce(local, reduce_op="sum").cpu()
        summed[..., -2:] /= trainer.world_size  # losses: the mean over ranks; counts: the sum
        for i, step in enumerate(steps):
            self._publish(step, dict(zip(layers, summed[i].tolist())), log=False)

    def summary_line(self) -> str:
        """The over-layers statistics only (per-layer series and expert fractions are in the record)."""
        medians = []
        for name in ("max_over_mean", "cv", "load_balance_loss", "z_loss"):
            measured = [v for s, v in self.series.get(f"moe/{name}", {}).items() if s > self.warmup_steps]
            if measured:
                medians.append(f"moe/{name}={statistics.median(measured):.4g}")
        return f"{type(self).__name__} (median after {self.warmup_steps} warm-up steps): {' '.join(medians) or 'n/a'}"

    def _publish(self, step: int, raw: dict[str, list[float]], log: bool) -> None:
        """Derive and store every series of ``step``; queue them for the loggers when ``log``."""
        per_layer = []
        for layer, values in raw.items():
            counts, (balance, z) = values[:-2], values[-2:]
            total = sum(counts)
            fractions = [c / total if total else 0.0 for c in counts]
            self.series.setdefault(f"{layer}/expert_fraction", {})[step] = fractions
            if log and self.log_expert_fractions:
                for expert, fraction in enumerate(fractions):
                    self.log_value(f"{layer}/expert{expert}_fraction", fraction)
            stats = {**load_statistics(counts), "load_balance_loss": balance, "z_loss": z}
            per_layer.append(stats)
            for name, value in stats.items():
                self._store(f"{layer}/{name}", step, value, log)
        self._store("moe/max_over_mean", step, max(s["max_over_mean"] for s in per_layer), log)
        for name in ("cv", "load_balance_loss", "z_loss"):
            self._store(f"moe/{name}", step, sum(s[name] for s in per_layer) / len(per_layer), log)

    def _store(self, name: str, step: int, value: float, log: bool) -> None:
        if log:
            self.record(name, step, value)
        else:
            self.series.setdefault(name, {})[step] = value
