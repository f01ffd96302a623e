"""Real model shapes the benchmarks measure at (random init: only the shape matters), by name.

``model_config(name)`` also takes lit-ablate's tiny presets (``tiny-llama``, ``tiny-qwen3``, ...),
so a benchmark's ``--shape``/``--preset`` runs the real shape on a GPU and a tiny one on a CPU.
"""

from __future__ import annotations

from typing import Any

CPU_35M: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
"""A Llama-shaped 35.7M model (31.5M in matmuls) large enough to be matmul-bound on a CPU (``benchmarks/mfu.py``)."""

QWEN3_0_6B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}
"""Qwen3-0.6B's config: the seed study's dense model (596M parameters, the embedding tied)."""

QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}
"""Qwen3-8B's config: hidden 4096, where fp8 matmuls can pay for their casts."""

SHAPES: dict[str, dict[str, Any]] = {"cpu-35m": CPU_35M, "qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B}


def model_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """A copy of shape ``name``'s config (or of lit-ablate's preset of that name), optionally with
    only ``layers`` decoder layers (a real width at a depth that fits a benchmark's time)."""
    from lit_ablate.models.presets import preset_config

    config = dict(SHAPES[name]) if name in SHAPES else preset_config(name)
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def shape_names() -> list[str]:
    from lit_ablate.models.presets import PRESETS

    return [*SHAPES, *PRESETS]
