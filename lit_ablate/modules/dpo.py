"""``DPO``: preference training (DPO, IPO, hinge, SimPO) of a causal LM, padded or packed."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from lit_ablate.data.datamodule import LMDataModule
from lit_ablate.data.preference_collate import PreferencePaddingCollator
from lit_ablate.errors import ConfigError
from lit_ablate.estimate.flops import batch_model_flops, preference_flops_factor
from lit_ablate.models.adapters.lora import adapters_disabled
from lit_ablate.models.factory import SIZE_KEYS, ModelFactory
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.models.losses.liger_dpo import LIGER, PADDED_ONLY_FIX, LigerDPOPolicy, liger_dpo_loss
from lit_ablate.models.losses.logprobs import TorchLogProbs, logprob_backend
from lit_ablate.models.losses.sequence_logprobs import PairStep, SequenceLogProbs
from lit_ablate.models.moe.blocks import collect_aux_losses
from lit_ablate.modules.causal_lm import CausalLM
from lit_ablate.modules.optim import DecayShape, LrSchedule
from lit_ablate.modules.preference_loss import LossType, PairLosses, PreferenceLoss
from lit_ablate.modules.step_output import StepOutput
from lit_ablate.strategies.interface import interface_of
from lit_ablate.strategies.mesh import MeshStrategy

Reference = Literal["frozen", "adapter", "precomputed", "none"]
REFERENCES = ("frozen", "adapter", "precomputed", "none")
PROBE_ATOL = 1e-4
"""A cached reference log-prob must match a fresh computation of the same pair this closely (fp32
sums of a few hundred token log-probs in another batch layout differ by ~1e-5 at most)."""
_KEY = "model.init_args"


class DPO(CausalLM):
    """Preference optimisation of a causal LM; each optimizer step trains the mean over its pairs.

    The model, strategies, optimizer, schedule, exact step objective and run record are
    ``CausalLM``'s; what differs is the step: per pair, the summed response log-probabilities of
    the chosen and the rejected sequence under the policy (and the reference) go into a
    preference loss. The objective of a step is the sum of pair losses over all its micro-batches
    and data-parallel ranks divided by the number of pairs (``StepObjective`` with pairs as units).

    Args:
        model: which model to build (preset, HF config mapping, or checkpoint path); the policy
            starts from it and so does the reference, unless ``reference_model`` names another.
        loss_type: ``sigmoid`` (DPO), ``ipo``, ``hinge`` or ``simpo`` (reference-free).
        beta: inverse temperature of the implicit reward.
        label_smoothing: conservative DPO/SimPO: the assumed share of flipped labels.
        gamma: SimPO's target reward margin.
        reference: ``frozen``: a copy of the initial model (or the ``reference_model``), built and
            sharded by the run's strategy, never stepped, in eval mode, run without gradients; ``adapter`` (with
            ``model.adapter``): the policy itself with its LoRA adapters switched off, i.e. the
            frozen base, without a second copy in memory; ``precomputed``: its
            log-probabilities computed once before training and looked up (no second model in
            memory during training; computed by the initial model or the ``reference_model``);
            ``none``: no reference (log-ratios against 0; required by ``simpo``).
        reference_model: with ``frozen`` or ``precomputed``, a separate reference checkpoint (a
            Hugging Face folder as ``save_pretrained`` or ``lit-ablate export`` writes it, or a hub
            name), e.g. the SFT model while the policy starts elsewhere (TRL's ``ref_model``). It is
            built as the policy is (``model``'s dtype, attention, MoE and fp8 options; not its
            adapters or quantisation) and must have the policy's architecture and vocabulary
            (FLOPs and memory are counted as the policy's). ``precomputed`` builds it (sharded by
            the strategy like the policy) only to compute the log-probs, then drops it.
        reference_cache: with ``precomputed``, a file that keeps the log-probabilities for later
            runs (the runs of a study): reused when it holds the same pairs and its values match
            a fresh computation of the first pair, written otherwise.
        logprobs: the log-probability backend (``lit_ablate.models.losses.logprobs``): ``torch`` or ``chunked``;
            or ``liger``: Liger-Kernel's fused linear DPO loss (``lit_ablate.models.losses.liger_dpo``: padded
            batches, ``sigmoid``/``hinge``, reference ``frozen``/``none``; anything else is refused).
        logprobs_options: the backend's options (e.g. ``{chunk_tokens: 512}``; liger: ``{chunk_pairs, compile}``).
        optimizer, optimizer_options, learning_rate, weight_decay, betas, warmup_steps, min_lr_ratio,
            lr_schedule, decay_fraction, decay_shape, compile: as ``CausalLM``.
    """

    def __init__(
        self,
        model: ModelFactory,
        loss_type: LossType = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        gamma: float = 0.5,
        reference: Reference = "frozen",
        reference_cache: str | None = None,
        reference_model: str | None = None,
        logprobs: str = "torch",
        logprobs_options: dict[str, Any] | None = None,
        optimizer: str = "adamw",
        optimizer_options: dict[str, Any] | None = None,
        learning_rate: float = 5e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        lr_schedule: LrSchedule = "cosine",
        decay_fraction: float | None = None,
        decay_shape: DecayShape | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__(model, optimizer=optimizer, optimizer_options=optimizer_options, learning_rate=learning_rate,
                         weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
                         lr_schedule=lr_schedule, decay_fraction=decay_fraction, decay_shape=decay_shape,
                         compile=compile)
        self.preference_loss = PreferenceLoss(loss_type, beta, label_smoothing, gamma)
        if reference not in REFERENCES:
            raise ConfigError(f"{_KEY}.reference", reference, f"choose one of {REFERENCES}")
        if self.preference_loss.reference_free and reference != "none":
            raise ConfigError(f"{_KEY}.reference", reference, f"{loss_type} uses no reference model: set reference: none")
        if reference == "adapter" and self.factory.adapter is None:
            raise ConfigError(f"{_KEY}.reference", reference, "the adapter-disabled policy needs adapters: set "
                              "model.init_args.model.adapter, or use reference: frozen")
        if reference_cache is not None and reference != "precomputed":
            raise ConfigError(f"{_KEY}.reference_cache", reference_cache, "only reference: precomputed uses a cache")
        if reference_model is not None and reference not in ("frozen", "precomputed"):
            raise ConfigError(f"{_KEY}.reference_model", reference_model, "only reference: frozen or precomputed "
                              f"reads a reference checkpoint (reference is {reference})")
        self.reference_factory = reference_factory(self.factory, reference_model) if reference_model else None
        """How to build the separate reference checkpoint (None: the reference is the initial policy)."""
        # bad names/options/combinations fail before any model is built
        self.fused_loss = liger_dpo_loss(beta, loss_type, label_smoothing, reference, **(logprobs_options or {})) \
            if logprobs == LIGER else None
        if self.fused_loss is None:
            logprob_backend(logprobs, **(logprobs_options or {}))
        for key in ("loss", "loss_options"):  # CausalLM's token-loss backend: not a DPO option
            self.hparams.pop(key)
        self.save_hyperparameters({
            "_class_path": f"{type(self).__module__}.{type(self).__qualname__}", "model": asdict(self.factory),
            "loss_type": loss_type, "beta": beta, "label_smoothing": label_smoothing, "gamma": gamma,
            "reference": reference, "reference_cache": reference_cache, "reference_model": reference_model,
            "logprobs": logprobs,
            "logprobs_options": dict(logprobs_options or {}), "optimizer": optimizer,
            "optimizer_options": dict(optimizer_options or {}), "learning_rate": learning_rate,
            "weight_decay": weight_decay, "betas": tuple(betas), "warmup_steps": warmup_steps,
            "min_lr_ratio": min_lr_ratio, "lr_schedule": lr_schedule, "decay_fraction": decay_fraction,
            "decay_shape": decay_shape, "compile": compile})
        self.reference: SequenceLogProbs | None = None
        self.memory_categories = {"reference": ["reference", *(["model.reference_head"] if self.fused_loss else [])]}
        """``MemoryMonitor`` counts the frozen reference (and Liger's copy of its head) apart from ``params``."""
        self.reference_logps: Tensor | None = None
        """``precomputed``: ``[pairs in the data set, 2]`` reference log-probs (chosen, rejected)."""
        self.eval_reward_accuracy = MeanMetric()

    # --- the model --------------------------------------------------------------------------
    def trained_module(self, lm: PreTrainedModel) -> SequenceLogProbs:
        """The policy; with ``reference: frozen`` also the reference: a copy taken before any
        training, or the ``reference_model`` built beside it (and before sharding: the strategy
        parallelises both alike). Under ``logprobs: liger`` the reference only supplies its hidden
        states; the fused loss reads the reference's head from a frozen copy inside the policy."""
        frozen = self.hparams.reference == "frozen"
        if frozen:
            reference_lm = self._build_reference_lm() if self.reference_factory else copy.deepcopy(lm)
            self.reference = SequenceLogProbs(reference_lm, self._logprobs()).requires_grad_(False).eval()
        if self.fused_loss is None:
            return SequenceLogProbs(lm, self._logprobs())
        policy = LigerDPOPolicy(lm, self.fused_loss, frozen)
        if frozen:
            policy.reference_head.load_state_dict(reference_lm.get_output_embeddings().state_dict())
        return policy

    def _logprobs(self) -> TorchLogProbs:
        """The log-prob backend of a sequence module (plain torch under Liger, whose loss is fused)."""
        return TorchLogProbs() if self.fused_loss else logprob_backend(self.hparams.logprobs,
                                                                       **self.hparams.logprobs_options)

    def _build_reference_lm(self) -> PreTrainedModel:
        """The ``reference_model`` checkpoint, built where the policy is built (inside Lightning's
        ``configure_model`` context: on ``meta`` on a mesh strategy's ranks other than 0)."""
        return self.reference_factory.build(device=self.trainer.strategy.root_device if self._trainer else self.device)

    def train(self, mode: bool = True) -> DPO:
        """Lightning switches the whole module to train mode; the reference stays in eval mode."""
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self

    def flops_per_pair_batch(self, batch: dict[str, Any]) -> float:
        """Policy training FLOPs of the batch's real tokens, plus the frozen reference's forward."""
        return batch_model_flops(batch, self.flops_per_token) * preference_flops_factor(self.hparams.reference)

    # --- the step ---------------------------------------------------------------------------
    def pair_step(self, batch: dict[str, Any]) -> PairStep:
        """The batch's summed pair loss (what is trained) and per-pair log-probs and rewards."""
        if self.fused_loss is not None:
            reference_hidden = None
            if self.reference is not None:
                with torch.no_grad():
                    reference_hidden = self.reference(batch, hidden_only=True)
            return self.model(batch, reference_hidden)
        result, logps, _ = self.pair_losses(batch)
        pairs = int(batch["num_pairs"])
        return PairStep(result.losses.sum(), logps[:pairs], logps[pairs:], result.chosen_rewards,
                        result.rejected_rewards)

    def pair_losses(self, batch: dict[str, Any]) -> tuple[PairLosses, Tensor, Tensor]:
        """``(pair losses and rewards, policy logps [2P], response tokens [2P])`` of a batch (the
        per-token backends; the fused Liger loss gives only their sum: ``pair_step``)."""
        if self.fused_loss is not None:
            raise RuntimeError("logprobs: liger computes only the sum of the pair losses: use pair_step")
        logps, tokens = self.model(batch)
        reference = self.reference_sequence_logps(batch, logps)
        pairs = int(batch["num_pairs"])
        result = self.preference_loss(logps[:pairs], logps[pairs:], reference[:pairs], reference[pairs:],
                                      tokens[:pairs], tokens[pairs:])
        return result, logps.detach(), tokens

    def reference_sequence_logps(self, batch: dict[str, Any], like: Tensor) -> Tensor:
        """The reference's ``[2P]`` sequence log-probs for the batch (chosen, then rejected)."""
        if self.hparams.reference == "frozen":
            with torch.no_grad():
                return self.reference(batch)[0]
        if self.hparams.reference == "adapter":
            with torch.no_grad(), adapters_disabled(self.model):
                return self.model(batch)[0]
        if self.hparams.reference == "precomputed":
            if self.reference_logps is None:
                raise RuntimeError("reference: precomputed, but no reference log-probs were computed (on_fit_start)")
            return self.reference_logps[batch["pair_index"]].t().reshape(-1).to(like.device)
        return torch.zeros_like(like)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> StepOutput:
        strategy = self.trainer.strategy if self._trainer else None
        answers = interface_of(strategy)
        if answers.runs_forward_backward:  # a pipeline: each micro-batch's pairs, on the last stage
            totals, pairs = answers.forward_backward(
                self.model, {**batch, "reference_logps": self._pipeline_reference(batch)}, self.objective,
                unit_loss=self._micro_batch_pair_losses)
            loss_sum, statistics = totals[0], totals[1:].double()
        else:
            step = self.pair_step(batch)
            pairs = torch.tensor(int(batch["num_pairs"]), device=step.loss_sum.device)
            loss_sum, statistics = step.loss_sum, self._statistics(step, pairs)
        aux = collect_aux_losses(self.model)  # MoE router losses: trained on, logged apart
        for name, value in aux.items():
            self.log(f"train/{name}", value.detach())
        loss = self.objective.backward_loss(loss_sum, pairs, sum(aux.values(), 0.0), strategy)
        return {"loss": loss, "loss_sum": loss_sum.detach(), "tokens": batch["input_ids"].numel(),
                "useful_tokens": (batch["labels"] != IGNORE_INDEX).sum(), "flops": self.flops_per_pair_batch(batch),
                "loss_units": pairs, "preference": statistics}

    def _pipeline_reference(self, batch: dict[str, Any]) -> Tensor:
        """The reference's ``[2P]`` log-probs of the batch, for the pipeline's last stage: looked up, or
        zeros (the stages hold one model: a frozen reference is refused by the strategy)."""
        if self.hparams.reference not in ("precomputed", "none"):
            raise ConfigError(f"{_KEY}.reference", self.hparams.reference, "pipeline stages train DPO against a "
                              "precomputed reference (computed once through the stages) or none: use one of them")
        return self.reference_sequence_logps(batch, batch["labels"].new_zeros(2 * int(batch["num_pairs"]),
                                                                              dtype=torch.float32))

    def _micro_batch_pair_losses(self, outputs: tuple[Tensor, Tensor], batch: dict[str, Any]) -> Tensor:
        """A pipeline micro-batch's ``[pair-loss sum, *PREFERENCE_STATS sums]`` from the policy's
        ``(logps, response tokens)`` of its sequences (``StrategyInterface.forward_backward``'s ``unit_loss``)."""
        logps, tokens = outputs
        pairs, reference = int(batch["num_pairs"]), batch["reference_logps"]
        result = self.preference_loss(logps[:pairs], logps[pairs:], reference[:pairs], reference[pairs:],
                                      tokens[:pairs], tokens[pairs:])
        step = PairStep(result.losses.sum(), logps[:pairs].detach(), logps[pairs:].detach(), result.chosen_rewards,
                        result.rejected_rewards)
        count = torch.tensor(pairs, device=logps.device)
        return torch.cat([step.loss_sum.reshape(1), self._statistics(step, count).to(step.loss_sum.dtype)])

    @staticmethod
    def _statistics(step: PairStep, pairs: Tensor) -> Tensor:
        """``PREFERENCE_STATS`` summed over the micro-batch's pairs: one small device tensor."""
        return torch.stack([pairs.float(), step.loss_sum.detach(),
                            (step.chosen_rewards > step.rejected_rewards).float().sum(),
                            step.chosen_rewards.sum(), step.rejected_rewards.sum(),
                            step.chosen_logps.sum(), step.rejected_logps.sum()]).double()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._log_eval("val", batch)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._log_eval("test", batch)

    def _log_eval(self, split: str, batch: dict[str, Any]) -> None:
        """Pair-weighted means over the split (each batch weighs by its pairs)."""
        step = self.pair_step(batch)
        pairs = int(batch["num_pairs"])
        self.log(f"{split}/loss", step.loss_sum / pairs, prog_bar=True, sync_dist=True, batch_size=pairs)
        self.log(f"{split}/reward_margin", (step.chosen_rewards - step.rejected_rewards).mean(), sync_dist=True,
                 batch_size=pairs)
        self.eval_reward_accuracy.update((step.chosen_rewards > step.rejected_rewards).float())
        self.log(f"{split}/reward_accuracy", self.eval_reward_accuracy, prog_bar=True)

    # --- precomputed reference log-probs ----------------------------------------------------
    def on_fit_start(self) -> None:
        collator = getattr(getattr(self.trainer, "datamodule", None), "collator", None)
        if self.fused_loss is not None and collator is not None and not isinstance(collator, PreferencePaddingCollator):
            raise ConfigError("data.init_args.collator", type(collator).__name__, PADDED_ONLY_FIX)
        if self.hparams.reference == "precomputed":
            if self.reference_logps is None:
                self.reference_logps = self.precompute_reference(self.trainer.datamodule)
            self.reference_logps = self.reference_logps.to(self.device)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.reference_logps is not None:  # a resumed fit's policy is no longer the reference
            checkpoint["dpo_reference_logps"] = self.reference_logps.cpu()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "dpo_reference_logps" in checkpoint:
            self.reference_logps = checkpoint["dpo_reference_logps"]

    def precompute_reference(self, data: LMDataModule) -> Tensor:
        """``[pairs, 2]`` reference log-probs (chosen, rejected) of every pair of ``data`` (set up),
        indexed by ``pair_index``: from ``reference_cache`` when it holds them, else computed with
        the ``reference_model`` or the current model, which must then still be the initial one (and
        then cached). A cache is checked against the same model: one from another model is refused."""
        reference = self._reference_for_precompute()
        pairs = sorted([*data.train_set.examples, *data.val_set.examples], key=lambda p: int(p["pair_index"]))
        collator = PreferencePaddingCollator()
        collator.bind(data.tokenizer.pad_id, data.seq_len)
        fingerprint = _pairs_fingerprint(pairs)
        path = Path(self.hparams.reference_cache) if self.hparams.reference_cache else None
        if path is not None and path.is_file():
            cached = torch.load(path, weights_only=True)
            if cached.get("pairs_sha256") != fingerprint:
                raise ConfigError(f"{_KEY}.reference_cache", str(path),
                                  "it was computed for other preference pairs; delete it or give another path")
            probe = self._sequence_logps_of(reference, pairs[:1], collator, data.batch_size)
            if not torch.allclose(probe, cached["logps"][:1].to(probe), rtol=0, atol=PROBE_ATOL):
                raise ConfigError(f"{_KEY}.reference_cache", str(path),
                                  f"its log-probs differ from this run's {self._reference_name()} (another model, "
                                  "seed or dtype?); delete it or give another path")
            return cached["logps"]
        logps = self._sequence_logps_of(reference, pairs, collator, data.batch_size)
        if path is not None and (self._trainer is None or self.trainer.is_global_zero):
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"pairs_sha256": fingerprint, "logps": logps.cpu()}, path)
        return logps

    def _reference_name(self) -> str:
        return f"reference_model {self.hparams.reference_model}" if self.reference_factory else "initial model"

    def _reference_for_precompute(self) -> SequenceLogProbs:
        """The model that computes ``precomputed`` log-probs: the policy before training, or the
        ``reference_model`` built for it alone, as the policy was: on ``meta`` and then sharded by a
        mesh strategy (rank 0's weights copied into every rank's shards), else whole on the device.
        It is not part of the LightningModule: dropped once computed, absent from checkpoints."""
        if self.reference_factory is None:
            return self.model
        strategy = self.trainer.strategy if self._trainer else None
        with strategy.model_sharded_context() if strategy is not None else nullcontext():
            reference = SequenceLogProbs(self._build_reference_lm(), self._logprobs()).requires_grad_(False).eval()
        if isinstance(strategy, MeshStrategy):
            strategy.parallelize(reference)
        return reference.to(self.device)

    @torch.no_grad()
    def _sequence_logps_of(self, model: SequenceLogProbs, pairs: list[dict[str, Tensor]],
                           collator: PreferencePaddingCollator, batch_size: int) -> Tensor:
        """``[len(pairs), 2]`` log-probs under ``model`` (the reference).

        Data-parallel ranks split the pairs; all ranks run the same number of forwards (a
        sharded model gathers its layers collectively), then one all-reduce joins the shares.
        """
        strategy = self.trainer.strategy if self._trainer is not None else None
        replicas = interface_of(strategy).sampler_replicas
        count, rank = replicas["num_replicas"], replicas["rank"]
        mine = list(range(rank, len(pairs), count))
        batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
        steps = torch.tensor(len(batches), device=self.device)
        world = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if world:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        out = torch.zeros(len(pairs), 2, device=self.device)
        was_training = model.training
        model.eval()
        for step in range(int(steps)):
            indices = batches[step] if step < len(batches) else [0]  # a rank out of pairs keeps its peers company
            batch = move_data_to_device(collator([pairs[i] for i in indices]), self.device)
            logps = model(batch)[0].float().reshape(2, -1).t()
            if step < len(batches):
                out[indices] = logps
        model.train(was_training)
        if world:  # each pair was computed by one data-parallel replica, by each of its ranks
            dist.all_reduce(out)
            out /= dist.get_world_size() // count
        return out


def _pairs_fingerprint(pairs: list[dict[str, Tensor]]) -> str:
    """SHA-256 of every pair's tokens, labels and layout: which pairs a cache belongs to."""
    digest = hashlib.sha256()
    for pair in pairs:
        for key in ("input_ids", "labels", "chosen_tokens", "prompt_tokens", "pair_index"):
            digest.update(pair[key].numpy().tobytes())
    return digest.hexdigest()


def reference_factory(policy: ModelFactory, path: str) -> ModelFactory:
    """The ``reference_model`` checkpoint at ``path``, built as ``policy`` is (dtype, attention, MoE,
    fp8) without its adapters or quantisation. Refused in one line when it does not load or when its
    architecture or vocabulary differs from the policy's: the pairs are tokenized once for both, and
    FLOPs and memory count the reference as a copy of the policy."""
    key = f"{_KEY}.reference_model"
    try:
        factory = dataclasses.replace(policy, preset=None, config={}, pretrained=path, adapter=None, quantization=None)
        theirs = factory.hf_config()
    except ConfigError as err:
        raise ConfigError(key, path, err.fix) from err
    ours = policy.hf_config()
    differing = [f"{name} {getattr(theirs, name, None)} (the policy's: {getattr(ours, name, None)})"
                 for name in ("model_type", *SIZE_KEYS) if getattr(ours, name, None) != getattr(theirs, name, None)]
    if differing:
        raise ConfigError(key, path, f"its architecture differs from the policy's: {', '.join(differing)}; give a "
                          "checkpoint of the policy's architecture and vocabulary")
    return factory
