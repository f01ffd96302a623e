"""Parts that cannot train together: the module and its data, the loss or adapters under tensor parallelism,
and the optimizer under the strategy. A part checks its own arguments; which other part is active is
judged here."""

from __future__ import annotations

from lit_ablate.errors import Refusal
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig


@rule(Scope.CONFIG, skips_variant=True)
def preference_parts_fit(run: RunConfig) -> Refusal | None:
    """DPO's parts must agree: ``DPO`` and its subclasses (known by type, whatever their name) train on
    ``format: preference`` (and only they do), prefix sharing needs an attention backend that takes its branch
    mask (``sdpa``/``eager``: varlen and packed kernels know documents, not branches), and ``logprobs: liger``
    sums one sequence per padded row (no packed rows)."""
    from lit_ablate.models.attention.prefix_sharing import MASK_BACKENDS
    from lit_ablate.modules.dpo import DPO

    module = run.model.module
    dpo = module.is_a(DPO)  # research subclasses included
    data_format = run.data.format
    if dpo and data_format not in (None, "preference"):
        return Refusal(
            "data.init_args.format",
            data_format,
            "DPO trains on preference pairs; use format: preference",
            shown=data_format,
        )
    if module.cls is not None and not dpo and data_format == "preference":
        return Refusal(
            "data.init_args.format",
            data_format,
            f"{module.class_path} trains on tokens; preference pairs need lit_ablate.modules.DPO or a subclass of it",
            shown=data_format,
        )
    packed = run.data.packs_preference_pairs
    attention = run.model.attention
    if packed and run.data.collator.option("prefix_sharing") and attention not in MASK_BACKENDS:
        return Refusal(
            "model.init_args.model.attn_implementation",
            attention,
            "prefix sharing masks the rejected "
            f"branch off the chosen one, which only {MASK_BACKENDS} take; use one of them or prefix_sharing: "
            "false",
            shown=attention,
        )
    if dpo and packed and run.model.option("logprobs") == "liger":
        return Refusal(
            "model.init_args.logprobs",
            "liger",
            "Liger's fused DPO sums one sequence per padded row; use "
            "PreferencePaddingCollator, or logprobs: chunked for packed rows",
            shown="liger",
        )
    return None


@rule(Scope.MACHINE, Scope.CLUSTER, skips_variant=True)
def optimizer_runs_here(run: RunConfig) -> Refusal | None:
    """The optimizer must update the strategy's parameters on the run's device (bitsandbytes' 8-bit AdamW
    cannot update FSDP2's DTensors; paged optimizers need CUDA): ``optimizer_refusal``."""
    from lit_ablate.modules.optim import OPTIMIZER_KEY, OPTIMIZERS, optimizer_refusal

    name = run.model.optimizer
    if name not in OPTIMIZERS:  # default AdamW, or an unknown name: the module's own refusal
        return None
    reason = optimizer_refusal(name, run.trainer.strategy.cls, run.trainer.device_type)
    return Refusal(OPTIMIZER_KEY, name, reason, shown=name) if reason else None


@rule(Scope.CONFIG, skips_variant=True)
def tensor_parallel_loss_fits(run: RunConfig) -> Refusal | None:
    """Tensor parallelism takes the ``torch`` (without z-loss) and ``chunked`` loss backends: those compute on
    a vocabulary-sharded LM head (``LossChoice.check_tensor_parallel``)."""
    return None if run.mesh_size("tp") == 1 else refusal_of(run.model.loss.check_tensor_parallel)


@rule(Scope.CONFIG, skips_variant=True)
def sequence_parallel_adapters_run_here(run: RunConfig) -> Refusal | None:
    """LoRA adapters under sequence parallelism need a torch whose DTensor computes a linear layer on a
    sequence-sharded input (``sequence_parallel_adapters_refusal``; the plan refuses the same mid-run)."""
    from lit_ablate.strategies.tensor_parallel_plans import sequence_parallel_adapters_refusal

    if (
        run.mesh_size("tp") == 1
        or not run.trainer.strategy.option("sequence_parallel", False)
        or run.model.adapter_section is None
    ):
        return None
    reason = sequence_parallel_adapters_refusal()
    return Refusal(f"{STRATEGY_OPTIONS_KEY}.sequence_parallel", True, reason) if reason else None
