"""``DPO``: preference training (DPO, IPO, hinge, SimPO) of a causal LM, padded or packed."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import PreTrainedModel

from lit_ablate.data.preference_collate import PreferencePaddingCollator
from lit_ablate.errors import ConfigError
from lit_ablate.estimate.flops import batch_model_flops, preference_flops_factor
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.models.losses.liger_dpo import LIGER, PADDED_ONLY_FIX, LigerDPOPolicy, liger_dpo_loss
from lit_ablate.models.losses.logprobs import TorchLogProbs, logprob_backend
from lit_ablate.models.losses.sequence_logprobs import PairStep, SequenceLogProbs
from lit_ablate.modules.causal_lm import CausalLM
from lit_ablate.modules.dpo_reference import DPOReference, Reference, checked_reference
from lit_ablate.modules.preference_loss import LossType, PairLosses, PreferenceLoss
from lit_ablate.modules.step_output import StepOutput
from lit_ablate.strategies.interface import interface_of


class DPO(DPOReference, CausalLM):
    """Preference optimisation of a causal LM; each optimizer step trains the mean over its pairs.

    The model, strategies, optimizer, schedule, exact step objective and run record are
    ``CausalLM``'s; what differs is the step: per pair, the summed response log-probabilities of
    the chosen and the rejected sequence under the policy (and the reference, ``DPOReference``) go
    into a preference loss. The objective of a step is the sum of pair losses over all its
    micro-batches and data-parallel ranks divided by the number of pairs (``StepObjective`` with
    pairs as units).

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
        reference_cache: with ``precomputed``, a file that keeps the log-probabilities for later
            runs (the runs of a study): reused when it holds the same pairs and its values match
            a fresh computation of the first pair, written otherwise.
        reference_model: with ``frozen`` or ``precomputed``, a separate reference checkpoint (a
            Hugging Face folder as ``save_pretrained`` or ``lit-ablate export`` writes it, or a hub
            name), e.g. the SFT model while the policy starts elsewhere (TRL's ``ref_model``). It is
            built as the policy is (``model``'s dtype, attention, MoE and fp8 options; not its
            adapters or quantisation) and must have the policy's architecture and vocabulary
            (FLOPs and memory are counted as the policy's). ``precomputed`` builds it (sharded by
            the strategy like the policy) only to compute the log-probs, then drops it.
        logprobs: the log-probability backend (``lit_ablate.models.losses.logprobs``): ``torch`` or ``chunked``;
            or ``liger``: Liger-Kernel's fused linear DPO loss (``lit_ablate.models.losses.liger_dpo``: padded
            batches, ``sigmoid``/``hinge``, reference ``frozen``/``none``; anything else is refused).
        logprobs_options: the backend's options (e.g. ``{chunk_tokens: 512}``; liger: ``{chunk_pairs, compile}``).
        learning_rate: peak learning rate, reached after ``warmup_steps`` (lower by default than
            ``CausalLM``'s: preference training starts from a trained model).
        weight_decay: decoupled decay on matrices only (not norms, biases, embeddings); none by
            default, as TRL's.
        optimization: ``CausalLM``'s other optimizer options, under the same keys (``optimizer``,
            ``optimizer_options``, ``betas``, ``warmup_steps``, ``min_lr_ratio``, ``lr_schedule``,
            ``decay_fraction``, ``decay_shape``, ``compile``): its signature is their one definition.
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
        learning_rate: float = 5e-4,
        weight_decay: float = 0.0,
        **optimization: Any,
    ) -> None:
        # DPO's losses are preference losses: CausalLM's token loss is given here, so it is no DPO option
        super().__init__(
            model,
            loss="torch",
            loss_options=None,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            **optimization,
        )
        self.preference_loss = PreferenceLoss(loss_type, beta, label_smoothing, gamma)
        self.reference_factory = checked_reference(
            self.factory, reference, reference_cache, reference_model, self.preference_loss.reference_free, loss_type
        )
        # bad names/options/combinations fail before any model is built
        self.fused_loss = (
            liger_dpo_loss(beta, loss_type, label_smoothing, reference, **(logprobs_options or {}))
            if logprobs == LIGER
            else None
        )
        if self.fused_loss is None:
            logprob_backend(logprobs, **(logprobs_options or {}))
        for key in ("loss", "loss_options"):  # saved with every argument by CausalLM: no DPO options
            self.hparams.pop(key)
        self.reference = None
        self.memory_categories = {"reference": ["reference", *(["model.reference_head"] if self.fused_loss else [])]}
        """``MemoryMonitor`` counts the frozen reference (and Liger's copy of its head) apart from ``params``."""
        self.reference_logps = None
        self.eval_reward_accuracy = MeanMetric()

    # --- the model --------------------------------------------------------------------------
    def trained_module(self, lm: PreTrainedModel) -> SequenceLogProbs:
        """The policy (and, with ``reference: frozen``, the reference beside it: ``frozen_reference_lm``).
        Under ``logprobs: liger`` the reference only supplies its hidden states; the fused loss reads
        the reference's head from a frozen copy inside the policy."""
        frozen = self.hparams.reference == "frozen"
        reference_lm = self.frozen_reference_lm(lm) if frozen else None
        if self.fused_loss is None:
            return SequenceLogProbs(lm, self._logprobs())
        policy = LigerDPOPolicy(lm, self.fused_loss, frozen)
        if frozen:
            policy.reference_head.load_state_dict(reference_lm.get_output_embeddings().state_dict())
        return policy

    def _logprobs(self) -> TorchLogProbs:
        """The log-prob backend of a sequence module (plain torch under Liger, whose loss is fused)."""
        return (
            TorchLogProbs()
            if self.fused_loss
            else logprob_backend(self.hparams.logprobs, **(self.hparams.logprobs_options or {}))
        )

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
        return PairStep(
            result.losses.sum(), logps[:pairs], logps[pairs:], result.chosen_rewards, result.rejected_rewards
        )

    def pair_losses(self, batch: dict[str, Any]) -> tuple[PairLosses, Tensor, Tensor]:
        """``(pair losses and rewards, policy logps [2P], response tokens [2P])`` of a batch (the
        per-token backends; the fused Liger loss gives only their sum: ``pair_step``)."""
        if self.fused_loss is not None:
            raise RuntimeError("logprobs: liger computes only the sum of the pair losses: use pair_step")
        logps, tokens = self.model(batch)
        reference = self.reference_sequence_logps(batch, logps)
        pairs = int(batch["num_pairs"])
        result = self.preference_loss(
            logps[:pairs], logps[pairs:], reference[:pairs], reference[pairs:], tokens[:pairs], tokens[pairs:]
        )
        return result, logps.detach(), tokens

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> StepOutput:
        strategy = self.trainer.strategy if self._trainer else None
        answers = interface_of(strategy)
        if answers.runs_forward_backward:  # a pipeline: each micro-batch's pairs, on the last stage
            totals, pairs = answers.forward_backward(
                self.model,
                {**batch, "reference_logps": self._pipeline_reference(batch)},
                self.objective,
                unit_loss=self._micro_batch_pair_losses,
            )
            loss_sum, statistics = totals[0], totals[1:].double()
        else:
            step = self.pair_step(batch)
            pairs = torch.full((), int(batch["num_pairs"]), device=step.loss_sum.device)  # no copy from the host
            loss_sum, statistics = step.loss_sum, self._statistics(step, pairs)
        return {
            **self.step_output(batch, loss_sum, pairs, strategy, self.flops_per_pair_batch(batch)),
            "useful_tokens": (batch["labels"] != IGNORE_INDEX).sum(),
            "loss_units": pairs,
            "preference": statistics,
        }

    def _micro_batch_pair_losses(self, outputs: tuple[Tensor, Tensor], batch: dict[str, Any]) -> Tensor:
        """A pipeline micro-batch's ``[pair-loss sum, *PREFERENCE_STATS sums]`` from the policy's
        ``(logps, response tokens)`` of its sequences (``StrategyInterface.forward_backward``'s ``unit_loss``)."""
        logps, tokens = outputs
        pairs, reference = int(batch["num_pairs"]), batch["reference_logps"]
        result = self.preference_loss(
            logps[:pairs], logps[pairs:], reference[:pairs], reference[pairs:], tokens[:pairs], tokens[pairs:]
        )
        step = PairStep(
            result.losses.sum(),
            logps[:pairs].detach(),
            logps[pairs:].detach(),
            result.chosen_rewards,
            result.rejected_rewards,
        )
        count = torch.tensor(pairs, device=logps.device)
        return torch.cat([step.loss_sum.reshape(1), self._statistics(step, count).to(step.loss_sum.dtype)])

    @staticmethod
    def _statistics(step: PairStep, pairs: Tensor) -> Tensor:
        """``PREFERENCE_STATS`` summed over the micro-batch's pairs: one small device tensor."""
        return torch.stack(
            [
                pairs.float(),
                step.loss_sum.detach(),
                (step.chosen_rewards > step.rejected_rewards).float().sum(),
                step.chosen_rewards.sum(),
                step.rejected_rewards.sum(),
                step.chosen_logps.sum(),
                step.rejected_logps.sum(),
            ]
        ).double()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._log_eval("val", batch)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._log_eval("test", batch)

    def _log_eval(self, split: str, batch: dict[str, Any]) -> None:
        """Pair-weighted means over the split (each batch weighs by its pairs)."""
        step = self.pair_step(batch)
        pairs = int(batch["num_pairs"])
        self.log(f"{split}/loss", step.loss_sum / pairs, prog_bar=True, sync_dist=True, batch_size=pairs)
        self.log(
            f"{split}/reward_margin",
            (step.chosen_rewards - step.rejected_rewards).mean(),
            sync_dist=True,
            batch_size=pairs,
        )
        self.eval_reward_accuracy.update((step.chosen_rewards > step.rejected_rewards).float())
        self.log(f"{split}/reward_accuracy", self.eval_reward_accuracy, prog_bar=True)

    def on_fit_start(self) -> None:
        collator = getattr(getattr(self.trainer, "datamodule", None), "collator", None)
        if self.fused_loss is not None and collator is not None and not isinstance(collator, PreferencePaddingCollator):
            raise ConfigError("data.init_args.collator", type(collator).__name__, PADDED_ONLY_FIX)
        super().on_fit_start()  # the precomputed reference
