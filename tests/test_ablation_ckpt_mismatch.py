"""``--ckpt_path`` with a config whose model differs from the checkpoint's is refused, naming the keys.

The bug this catches (seen with ``LitAblateCLI._parse_ckpt_path`` removed): LightningCLI replaced
the config's model section with the checkpoint's hyper-parameters without a word, so a tiny-llama
config resumed a tiny-qwen3 checkpoint and trained tiny-qwen3, and ``--model.init_args.loss
chunked`` was ignored. Checkpoints here hold only the hyper-parameters ``CausalLM`` saves: the check
runs before anything reads weights, and every test stops the CLI before any class is built.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_ablate.checkpoint_model import model_differences
from lit_ablate.cli import main
from lit_ablate.errors import ConfigError
from lit_ablate.fit_cli import LitAblateCLI
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")


class ParsedOnly(Exception):
    """Raised where classes would be instantiated: the config got through the checkpoint check."""


def stop_before_instantiating(cli: LitAblateCLI) -> None:
    raise ParsedOnly(cli.config[cli.subcommand].model)


def checkpoint(tmp_path: Path, preset: str, sharded: bool = False, **init_args) -> Path:
    """A checkpoint holding the hyper-parameters ``CausalLM(preset, **init_args)`` saves (no weights)."""
    hparams = dict(CausalLM(model=ModelFactory(preset=preset), **init_args).hparams)
    if sharded:  # Lightning's sharded layout: a folder whose meta.pt holds the non-tensor state
        (tmp_path / "sharded.ckpt").mkdir()
        path = tmp_path / "sharded.ckpt" / "meta.pt"
    else:
        path = tmp_path / "last.ckpt"
    torch.save({"hyper_parameters": hparams, "state_dict": {}}, path)
    return path.parent if sharded else path


@pytest.fixture(autouse=True)
def _stop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LitAblateCLI, "before_instantiate_classes", stop_before_instantiating)


def test_a_checkpoint_of_another_model_is_refused_in_one_line_naming_the_key(tmp_path: Path, capsys):
    ckpt = checkpoint(tmp_path, "tiny-qwen3")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", QUICKSTART, "--ckpt_path", str(ckpt)])
    message = capsys.readouterr().err.strip()
    assert info.value.code == 2  # a config error
    assert message.startswith(f"lit-ablate: error: --ckpt_path='{ckpt}': the checkpoint's model differs")
    assert "model.init_args.model.preset (config 'tiny-llama', checkpoint 'tiny-qwen3')" in message
    assert "\n" not in message


@pytest.mark.parametrize("sharded", [False, True])
def test_a_changed_loss_is_refused_for_files_and_sharded_folders(tmp_path: Path, sharded: bool):
    ckpt = checkpoint(tmp_path, "tiny-llama", sharded=sharded)
    with pytest.raises(ConfigError) as info:
        LitAblateCLI(
            args=["test", "--config", QUICKSTART, "--ckpt_path", str(ckpt), "--model.init_args.loss", "chunked"]
        )
    assert "model.init_args.loss (config 'chunked', checkpoint 'torch')" in str(info.value)
    assert "preset" not in str(info.value), "only the differing keys are named"


def test_the_checkpoints_own_model_passes_and_the_config_stays_as_given(tmp_path: Path):
    ckpt = checkpoint(tmp_path, "tiny-llama")
    with pytest.raises(ParsedOnly) as info:
        LitAblateCLI(args=["fit", "--config", QUICKSTART, "--ckpt_path", str(ckpt)])
    model = info.value.args[0]
    # ``null`` loss_options and the short class_path are the config's: equal to the checkpoint's {} and long path
    assert model.class_path == "lit_ablate.modules.CausalLM" and model.init_args.loss_options is None


def test_differences_ignore_spelling_but_not_values():
    config = {"class_path": "lit_ablate.modules.CausalLM", "init_args": {"loss_options": None, "betas": (0.9, 0.95)}}
    same = {
        "class_path": "lit_ablate.modules.causal_lm.CausalLM",
        "init_args": {"loss_options": {}, "betas": (0.9, 0.95)},
    }
    assert model_differences(config, same) == {}
    other = {**same, "init_args": {"loss_options": {"chunk_tokens": 8}, "betas": (0.9, 0.99)}}
    assert model_differences(config, other) == {
        "init_args.betas": ((0.9, 0.95), (0.9, 0.99)),
        "init_args.loss_options.chunk_tokens": (None, 8),
    }
