"""Compiled decoder layers: one graph per layer class that serves every packed width.

``torch.compile`` specialises a graph to the sizes it first sees and compiles again when one of
them changes (once: the size that changed is treated as dynamic from then on). Rows packed to the
longest row of their batch change width every step. So the sequence dimension of every tensor that
enters a decoder layer is marked dynamic before the first compile
(``torch._dynamo.maybe_mark_dynamic``): the embeddings and the rotary cos/sin by forward hooks on the
modules that make them, the positions and the mask lit-ablate prepares where it builds them
(``CausalLMWithLoss.hidden_states``). The first compile then serves every width. A mark is a hint,
not a constraint: code that still specialises a width compiles again, which ``KernelProfile``
counts as a recompile, rather than failing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

SEQUENCE_DIM = 1
"""The sequence dimension of the hidden states, positions and cos/sin a decoder layer takes (``[B, T, ...]``)."""
SEQUENCE_INPUT_MODULES = ("embed_tokens", "rotary_emb")
"""The decoder's submodules (transformers' names) whose outputs enter every layer with a sequence dimension."""


def compile_decoder_layers(layers: Sequence[nn.Module], decoder: nn.Module, backend: str = "inductor") -> None:
    """``torch.compile`` each of ``layers`` in place (the same graph for every layer of a class compiles
    once), with the sequence dimension of what ``decoder`` hands them marked dynamic."""
    for layer in layers:
        layer.compile(backend=backend)
    for name in SEQUENCE_INPUT_MODULES:
        module = getattr(decoder, name, None)
        if module is not None:
            module.register_forward_hook(_mark_outputs)


def mark_sequence_dynamic(tensor: Tensor, *dims: int) -> Tensor:
    """``tensor`` with its sequence dimensions ``dims`` marked dynamic for compiled layers (a hint)."""
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


def _mark_outputs(module: nn.Module, args: Any, output: Any) -> None:
    for tensor in output if isinstance(output, tuple) else (output,):
        if isinstance(tensor, Tensor) and tensor.ndim > SEQUENCE_DIM:
            mark_sequence_dynamic(tensor, SEQUENCE_DIM)
