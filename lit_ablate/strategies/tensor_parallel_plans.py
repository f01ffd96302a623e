"""Tensor-parallel plans: which submodule of a Hugging Face decoder is split how, per model family.

A plan maps submodule names to DTensor ``ParallelStyle`` s, as ``parallelize_module`` takes them.
Megatron's layout: in attention, ``q/k/v`` are split by output columns (each rank holds whole
heads) and ``o_proj`` by input rows; in the MLP, ``gate/up`` by columns and ``down`` by rows. Each
block then needs one all-reduce forward and one backward, and the activations between the two
halves (heads, the intermediate MLP width) are divided by ``tp``. The embedding is split by
vocabulary rows and the LM head by vocabulary columns: the loss reads the head's vocabulary
shards as they are (``loss_parallel``), so the full ``[tokens, vocab]`` logits never exist.

With ``sequence_parallel``, the residual stream between blocks is split along the sequence instead
of replicated: the norms (and the residual adds) run on ``1 / tp`` of the tokens, the all-reduces
become an all-gather before each block and a reduce-scatter after it (same bytes moved), and the
norms' activations are divided by ``tp`` too.

Qwen3 normalises each head's queries and keys (``q_norm``/``k_norm`` over ``head_dim``). Each rank
holds only its heads, so the gradient of those norms' weights is a partial sum per rank; the plan
marks them ``SequenceParallel(sequence_dim=2)`` (the heads dimension is the sharded one), which
makes their weights replicated DTensors whose gradients DTensor all-reduces over ``tp``. (A grad
hook on the parameter would be lost once FSDP2 replaces the parameters.)

fp8 (``lit_ablate.models.fp8.conversion``): with ``float8=True`` the linear layers ``convert_fp8`` converted
(torchao's ``Float8Linear``) are split with torchao's float8 styles, which cast to fp8 *before* the
collective: under sequence parallelism the all-gather of a block's input (``PrepareFloat8ModuleInput``,
one cast shared by q/k/v or gate/up) and the backward all-gather of the row-parallel layers' output
gradients move fp8 bytes instead of high-precision ones. The numbers are those of the plain styles
(the cast's amax is DTensor's global one either way; measured: bit-identical losses), so a layer
left in high precision, the embedding and the LM head (never fp8) keep the plain styles.

One readable function per family; a strategy subclass replaces ``TensorParallelStrategy.layer_plan``
or ``root_plan`` to try another layout.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.models.adapters.lora import ADAPTER_KEY, ADAPTER_NAME
from lit_ablate.models.adapters.quantization import QUANTIZATION_KEY, is_quantized
from lit_ablate.torch_versions import DTENSOR_FLATTENS_SHARDED_SEQUENCES

Plan = dict[str, ParallelStyle | tuple[ParallelStyle, ...]]
"""Submodule name -> its style, or several styles applied in order (their hooks run in that order)."""


def root_plan(sequence_parallel: bool) -> Plan:
    """Embedding, final norm and LM head (names relative to the ``...ForCausalLM`` module).

    The LM head is split by vocabulary (its weight ``Shard(0)``); lit-ablate's loss calls no
    ``lm_head.forward`` (it reads the weight), so the head's output layout here is only what a plain
    ``lm(...)`` call (generation, evaluation logits) returns: gathered full logits.
    """
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: Plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Replicate()),
    }
    if sequence_parallel:
        # The loss needs every token's hidden state: the final norm hands back the full sequence.
        plan["model.norm"] = (
            SequenceParallel(use_local_output=False),
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
        )
    return plan


def llama_layer_plan(layer: nn.Module, sequence_parallel: bool, float8: bool = False) -> Plan:
    """Llama (and every family with its layer layout): split attention and MLP, Megatron style."""
    styles = _Styles(layer, float8)
    return {**_attention_plan(styles, sequence_parallel), **_mlp_plan(layer, styles, sequence_parallel)}


def qwen3_layer_plan(layer: nn.Module, sequence_parallel: bool, float8: bool = False) -> Plan:
    """Qwen3: Llama's plan, plus the per-head q/k norms, whose weight gradients must be all-reduced."""
    return {
        **llama_layer_plan(layer, sequence_parallel, float8),
        "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


LAYER_PLANS = {"llama": llama_layer_plan, "qwen3": qwen3_layer_plan, "qwen3_moe": qwen3_layer_plan}
"""Model type (HF ``config.model_type``) -> the function giving one decoder layer's plan."""


def layer_plan_for(model_type: str):  # a function like LAYER_PLANS' ones
    """The plan function of ``model_type``, with peft's LoRA layers retargeted (``adapter_plan``); an
    unknown family is refused with the known ones."""
    if model_type not in LAYER_PLANS:
        raise ConfigError(
            "model.init_args.model",
            model_type,
            f"tensor parallelism has plans for {sorted(LAYER_PLANS)}; add one for this family "
            "(override TensorParallelStrategy.layer_plan) or use tp: 1",
        )
    family_plan = LAYER_PLANS[model_type]

    def plan(layer: nn.Module, sequence_parallel: bool, float8: bool = False) -> Plan:
        return adapter_plan(layer, family_plan(layer, sequence_parallel, float8), sequence_parallel)

    return plan


def adapter_plan(layer: nn.Module, plan: Plan, sequence_parallel: bool = False) -> Plan:
    """``plan`` with each entry that names a peft LoRA layer aimed at the linears inside it.

    DTensor's styles split ``nn.Linear`` s only, and peft's layer computes ``base_layer(x) +
    lora_B(lora_A(x)) * scale``. Column-parallel base: ``base_layer`` and ``lora_B`` split by output
    columns (the sum is this rank's columns), ``lora_A`` whole on every rank (its input is the
    replicated ``x``, handed to it as a plain tensor under sequence parallelism, where the block's
    input arrives as a DTensor; the split ``lora_B`` all-reduces its input gradient as the base does).
    Row-parallel base: ``base_layer`` and ``lora_A`` split by input rows (``x`` arrives split), each
    all-reducing its output, ``lora_B`` whole. Under sequence parallelism both reduce-scatter their
    outputs along the sequence instead, so ``lora_B`` reads only this rank's tokens: it is marked
    ``SequenceParallel`` (a replicated DTensor weight whose gradient DTensor sums over ``tp``, as
    for the norms).
    The whole adapters compute the same values on every TP rank and get the same gradients, so they
    stay equal without a collective. Refused: DoRA (its magnitude needs the whole weight's row norms),
    dropout (the TP ranks would drop different inputs of the whole ``lora_A``) and a quantised base
    (bitsandbytes' packed weights, not split by rows or columns).
    """
    out: Plan = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        _check_not_quantized(name, getattr(module, "base_layer", module))
        if not _is_lora_layer(module):
            out[name] = style
            continue
        _check_adapter_splits(module)
        if sequence_parallel and (reason := sequence_parallel_adapters_refusal()):
            raise ConfigError(f"{STRATEGY_OPTIONS_KEY}.sequence_parallel", True, reason)
        out[f"{name}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            out[f"{name}.lora_B.{ADAPTER_NAME}"] = ColwiseParallel(
                output_layouts=style.output_layouts[0], use_local_output=style.use_local_output
            )
            if sequence_parallel:
                out[f"{name}.lora_A.{ADAPTER_NAME}"] = PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=True
                )
        elif isinstance(style, RowwiseParallel):
            out[f"{name}.lora_A.{ADAPTER_NAME}"] = RowwiseParallel(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
            if sequence_parallel:  # lora_B reads this rank's tokens: its weight gradient is summed over tp
                out[f"{name}.lora_B.{ADAPTER_NAME}"] = SequenceParallel(use_local_output=True)
        else:
            raise ConfigError(
                ADAPTER_KEY + ".target_modules",
                name,
                f"its tensor-parallel style {type(style).__name__} has no adapter split; "
                "leave it out of target_modules or use tp: 1",
            )
    return out


def sequence_parallel_adapters_refusal() -> str | None:
    """Why LoRA adapters cannot train under sequence parallelism with this torch, or None: the
    row-parallel layers' ``lora_B`` is a linear layer on a sequence-sharded DTensor
    (``DTENSOR_FLATTENS_SHARDED_SEQUENCES``)."""
    if DTENSOR_FLATTENS_SHARDED_SEQUENCES:
        return None
    return (
        f"LoRA's lora_B under sequence parallelism is a linear layer on a sequence-sharded DTensor, which "
        f"torch {torch.__version__} cannot compute (torch >= 2.12 can); set sequence_parallel: false, or upgrade torch"
    )


def _is_lora_layer(module: nn.Module) -> bool:
    if "peft" not in sys.modules:  # nothing can have injected adapters
        return False
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _check_not_quantized(name: str, module: nn.Module) -> None:
    weight = getattr(module, "weight", None)
    if weight is not None and is_quantized(weight):
        raise ConfigError(
            QUANTIZATION_KEY,
            name,
            "tensor parallelism splits weights by rows or columns, which "
            "bitsandbytes' packed blocks are not built for; use tp: 1 (FSDP2 shards QLoRA)",
        )


def _check_adapter_splits(module: nn.Module) -> None:
    if any(module.use_dora.values()):
        raise ConfigError(
            ADAPTER_KEY + ".use_dora",
            True,
            "DoRA's magnitude needs the row norms of the "
            "whole weight, which tensor parallelism splits; use use_dora: false or tp: 1",
        )
    if any(isinstance(dropout, nn.Dropout) and dropout.p for dropout in module.lora_dropout.values()):
        raise ConfigError(
            ADAPTER_KEY + ".dropout",
            module.lora_dropout[ADAPTER_NAME].p,
            "the TP ranks would drop different inputs of the adapter they all hold whole; use dropout: 0 or tp: 1",
        )


class _Styles:
    """Each linear layer's style: torchao's float8 variant for a converted layer when ``float8``,
    else DTensor's; a block's input is prepared in fp8 only when every layer reading it is converted."""

    def __init__(self, layer: nn.Module, float8: bool) -> None:
        self.layer, self.float8 = layer, float8

    def colwise(self, name: str, **kwargs: Any) -> ParallelStyle:
        return (_torchao_styles()[0] if self._converted(name) else ColwiseParallel)(**kwargs)

    def rowwise(self, name: str, **kwargs: Any) -> ParallelStyle:
        return (_torchao_styles()[1] if self._converted(name) else RowwiseParallel)(**kwargs)

    def prepare_input(self, readers: tuple[str, ...], **kwargs: Any) -> ParallelStyle:
        return (_torchao_styles()[2] if all(map(self._converted, readers)) else PrepareModuleInput)(**kwargs)

    def _converted(self, name: str) -> bool:
        if not self.float8:
            return False
        from torchao.float8.float8_linear import Float8Linear

        return isinstance(self.layer.get_submodule(name), Float8Linear)


def _torchao_styles() -> tuple[type[ParallelStyle], ...]:
    """torchao's float8 colwise, rowwise and input styles (imported only when a plan needs them)."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def _attention_plan(styles: _Styles, sequence_parallel: bool) -> Plan:
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: Plan = {
        "self_attn.q_proj": styles.colwise("self_attn.q_proj"),
        "self_attn.k_proj": styles.colwise("self_attn.k_proj"),
        "self_attn.v_proj": styles.colwise("self_attn.v_proj"),
        "self_attn.o_proj": styles.rowwise("self_attn.o_proj", output_layouts=residual),
    }
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["self_attn"] = styles.prepare_input(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
    return plan


def _mlp_plan(layer: nn.Module, styles: _Styles, sequence_parallel: bool) -> Plan:
    """A dense MLP is split; an MoE block (Qwen3-MoE) stays whole on every rank: each TP peer routes
    the same tokens through the same experts (expert parallelism is the ``ep`` dimension's job)."""
    plan: Plan = {}
    if sequence_parallel:
        plan["post_attention_layernorm"] = SequenceParallel()
    dense = hasattr(layer.mlp, "gate_proj")
    if dense:
        residual = Shard(1) if sequence_parallel else Replicate()
        plan.update(
            {
                "mlp.gate_proj": styles.colwise("mlp.gate_proj"),
                "mlp.up_proj": styles.colwise("mlp.up_proj"),
                "mlp.down_proj": styles.rowwise("mlp.down_proj", output_layouts=residual),
            }
        )
        if sequence_parallel:
            plan["mlp"] = styles.prepare_input(
                ("mlp.gate_proj", "mlp.up_proj"), input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    elif sequence_parallel:  # the whole sequence in, this rank's slice of the output back
        plan["mlp"] = (
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        )
    return plan
