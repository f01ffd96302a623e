"""Whether the run's kernels run where it goes: the loss and attention backends, context parallelism's block
kernel and fp8's matmuls need their package and, some, CUDA. Each rule asks the part's own check, so what a
kernel needs is decided once, where the kernel is."""

from __future__ import annotations

import torch

from lit_ablate.errors import Refusal
from lit_ablate.extras import not_installed
from lit_ablate.models.fp8.conversion import FP8_KEY
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig


@rule(Scope.MACHINE, skips_variant=True)
def loss_backend_available(run: RunConfig) -> Refusal | None:
    """The loss kernel must run here (liger / cce need CUDA and their package, or the Triton interpreter
    opt-in at fp32/fp16; cce's kernel does not train in float32): ``LossChoice.check_runs_here``. An unknown
    name is the run's own mistake (``loss_backend_is_named``)."""
    loss = run.model.loss
    return refusal_of(loss.check_runs_here, run.compute_dtype) if loss.registered else None


@rule(Scope.MACHINE, skips_variant=True)
def attention_backend_available(run: RunConfig) -> Refusal | None:
    """The attention backend must train here (flash-attn installed, flex backward needs CUDA); an unknown name
    is left to the run's own error, as for losses."""
    from lit_ablate.models.attention.backends import (
        BACKENDS,
        TRANSFORMERS_BACKENDS,
        TRANSFORMERS_FLASH_BACKENDS,
        check_attention_backend,
    )

    name = run.model.attention
    if name not in (*TRANSFORMERS_BACKENDS, *TRANSFORMERS_FLASH_BACKENDS, *BACKENDS):
        return None
    return refusal_of(check_attention_backend, name, training=True)


@rule(Scope.MACHINE, skips_variant=True)
def cp_block_kernel_runs_here(run: RunConfig) -> Refusal | None:
    """Context parallelism's block kernel must train here (flash-attn installed, flex on CUDA)."""
    from lit_ablate.models.attention.block_kernels import block_kernel

    if run.mesh_size("cp") == 1:
        return None
    name = run.trainer.strategy.option("cp_block_kernel")
    return refusal_of(block_kernel, name, torch.device(run.trainer.device_type))


@rule(Scope.MACHINE, skips_variant=True)
def fp8_runs_here(run: RunConfig) -> Refusal | None:
    """fp8 needs torchao (the ``fp8`` extra), and ``emulate: false`` fp8 kernels on this device
    (``resolve_emulation``)."""
    if run.model.fp8 is None:
        return None
    missing = not_installed("torchao", "fp8 training (torchao float8)")
    if missing:
        return Refusal(FP8_KEY, run.model.fp8_section, missing)
    return _emulation_refusal(run)


@rule(Scope.CLUSTER, skips_variant=True)
def fp8_runs_on_cluster_nodes(run: RunConfig) -> Refusal | None:
    """``fp8_runs_here`` for a cluster's declared nodes: CPU nodes are judged as here; a GPU node's fp8
    kernels (its compute capability) are unknown where the study is planned, so the job's own start-up
    judges them (``lit-ablate fit`` refuses ``emulate: false`` in one line), as it judges its packages."""
    if run.model.fp8 is None or run.trainer.device_type == "cuda":
        return None
    return _emulation_refusal(run)


def _emulation_refusal(run: RunConfig) -> Refusal | None:
    from lit_ablate.models.fp8.conversion import resolve_emulation

    return refusal_of(resolve_emulation, run.model.fp8, torch.device(run.trainer.device_type))
