"""``lit-ablate export``: a training checkpoint -> one Hugging Face model folder (safetensors).

Reads either checkpoint layout Lightning writes: a sharded DCP folder (mesh strategies on any mesh,
pipelines included, FSDP1 ``sharded``; read whole here, in one process, without a process group:
``strategies.whole_checkpoint``) or a single ``.ckpt`` file (DDP, ZeRO-1, single device). The model
is rebuilt from the checkpoint's hyper-parameters (``CausalLM.from_hparams``), so nothing but the
checkpoint is needed, and saved with ``save_pretrained``: ``AutoModelForCausalLM.from_pretrained(output_dir)``
loads it offline.
The tokenizer the run trained with (recorded in the checkpoint by the data module) is saved beside
it, and its special ids go into the model's config and generation config, so
``AutoTokenizer.from_pretrained`` + ``generate`` work on the folder alone.
Only tensors are read back (``torch.load(weights_only=True)``). An adapter-only checkpoint
(``AdapterCheckpoint``) exports over its ``pretrained:`` base, checked against the base's fingerprint.

A run that trained adapters (``model.adapter``) is exported through peft's own ``PeftModel`` around
the same base: by default a peft adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained``; a base built from a
config, which no file holds, is written beside it in ``base_model/`` and named as the adapter's
base), or with ``--merge`` one plain Hugging Face model with the adapters merged into its weights
(``merge_and_unload``). A quantised (QLoRA, 4- or 8-bit) base exports as an adapter folder over its
``pretrained`` checkpoint, or with ``--merge`` (config-built bases too) as a plain full-precision
model: the quantised weights are dequantised (what every forward multiplied by), then the adapters
merged into them (peft's own merge into a quantised layer would requantise the sum). Every refusal comes
before the output folder is made, and each names an export that works. Expert adapters
(``experts_r``) are lit-ablate's own, which a peft adapter folder cannot hold: they export with
``--merge`` (added into the expert weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lit_ablate.callbacks.adapter_checkpoint import FINGERPRINT_KEY, check_same_base
from lit_ablate.cli import EXIT_USAGE
from lit_ablate.errors import ConfigError
from lit_ablate.models.adapters.expert_lora import merge_expert_adapters
from lit_ablate.models.adapters.lora import ADAPTER_NAME, apply_expert_adapters, has_adapters
from lit_ablate.models.adapters.quantization import dequantized_state_dict
from lit_ablate.path_checks import writable_dir

BASE_MODEL_DIR = "base_model"
"""Where an adapter export writes a base that was built from a config (no other file holds it)."""


def export_hf_checkpoint(
    ckpt_path: str | Path, output_dir: str | Path, tokenizer: str | None = None, merge: bool = False
) -> Path:
    """Write the checkpoint's model and tokenizer as a Hugging Face folder in ``output_dir``; returns it.

    ``tokenizer`` overrides the one the checkpoint recorded (``"byte"`` or an HF path). ``merge``:
    an adapter run as one model with merged weights instead of a peft adapter folder.
    """
    from lit_ablate.commands.generate import load_checkpoint, model_weights, recorded_tokenizer
    from lit_ablate.data import load_tokenizer
    from lit_ablate.modules import CausalLM

    ckpt_path, output_dir = Path(ckpt_path), Path(output_dir)
    checkpoint: dict[str, Any] = load_checkpoint(ckpt_path)
    writable_dir("--output_dir", output_dir)
    spec = tokenizer or recorded_tokenizer(checkpoint)
    if spec is None:
        raise ConfigError("--tokenizer", None, "the checkpoint records no tokenizer; pass --tokenizer byte or a path")
    tok = load_tokenizer(spec, "--tokenizer" if tokenizer else "data.init_args.tokenizer")
    module = CausalLM.from_hparams(checkpoint["hyper_parameters"], inference=True)
    _check_merge(module, merge)
    module.configure_model()
    state = model_weights(ckpt_path, checkpoint)  # a sharded folder whatever layout wrote it
    adapter_only = FINGERPRINT_KEY in checkpoint
    if adapter_only and not module.factory.pretrained:
        raise ConfigError(
            "--ckpt_path",
            str(ckpt_path),
            "an adapter-only checkpoint (AdapterCheckpoint) of a base built "
            "from a config: no file holds that base; export a full checkpoint (train without "
            "AdapterCheckpoint), or train over a pretrained base",
        )
    module.load_state_dict(state, strict=not adapter_only)  # adapter-only: the base is the pretrained folder's
    if adapter_only:
        check_same_base(checkpoint, module, ckpt_path, "the pretrained folder changed since training")
    lm = module.model.lm
    for config in (lm.config, lm.generation_config):
        config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_id, tok.eos_id, tok.pad_id
    output_dir.mkdir(parents=True, exist_ok=True)
    if has_adapters(lm):
        _save_adapters(module, output_dir, merge)
    else:
        lm.save_pretrained(output_dir)
    tok.save_pretrained(output_dir)
    _apply_umask(output_dir.glob("*.safetensors"))
    return output_dir


def _check_merge(module: Any, merge: bool) -> None:
    factory = module.factory
    if merge and factory.adapter is None:
        raise ConfigError("--merge", True, "the run trained no adapters: export it without --merge")
    if merge:
        return
    if factory.quantization is not None and not factory.pretrained:
        raise ConfigError(
            "model.init_args.model.quantization",
            asdict(factory.quantization),
            "a quantised base built from a config exists only quantised, which no Hugging Face folder "
            "holds; export with --merge (dequantised and merged), or train over a pretrained base",
        )
    if factory.adapter is not None and factory.adapter.experts_r is not None:
        raise ConfigError(
            "model.init_args.model.adapter.experts_r",
            factory.adapter.experts_r,
            "expert adapters are lit-ablate's own and a peft adapter folder cannot hold them; export with --merge",
        )


def _save_adapters(module: Any, output_dir: Path, merge: bool) -> None:
    """The trained model as peft's ``PeftModel`` (the factory's base, the trained state loaded into it),
    saved as an adapter folder (with ``base_model/`` when the base came from a config) or merged."""
    from peft import get_peft_model

    factory, trained = module.factory, module.model.lm
    state = trained.state_dict()
    if merge:  # a full-precision base (a QLoRA base dequantised), with the expert adapters to merge too
        base = dataclasses.replace(factory, quantization=None).build(with_adapters=False)
        if factory.adapter.experts_r is not None:
            apply_expert_adapters(base, factory.adapter)
        if factory.quantization is not None:
            state = dequantized_state_dict(trained)
    else:
        base = factory.build(with_adapters=False)
    base.config, base.generation_config = trained.config, trained.generation_config  # the tokenizer's special ids
    peft_model = get_peft_model(base, factory.adapter.lora_config(), adapter_name=ADAPTER_NAME)
    peft_model.base_model.model.load_state_dict(state, strict=True)
    if merge:
        merged = peft_model.merge_and_unload()
        merge_expert_adapters(merged)
        merged.save_pretrained(output_dir)
        _apply_umask(output_dir.glob("*.safetensors"))
        return
    if not factory.pretrained:
        peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = str((output_dir / BASE_MODEL_DIR).resolve())
    peft_model.save_pretrained(output_dir)
    _apply_umask(output_dir.glob("*.safetensors"))
    if not factory.pretrained:
        peft_model.unload().save_pretrained(output_dir / BASE_MODEL_DIR)
        _apply_umask((output_dir / BASE_MODEL_DIR).glob("*.safetensors"))


def _apply_umask(paths: Iterable[Path]) -> None:
    """safetensors writes through an owner-only temporary file (mode 0o600): give the weights the mode
    any file the user creates gets. (Python can only read the umask by setting it.)"""
    umask = os.umask(0)
    os.umask(umask)
    for path in paths:
        path.chmod(0o666 & ~umask)


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lit-ablate export",
        description="Export a training checkpoint as a Hugging Face model (safetensors).",
        allow_abbrev=False,
    )
    parser.add_argument("--ckpt_path", required=True, type=Path, help="a .ckpt file or a sharded checkpoint folder")
    parser.add_argument("--output_dir", required=True, type=Path, help="the Hugging Face model folder to write")
    parser.add_argument("--tokenizer", help="byte or an HF tokenizer path (default: the one the run recorded)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="an adapter run: one model with the adapters merged (default: a peft adapter folder)",
    )
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" for a folder of one or two files
    try:
        out = export_hf_checkpoint(args.ckpt_path, args.output_dir, args.tokenizer, args.merge)
    except ConfigError as err:
        print(f"lit-ablate export: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"exported {args.ckpt_path} -> {out} (AutoModelForCausalLM and AutoTokenizer.from_pretrained load it)")
    return 0
