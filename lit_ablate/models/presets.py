"""Named tiny model shapes for tests, examples and the quickstart.

Each preset is a Hugging Face config mapping (``model_type`` plus sizes) of about 1M
parameters, small enough that a CPU trains it in seconds, shaped like the real family so the
same code paths (GQA, q/k norms, MoE routing) run. The vocabulary covers the built-in byte
tokenizer (256 bytes + specials).
"""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", **_COMMON},
    "tiny-qwen3": {"model_type": "qwen3", "head_dim": 32, **_COMMON},
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe",
        "head_dim": 32,
        "moe_intermediate_size": 96,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        **_COMMON,
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s config mapping; a clear error lists the known names."""
    from lit_ablate.errors import ConfigError

    if name not in PRESETS:
        raise ConfigError("model.init_args.model.preset", name, f"choose one of {sorted(PRESETS)}")
    return dict(PRESETS[name])
