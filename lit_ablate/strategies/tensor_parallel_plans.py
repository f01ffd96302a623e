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

One readable function per family; a strategy subclass replaces ``TensorParallelStrategy.layer_plan``
or ``root_plan`` to try another layout.
"""

from __future__ import annotations

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


def llama_layer_plan(layer: nn.Module, sequence_parallel: bool) -> Plan:
    """Llama (and every family with its layer layout): split attention and MLP, Megatron style."""
    return {**_attention_plan(sequence_parallel), **_mlp_plan(layer, sequence_parallel)}


def qwen3_layer_plan(layer: nn.Module, sequence_parallel: bool) -> Plan:
    """Qwen3: Llama's plan, plus the per-head q/k norms, whose weight gradients must be all-reduced."""
    return {
        **llama_layer_plan(layer, sequence_parallel),
        "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


LAYER_PLANS = {"llama": llama_layer_plan, "qwen3": qwen3_layer_plan, "qwen3_moe": qwen3_layer_plan}
"""Model type (HF ``config.model_type``) -> the function giving one decoder layer's plan."""


def layer_plan_for(model_type: str):  # noqa: ANN201 (one of LAYER_PLANS' functions)
    """The plan function of ``model_type``; an unknown family is refused with the known ones."""
    if model_type not in LAYER_PLANS:
        raise ConfigError("model.init_args.model", model_type,
                          f"tensor parallelism has plans for {sorted(LAYER_PLANS)}; add one for this family "
                          "(override TensorParallelStrategy.layer_plan) or use tp: 1")
    return LAYER_PLANS[model_type]


def _attention_plan(sequence_parallel: bool) -> Plan:
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: Plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        )
    return plan


def _mlp_plan(layer: nn.Module, sequence_parallel: bool) -> Plan:
    """A dense MLP is split; an MoE block (Qwen3-MoE) stays whole on every rank: each TP peer routes
    the same tokens through the same experts (expert parallelism is the ``ep`` dimension's job)."""
    plan: Plan = {}
    if sequence_parallel:
        plan["post_attention_layernorm"] = SequenceParallel()
    dense = hasattr(layer.mlp, "gate_proj")
    if dense:
        residual = Shard(1) if sequence_parallel else Replicate()
        plan.update({
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=residual),
        })
        if sequence_parallel:
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    elif sequence_parallel:  # the whole sequence in, this rank's slice of the output back
        plan["mlp"] = (
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
            PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        )
    return plan
