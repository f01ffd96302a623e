"""The `lit-ablate` command: config round trip, one-line errors. (The quickstart end to end in a subprocess,
with test, resume and generate, runs in ``tests/test_user_guide.py`` on the guide's own run.)"""

from pathlib import Path

import pytest
import yaml

from lit_ablate.cli import main
from lit_ablate.fit_cli import resolve_fit_config

CONFIGS = Path(__file__).parents[1] / "configs"
QUICKSTART = str(CONFIGS / "quickstart.yaml")


def test_print_config_round_trips(tmp_path):
    resolved = resolve_fit_config(["--config", QUICKSTART, "--trainer.max_steps", "7"])
    assert resolved["trainer"]["max_steps"] == 7
    assert resolved["model"]["init_args"]["model"]["preset"] == "tiny-llama"
    saved = tmp_path / "resolved.yaml"
    saved.write_text(yaml.safe_dump(resolved))
    assert resolve_fit_config(["--config", str(saved)]) == resolved


def _error_of(args: list[str], capsys) -> str:
    """The one stderr line of a refused ``fit`` (status 2: a config error)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, "--trainer.max_steps", "1", *args])
    message = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and message.startswith("lit-ablate: error: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.init_args.model.preset", "tiny-gpt9"], "model.init_args.model.preset='tiny-gpt9': choose one of"),
        (["--data.init_args.seq_len", "0"], "data.init_args.seq_len=0: use a positive integer"),
        (["--model.init_args.loss", "fused9"], "model.init_args.loss='fused9': choose one of"),
        (["--trainer.callbacks+=lit_ablate.callbacks.NoSuchMonitor"], "trainer.callbacks: cannot import"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(args, expected, capsys):
    assert expected in _error_of(args, capsys)


def test_unknown_model_type_names_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "class_path": "lit_ablate.modules.CausalLM",
                    "init_args": {"model": {"preset": None, "config": {"model_type": "gpt9", "hidden_size": 64}}},
                }
            }
        )
    )
    assert "model.init_args.model.config.model_type='gpt9'" in _error_of(["--config", str(bad)], capsys)


def test_missing_and_empty_data_files_name_the_key(tmp_path, capsys):
    local = ["--data.init_args.source", "lit_ablate.data.LocalFiles", "--data.init_args.source.path"]
    missing = _error_of([*local, str(tmp_path / "nope.jsonl")], capsys)
    assert "data.init_args.source.init_args.path" in missing and "nope.jsonl" in missing
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    message = _error_of([*local, str(empty)], capsys)
    assert "data.init_args.source" in message and "empty" in message


def test_sft_response_longer_than_seq_len_is_rejected_when_asked(tmp_path, capsys):
    """`overlong: reject` drops examples longer than seq_len; if that leaves nothing, the error
    names the setting instead of training on an empty dataset."""
    message = _error_of(
        [
            "--config",
            str(CONFIGS / "sft_tiny.yaml"),
            "--data.init_args.seq_len",
            "4",
            "--data.init_args.overlong",
            "reject",
        ],
        capsys,
    )
    assert "lit-ablate: error:" in message and "overlong" in message
