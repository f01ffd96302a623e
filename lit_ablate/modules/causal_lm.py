"""``CausalLM``: pretraining and SFT of a Hugging Face causal LM."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.parsing import collect_init_args
from torch import Tensor
from transformers import PreTrainedModel

from lit_ablate.class_paths import import_class
from lit_ablate.data.resume_position import continue_unfinished_epoch
from lit_ablate.errors import ConfigError
from lit_ablate.estimate.flops import ParameterCounts, batch_model_flops, count_parameters, flops_per_token
from lit_ablate.models.attention.backends import check_attention_backend
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss, decoder_layers
from lit_ablate.models.compiled_layers import compile_decoder_layers
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.fp8.conversion import resolve_emulation
from lit_ablate.models.losses.loss_choice import LossChoice
from lit_ablate.models.moe.blocks import collect_aux_losses, experts_fallbacks, moe_blocks
from lit_ablate.modules.optim import (
    DecayShape,
    LRSchedule,
    LrSchedule,
    amp_clipping_rules_out_fused,
    build_optimizer,
    check_optimizer,
    check_optimizer_arguments,
    decay_groups,
    decay_names,
    implementation_of,
    module_arguments,
)
from lit_ablate.modules.step_output import StepOutput
from lit_ablate.strategies.interface import interface_of
from lit_ablate.strategies.step_objective import StepObjective
from lit_ablate.strategies.whole_checkpoint import by_position, keyed_by_name

OBJECTIVE_KEY = "step_objective"
"""Checkpoint entry: the step objective's run constant (``StepObjective.scale``), kept across a resume."""


class CausalLM(LightningModule):
    """Next-token training of a causal LM; each optimizer step trains the mean over its *useful* tokens.

    Choose it for pretraining (every token counts) and SFT (only response tokens count: the
    data module sets prompt labels to -100). The objective of a step is the sum of token losses
    over all its micro-batches and data-parallel ranks divided by their useful tokens, whatever
    the accumulation, the number of ranks or the packing (``StepObjective``). The model is built
    in ``configure_model`` so that a sharding strategy can build and shard it without first
    materialising it whole.

    Args:
        model: which model to build (preset, HF config mapping, or checkpoint path).
        loss: the cross-entropy backend (``lit_ablate.models.losses.cross_entropy``): ``torch`` is the reference.
        loss_options: the backend's options (e.g. ``{chunk_tokens: 512, z_loss_weight: 1e-4}``).
        optimizer: ``adamw`` (torch), ``bnb_adamw8bit``, ``bnb_paged_adamw8bit``, ``bnb_paged_adamw``
            (bitsandbytes) or ``torchao_adamw8bit`` (``lit_ablate.modules.optim``); one that cannot
            run under the run's strategy is refused before the model is built.
        optimizer_options: the optimizer class's own extra arguments (e.g. ``{min_8bit_size: 0}``);
            for ``adamw``, ``fused``/``foreach`` choose its implementation (default: fused where torch
            has the kernel and the parameters allow it, ``lit_ablate.modules.optim.adamw_implementation``).
        learning_rate: peak learning rate, reached after ``warmup_steps``.
        weight_decay: decoupled decay on matrices only (not norms, biases, embeddings).
        betas: AdamW betas.
        warmup_steps: linear warm-up steps of the learning rate (every schedule has one).
        min_lr_ratio: the decaying schedules end at this fraction of ``learning_rate``, in [0, 1]
            (transformers' schedules decay to 0: ``min_lr_ratio: 0``).
        lr_schedule: after the warm-up, ``cosine`` decay to ``min_lr_ratio`` over the run (the
            default), ``linear`` decay (the HF Trainer's and TRL's default), ``constant``, or ``wsd``:
            warm-up, stable at the peak, then a decay over the run's last ``decay_fraction``
            (``lit_ablate.modules.optim.LRSchedule``).
        decay_fraction: ``wsd`` only: the share of the run's steps spent decaying (default 0.1).
        decay_shape: ``wsd`` only: ``cosine`` (default), ``linear`` or ``sqrt`` (1 - sqrt(progress)).
        compile: ``torch.compile`` each decoder layer (one graph, compiled once, reused by every
            layer). Under a mesh strategy use its ``compile_layers`` instead, which compiles
            after activation checkpointing as its pipeline orders it.
    """

    def __init__(
        self,
        model: ModelFactory,
        loss: str = "torch",
        loss_options: dict[str, Any] | None = None,
        optimizer: str = "adamw",
        optimizer_options: dict[str, Any] | None = None,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        lr_schedule: LrSchedule = "cosine",
        decay_fraction: float | None = None,
        decay_shape: DecayShape | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(model, Mapping):  # a checkpoint's plain hyper-parameters (load_from_checkpoint)
            model = ModelFactory(**model)
        if learning_rate <= 0:
            raise ConfigError("model.init_args.learning_rate", learning_rate, "use a positive learning rate")
        if warmup_steps < 0:
            raise ConfigError("model.init_args.warmup_steps", warmup_steps, "use 0 or more warm-up steps")
        if weight_decay < 0:  # decay that grows the weights, accepted without a word
            raise ConfigError(
                "model.init_args.weight_decay", weight_decay, "use 0 (no decay) or a positive rate, e.g. 0.1"
            )
        self.learning_rate_schedule = LRSchedule(lr_schedule, warmup_steps, min_lr_ratio, decay_fraction, decay_shape)
        LossChoice(loss, dict(loss_options or {})).build()  # bad names/options fail here, before any model is built
        check_optimizer(optimizer)  # the strategy is checked in configure_model
        check_optimizer_arguments(optimizer, betas, dict(optimizer_options or {}), module_arguments(type(self)))
        # Every argument of the __init__ chain (a subclass's too, as its frame holds it), the model as plain
        # values, so checkpoints load with torch.load(weights_only=True). ``_class_path`` lets
        # LightningCLI's ``--ckpt_path`` (test, validate, resumed fit) re-parse them.
        arguments = {
            k: v
            for frame in collect_init_args(inspect.currentframe(), [], classes=(CausalLM,))
            for k, v in frame.items()
        }
        self.save_hyperparameters(
            {"_class_path": f"{type(self).__module__}.{type(self).__qualname__}", **arguments, "model": asdict(model)}
        )
        self.factory = model
        self.optimizer_name, self.optimizer_options = optimizer, dict(optimizer_options or {})
        self.model: CausalLMWithLoss | None = None
        self.parameter_counts: ParameterCounts | None = None
        self._decay_names: set[str] = set()
        self.objective = StepObjective()
        self.fp8_kernels: str | None = None
        """``real`` or ``emulated`` once an fp8 model is built (in the run record's environment), else None."""
        self._fp8_emulated_because: str | None = None
        self._optimizer_fallback: str | None = None
        self._routes_experts: bool | None = None  # whether the model has MoE blocks (router losses), found once
        self.optimizer_implementation: str | None = None
        """The update's kernels once the optimizer is built (``fused``/``foreach``/``for-loop``; None:
        another library's optimizer), in the run record's environment."""

    @classmethod
    def from_hparams(cls, hparams: dict[str, Any], inference: bool = False) -> CausalLM:
        """Rebuild from a checkpoint's ``hyper_parameters`` (as saved by ``__init__``), as the class
        that saved them (``_class_path``: ``CausalLM`` or a subclass such as ``DPO``).

        ``inference=True`` (generate, export) builds for unpacked inputs anywhere: transformers'
        ``sdpa`` attention, which every HF install loads and which equals the packed backends on
        one document per row, and no compile.
        """
        module_class = _saved_class(hparams.get("_class_path")) or cls
        hparams = {k: v for k, v in hparams.items() if not k.startswith("_")}
        if inference:  # fp8 layers keep nn.Linear's state-dict keys: inference computes in the model's dtype
            hparams.update(compile=False, model={**hparams["model"], "attn_implementation": "sdpa", "fp8": None})
        return module_class(**hparams)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self._check_vocabulary()
        self._check_compile_step()
        check_attention_backend(self.factory.attn_implementation, training=True)
        if self._trainer:
            check_optimizer(self.optimizer_name, self.trainer.strategy, self.trainer.strategy.root_device.type)
        device = self.trainer.strategy.root_device if self._trainer else self.device
        if self.factory.fp8 is not None:
            emulated, why = resolve_emulation(self.factory.fp8, device)
            self.fp8_kernels = "emulated" if emulated else "real"
            if emulated and self.factory.fp8.emulate == "auto":  # a fallback: warned (once built) and recorded
                self._fp8_emulated_because = why
        lm = self.factory.build(device=device)
        if self._fp8_emulated_because:
            rank_zero_warn(
                f"fp8 is emulated in fp32 matmuls (same numerics, no speed-up): {self._fp8_emulated_because}"
            )
        self.parameter_counts = count_parameters(lm, lm.config)
        self.model = self.trained_module(lm)
        # Which parameters decay is decided now, on the unwrapped model: sharding wrappers
        # (FSDP1's flat views) change shapes, so a later ndim test would see only vectors.
        self._decay_names = decay_names(self.model, lm.get_input_embeddings().weight)
        if self.hparams.compile:
            compile_decoder_layers(decoder_layers(self.model), self.model.lm.base_model)

    def trained_module(self, lm: PreTrainedModel) -> CausalLMWithLoss:
        """The module training runs and strategies parallelise, around the freshly built ``lm``
        (a hook: ``DPO`` returns sequence log-probabilities instead of a token loss)."""
        return CausalLMWithLoss(lm, LossChoice(self.hparams.loss, self.hparams.loss_options or {}).build())

    def _check_compile_step(self) -> None:
        """A mesh strategy compiles in its own pipeline step (after activation checkpointing)."""
        strategy = self.trainer.strategy if self._trainer else None
        if self.hparams.compile and interface_of(strategy).has_compile_step:
            raise ConfigError(
                "model.init_args.compile",
                True,
                f"{type(strategy).__name__} has its own step: set "
                "trainer.strategy.init_args.compile_layers: true instead",
            )

    def _check_vocabulary(self) -> None:
        """A tokenizer larger than the embedding table would index out of range mid-step."""
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None) if self._trainer else None
        vocab = self.factory.hf_config().vocab_size
        if tokenizer is not None and tokenizer.vocab_size > vocab:
            raise ConfigError(
                "model.init_args.model.config.vocab_size",
                vocab,
                f"the tokenizer has {tokenizer.vocab_size} tokens; use a vocab_size of at least that",
            )

    @property
    def fallbacks(self) -> list[str]:
        """Every slower path a model part took instead of the one asked for (in the run record)."""
        emulation = (
            [f"fp8 emulated in fp32 matmuls: {self._fp8_emulated_because}"] if self._fp8_emulated_because else []
        )
        optimizer = [self._optimizer_fallback] if self._optimizer_fallback else []
        return (experts_fallbacks(self.model) if self.model is not None else []) + emulation + optimizer

    @property
    def computes_in_fp8(self) -> bool:
        """Whether real fp8 kernels run the converted matmuls (``MFUMonitor`` then divides by an fp8 peak)."""
        return self.fp8_kernels == "real"

    def flops_per_token(self, seq_len: float) -> float:
        """Analytic training FLOPs per token at this context length (see ``lit_ablate.estimate``)."""
        return flops_per_token(self.parameter_counts, self.model.lm.config, seq_len)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> StepOutput:
        strategy = self.trainer.strategy if self._trainer else None
        answers = interface_of(strategy)
        if answers.runs_forward_backward:  # a pipeline runs forward and backward of its stages in one schedule
            loss_sum, useful = answers.forward_backward(self.model, batch, self.objective)
        else:
            loss_sum, useful = self.model(batch)
        return self.step_output(batch, loss_sum, useful, strategy, batch_model_flops(batch, self.flops_per_token))

    def step_output(
        self, batch: dict[str, Any], loss_sum: Tensor, units: Tensor, strategy: Strategy | None, flops: float
    ) -> StepOutput:
        """What the step's callbacks read, with the loss to backpropagate: ``loss_sum`` over ``units``
        (useful tokens; DPO: pairs, and it says its useful tokens) as the step objective scales it,
        plus the MoE router losses."""
        aux = self.router_losses()  # trained on, logged apart
        return {
            "loss": self.objective.backward_loss(loss_sum, units, sum(aux.values(), 0.0), strategy),
            "loss_sum": loss_sum.detach(),
            "tokens": batch["input_ids"].numel(),
            "useful_tokens": units,
            "flops": flops,
        }

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """Rescale the step's gradients to the global token mean right after its last backward,
        inside the closure: before clipping and before any ``on_before_optimizer_step`` hook."""

        def closure():
            result = optimizer_closure()
            params = (p for group in optimizer.param_groups for p in group["params"])
            self.objective.normalize_gradients(params, self.trainer.strategy, self.trainer.accumulate_grad_batches)
            return result

        optimizer.step(closure=closure)

    def router_losses(self) -> dict[str, Tensor]:
        """The MoE router losses of the last forward (``collect_aux_losses``; none for a dense model,
        found once), each logged as ``train/<name>`` on the steps that reach the loggers."""
        if self._routes_experts is None:
            self._routes_experts = bool(moe_blocks(self.model))
        aux = collect_aux_losses(self.model) if self._routes_experts else {}
        if aux and self._trainer and logs_step(self.trainer, self.trainer.global_step + 1):
            for name, value in aux.items():
                self.log(f"train/{name}", value.detach())
        return aux

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss, self.objective.last_step_loss = self.objective.last_step_loss, None
        if loss is not None and logs_step(self.trainer, self.trainer.global_step):  # an optimizer step just finished
            self.log("train/loss", loss)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._log_eval_loss("val/loss", batch)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._log_eval_loss("test/loss", batch)

    def _log_eval_loss(self, name: str, batch: dict[str, Any]) -> None:
        """Token-weighted: each batch weighs by its useful tokens, so the epoch value is the split's
        summed loss over its useful tokens (per rank), not a mean of batch means."""
        loss_sum, useful = self.model(batch)
        self.log(name, loss_sum / useful.clamp(min=1), prog_bar=True, sync_dist=True, batch_size=int(useful))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[OBJECTIVE_KEY] = {"scale": self.objective.scale}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume the step objective's run constant, the epoch a ``max_steps`` stop left unfinished
        (``continue_unfinished_epoch``), and take an optimizer state keyed by parameter name (a sharded folder
        read whole by a strategy that holds whole tensors: ``WholeCheckpointIO``) in the order of this
        module's optimizer."""
        continue_unfinished_epoch(checkpoint)
        self.objective.scale = (checkpoint.get(OBJECTIVE_KEY) or {}).get("scale")
        states = checkpoint.get("optimizer_states") or []
        if any(keyed_by_name(state) for state in states):
            names = self.optimizer_parameter_names()
            checkpoint["optimizer_states"] = [by_position(state, names) for state in states]

    def optimizer_parameter_names(self) -> list[list[str]]:
        """Each group of the optimizer ``configure_optimizers`` builds, as its parameters' names in this module."""
        names = {id(p): name for name, p in self.named_parameters()}
        return [
            [names[id(p)] for p in group["params"]]
            for group in decay_groups(self.model, self._decay_names, self.hparams.weight_decay)
        ]

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = decay_groups(self.model, self._decay_names, hp.weight_decay)
        not_fused = amp_clipping_rules_out_fused(str(self.trainer.precision), self.trainer.gradient_clip_val)
        optimizer, self._optimizer_fallback = build_optimizer(
            self.optimizer_name, groups, hp.learning_rate, hp.betas, self.optimizer_options, not_fused
        )
        self.optimizer_implementation = implementation_of(optimizer)
        total = self.trainer.estimated_stepping_batches
        scheduler = self.learning_rate_schedule.scheduler(optimizer, int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def logs_step(trainer: Trainer, step: int) -> bool:
    """Whether optimizer step ``step``'s values reach Lightning's loggers (every ``log_every_n_steps``,
    and the last step): only then is a value given to ``LightningModule.log``, whose bookkeeping costs
    about half a millisecond of host time per call. Its values reach ``trainer.callback_metrics`` on
    those steps; the progress bar shows the run's loss from the step clock instead
    (``StepMonitor.progress_bar_items``), read a step late, never waiting for the device."""
    if trainer.barebones:  # Lightning's mode without logging: a logged value only brings its warning
        return False
    every = trainer.log_every_n_steps
    return (every > 0 and step % every == 0) or trainer.should_stop or step == trainer.max_steps


def _saved_class(path: str | None) -> type[CausalLM] | None:
    """The ``CausalLM`` subclass a checkpoint's ``_class_path`` names (None: not recorded)."""
    if not path:
        return None
    try:
        saved = import_class(path)
    except ImportError:
        saved = None
    if not (isinstance(saved, type) and issubclass(saved, CausalLM)):
        raise ConfigError("--ckpt_path", path, "the checkpoint was not written by a lit-ablate CausalLM or subclass")
    return saved
