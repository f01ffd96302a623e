"""The reference of a DPO step in its four modes, and the cache of precomputed reference log-probs.

A preference loss compares the policy's log-probabilities with a reference's. ``DPOReference`` is
the part of ``DPO`` that answers "what are the reference's log-probs of this batch?":

- ``frozen``: a second model (a copy of the initial policy, or a ``reference_model`` checkpoint),
  built and sharded beside the policy, never stepped, run without gradients;
- ``adapter``: the policy itself with its LoRA adapters switched off (the frozen base);
- ``precomputed``: a ``[pairs, 2]`` table computed once before training (data-parallel ranks
  split the pairs), kept in checkpoints and, with ``reference_cache``, in a file for later runs;
- ``none``: zeros (reference-free losses such as SimPO).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor
from transformers import PreTrainedModel

from lit_ablate.data.datamodule import LMDataModule
from lit_ablate.data.preference_collate import PreferencePaddingCollator
from lit_ablate.errors import ConfigError
from lit_ablate.models.adapters.lora import adapters_disabled
from lit_ablate.models.factory import SIZE_KEYS, ModelFactory
from lit_ablate.models.losses.sequence_logprobs import SequenceLogProbs
from lit_ablate.strategies.interface import interface_of
from lit_ablate.strategies.mesh import MeshStrategy

Reference = Literal["frozen", "adapter", "precomputed", "none"]
REFERENCES = ("frozen", "adapter", "precomputed", "none")
PROBE_ATOL = 1e-4
"""A cached reference log-prob must match a fresh computation of the same pair this closely (fp32
sums of a few hundred token log-probs in another batch layout differ by ~1e-5 at most)."""
KEY = "model.init_args"


def checked_reference(
    policy: ModelFactory,
    reference: str,
    reference_cache: str | None,
    reference_model: str | None,
    reference_free: bool,
    loss_type: str,
) -> ModelFactory | None:
    """Refuse, in one line, a reference mode the other options contradict; return how to build the
    separate ``reference_model`` (None: the reference is the initial policy)."""
    if reference not in REFERENCES:
        raise ConfigError(f"{KEY}.reference", reference, f"choose one of {REFERENCES}")
    if reference_free and reference != "none":
        raise ConfigError(f"{KEY}.reference", reference, f"{loss_type} uses no reference model: set reference: none")
    if reference == "adapter" and policy.adapter is None:
        raise ConfigError(
            f"{KEY}.reference",
            reference,
            "the adapter-disabled policy needs adapters: set model.init_args.model.adapter, or use reference: frozen",
        )
    if reference_cache is not None and reference != "precomputed":
        raise ConfigError(f"{KEY}.reference_cache", reference_cache, "only reference: precomputed uses a cache")
    if reference_model is not None and reference not in ("frozen", "precomputed"):
        raise ConfigError(
            f"{KEY}.reference_model",
            reference_model,
            f"only reference: frozen or precomputed reads a reference checkpoint (reference is {reference})",
        )
    return reference_factory(policy, reference_model) if reference_model else None


class DPOReference:
    """The reference half of ``DPO`` (a LightningModule mixin): the frozen model, the adapter switch,
    the precomputed table with its cache, and which of them a batch is scored by.

    It reads ``DPO``'s ``hparams`` (``reference``, ``reference_cache``, ``reference_model``), its
    ``model`` (the policy) and ``_logprobs()`` (the log-prob backend a reference runs).
    """

    reference_factory: ModelFactory | None
    """How to build the separate reference checkpoint (None: the reference is the initial policy)."""
    reference: SequenceLogProbs | None
    """``frozen``: the second model (the memory monitor counts it apart from ``params``)."""
    reference_logps: Tensor | None
    """``precomputed``: ``[pairs in the data set, 2]`` reference log-probs (chosen, rejected)."""

    def frozen_reference_lm(self, lm: PreTrainedModel) -> PreTrainedModel:
        """``frozen``: the reference's LM, a copy of ``lm`` taken before any training or the
        ``reference_model`` built beside it (before sharding: the strategy parallelises both alike);
        ``self.reference`` runs it, frozen and in eval mode."""
        reference_lm = self._build_reference_lm() if self.reference_factory else copy.deepcopy(lm)
        self.reference = SequenceLogProbs(reference_lm, self._logprobs()).requires_grad_(False).eval()
        return reference_lm

    def _build_reference_lm(self) -> PreTrainedModel:
        """The ``reference_model`` checkpoint, built where the policy is built (inside Lightning's
        ``configure_model`` context: on ``meta`` on a mesh strategy's ranks other than 0)."""
        return self.reference_factory.build(device=self.trainer.strategy.root_device if self._trainer else self.device)

    def train(self, mode: bool = True) -> DPOReference:
        """Lightning switches the whole module to train mode; the reference stays in eval mode."""
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self

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

    def _pipeline_reference(self, batch: dict[str, Any]) -> Tensor:
        """The reference's ``[2P]`` log-probs of the batch, for the pipeline's last stage: looked up, or
        zeros (the stages hold one model: a frozen reference is refused by the strategy)."""
        if self.hparams.reference not in ("precomputed", "none"):
            raise ConfigError(
                f"{KEY}.reference",
                self.hparams.reference,
                "pipeline stages train DPO against a "
                "precomputed reference (computed once through the stages) or none: use one of them",
            )
        return self.reference_sequence_logps(
            batch, batch["labels"].new_zeros(2 * int(batch["num_pairs"]), dtype=torch.float32)
        )

    # --- precomputed reference log-probs ----------------------------------------------------
    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.hparams.reference == "precomputed":
            if self.reference_logps is None:
                self.reference_logps = self.precompute_reference(self.trainer.datamodule)
            self.reference_logps = self.reference_logps.to(self.device)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.reference_logps is not None:  # a resumed fit's policy is no longer the reference
            checkpoint["dpo_reference_logps"] = self.reference_logps.cpu()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
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
        fingerprint = pairs_fingerprint(pairs)
        path = Path(self.hparams.reference_cache) if self.hparams.reference_cache else None
        if path is not None and path.is_file():
            cached = torch.load(path, weights_only=True)
            if cached.get("pairs_sha256") != fingerprint:
                raise ConfigError(
                    f"{KEY}.reference_cache",
                    str(path),
                    "it was computed for other preference pairs; delete it or give another path",
                )
            probe = self._sequence_logps_of(reference, pairs[:1], collator, data.batch_size)
            if not torch.allclose(probe, cached["logps"][:1].to(probe), rtol=0, atol=PROBE_ATOL):
                raise ConfigError(
                    f"{KEY}.reference_cache",
                    str(path),
                    f"its log-probs differ from this run's {self._reference_name()} (another model, "
                    "seed or dtype?); delete it or give another path",
                )
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
    def _sequence_logps_of(
        self,
        model: SequenceLogProbs,
        pairs: list[dict[str, Tensor]],
        collator: PreferencePaddingCollator,
        batch_size: int,
    ) -> Tensor:
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


def pairs_fingerprint(pairs: list[dict[str, Tensor]]) -> str:
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
    key = f"{KEY}.reference_model"
    try:
        factory = dataclasses.replace(policy, preset=None, config={}, pretrained=path, adapter=None, quantization=None)
        theirs = factory.hf_config()
    except ConfigError as err:
        raise ConfigError(key, path, err.fix) from err
    ours = policy.hf_config()
    differing = [
        f"{name} {getattr(theirs, name, None)} (the policy's: {getattr(ours, name, None)})"
        for name in ("model_type", *SIZE_KEYS)
        if getattr(ours, name, None) != getattr(theirs, name, None)
    ]
    if differing:
        raise ConfigError(
            key,
            path,
            f"its architecture differs from the policy's: {', '.join(differing)}; give a "
            "checkpoint of the policy's architecture and vocabulary",
        )
    return factory
