"""``lit-ablate generate``: sample text from a ``fit`` checkpoint (a quick look at what trained)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser

from lit_ablate.errors import ConfigError
from lit_ablate.extras import require
from lit_ablate.path_checks import (
    SHARDED_METADATA_FILENAME,
    checkpoint_path,
    deepspeed_states_file,
    is_deepspeed_checkpoint,
)


def load_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """A ``fit`` checkpoint read with ``weights_only=True``: the ``.ckpt`` file, a sharded folder's
    ``meta.pt`` or a DeepSpeed folder's states file (hyper-parameters and data state; the weights:
    ``model_weights``). Anything else is a one-line error."""
    path = checkpoint_path("--ckpt_path", ckpt_path, deepspeed=True)
    if is_deepspeed_checkpoint(path):
        states = deepspeed_states_file(path)
    else:
        states = path / SHARDED_METADATA_FILENAME if path.is_dir() else path
    try:
        checkpoint = torch.load(states, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:  # a zip torch.save did not write, or a cut one
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            "--ckpt_path",
            str(ckpt_path),
            f"torch cannot read it as a checkpoint ({first}); give a checkpoint written by lit-ablate fit",
        ) from err
    if not isinstance(checkpoint, dict) or "hyper_parameters" not in checkpoint:
        raise ConfigError(
            "--ckpt_path",
            str(ckpt_path),
            "it holds no hyper_parameters; give a checkpoint of lit_ablate.modules.CausalLM written by lit-ablate fit",
        )
    return checkpoint


def model_weights(ckpt_path: str | Path, checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's whole tensors: a ``.ckpt`` file's ``state_dict`` (``checkpoint``, as loaded), read from
    a sharded folder whatever layout wrote it (``read_whole``; the optimizer's shards are not read), or
    from a DeepSpeed folder its fp32 partitions joined (DeepSpeed's ``zero_to_fp32``; any ZeRO stage)."""
    from lit_ablate.strategies.whole_checkpoint import MODEL_KEY, read_whole

    if is_deepspeed_checkpoint(ckpt_path):
        require("deepspeed", "--ckpt_path", str(ckpt_path), "reading a DeepSpeed checkpoint")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_path))

    return read_whole(ckpt_path, optimizer=False)[MODEL_KEY] if Path(ckpt_path).is_dir() else checkpoint[MODEL_KEY]


def recorded_tokenizer(checkpoint: dict[str, Any]) -> str | None:
    """The tokenizer the data module recorded in its state (``LMDataModule.state_dict``)."""
    return _data_state(checkpoint).get("tokenizer")


def prompt_ids(tokenizer: Any, prompt: str, checkpoint: dict[str, Any]) -> list[int]:
    """The prompt's ids, begun as the run's training examples began: with BOS for the formats whose
    examples start with it (an SFT model never saw ``12+07=`` without it, and answers it wrongly)."""
    from lit_ablate.data.formats import BOS_FIRST_FORMATS

    starts_with_bos = _data_state(checkpoint).get("format") in BOS_FIRST_FORMATS and tokenizer.bos_id is not None
    return ([tokenizer.bos_id] if starts_with_bos else []) + tokenizer.encode(prompt)


def _data_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What ``LMDataModule.state_dict`` saved (empty for a checkpoint of another data module)."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), str):
            return value
    return {}


def generate(
    ckpt_path: str,
    prompt: str,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    tokenizer: str | None = None,
    seed: int = 0,
) -> str:
    """The prompt's continuation. ``temperature`` 0 is greedy decoding; ``top_k`` limits sampling."""
    from lit_ablate.data import load_tokenizer
    from lit_ablate.modules import CausalLM

    check_sampling(prompt, max_new_tokens, temperature, top_k)
    checkpoint = load_checkpoint(ckpt_path)
    spec = tokenizer or recorded_tokenizer(checkpoint)
    if spec is None:
        raise ConfigError("--tokenizer", None, "the checkpoint records no tokenizer; pass --tokenizer byte or a path")
    tok = load_tokenizer(spec, "--tokenizer" if tokenizer else "data.init_args.tokenizer")
    if not tok.encode(prompt):
        raise ConfigError("--prompt", prompt, "it encodes to no tokens; give text to continue")
    module = CausalLM.from_hparams(checkpoint["hyper_parameters"], inference=True)
    module.configure_model()
    module.load_state_dict(model_weights(ckpt_path, checkpoint))
    lm = module.model.lm.eval()
    torch.manual_seed(seed)
    input_ids = torch.tensor([prompt_ids(tok, prompt, checkpoint)])
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": top_k} if temperature > 0 else {"do_sample": False}
    )
    with torch.no_grad():
        out = lm.generate(
            input_ids, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, **sampling
        )
    return tok.decode(out[0, input_ids.shape[1] :].tolist())


def check_sampling(prompt: str, max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Sampling settings that would crash or silently do nothing inside ``transformers.generate``."""
    if not prompt:
        raise ConfigError("--prompt", prompt, "give text to continue (generation needs at least one token)")
    if max_new_tokens < 1:
        raise ConfigError("--max_new_tokens", max_new_tokens, "generate at least 1 token")
    if temperature < 0:
        raise ConfigError("--temperature", temperature, "use 0 for greedy decoding or a positive value to sample")
    if top_k is not None and top_k < 1:
        raise ConfigError("--top_k", top_k, "use a positive k, or leave it unset to sample from every token")


def generate_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="lit-ablate generate", description=__doc__, exit_on_error=False, allow_abbrev=False)
    parser.add_function_arguments(generate)
    args = parser.parse_args(argv)
    print(args.prompt + generate(**vars(args)))
    return 0
