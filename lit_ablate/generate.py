"""``lit-ablate generate``: sample text from a ``fit`` checkpoint (a quick look at what trained)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser

from lit_ablate.errors import ConfigError


def recorded_tokenizer(checkpoint: dict[str, Any]) -> str | None:
    """The tokenizer the data module recorded in its state (``LMDataModule.state_dict``)."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), str):
            return value["tokenizer"]
    return None


def generate(ckpt_path: str, prompt: str, max_new_tokens: int = 32, temperature: float = 0.0,
             top_k: int | None = None, tokenizer: str | None = None, seed: int = 0) -> str:
    """The prompt's continuation. ``temperature`` 0 is greedy decoding; ``top_k`` limits sampling."""
    from lit_ablate.data import load_tokenizer
    from lit_ablate.modules import CausalLM

    if not Path(ckpt_path).is_file():
        raise ConfigError("ckpt_path", ckpt_path, "give the path of a .ckpt file written by lit-ablate fit")
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    spec = tokenizer or recorded_tokenizer(checkpoint)
    if spec is None:
        raise ConfigError("tokenizer", None, "the checkpoint records no tokenizer; pass --tokenizer byte or a path")
    tok = load_tokenizer(spec)
    module = CausalLM.from_hparams(checkpoint["hyper_parameters"], inference=True)
    module.configure_model()
    module.load_state_dict(checkpoint["state_dict"])
    lm = module.model.lm.eval()
    torch.manual_seed(seed)
    input_ids = torch.tensor([tok.encode(prompt)])
    sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = lm.generate(input_ids, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_id,
                          pad_token_id=tok.pad_id, **sampling)
    return tok.decode(out[0, input_ids.shape[1]:].tolist())


def generate_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="lit-ablate generate", description=__doc__, allow_abbrev=False)
    parser.add_function_arguments(generate)
    args = parser.parse_args(argv)
    print(args.prompt + generate(**vars(args)))
    return 0
