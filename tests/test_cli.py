"""The `lit-ablate` command: end to end in a subprocess, config round trip, one-line errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_ablate.cli import main
from lit_ablate.fit_cli import resolve_fit_config
from lit_ablate.record import RECORD_PATH_ENV, read_record

CONFIGS = Path(__file__).parents[1] / "configs"
QUICKSTART = str(CONFIGS / "quickstart.yaml")


def _run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_ablate.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_quickstart_fit_writes_a_record_and_generate_prints_text(tmp_path):
    record_path = tmp_path / "run.json"
    fit = _run("fit", "--config", QUICKSTART, "--trainer.max_steps", "5", "--trainer.default_root_dir", str(tmp_path),
               env={RECORD_PATH_ENV: str(record_path)})
    assert fit.returncode == 0, fit.stderr[-2000:]
    record = read_record(record_path)
    assert record["summary"]["status"] == "ok"
    assert [s["step"] for s in record["steps"]] == [1, 2, 3, 4, 5]
    assert record["summary"]["tokens_per_sec"]["median"] > 0
    assert record["summary"]["useful_tokens_per_sec"]["median"] > 0
    assert record["config"]["trainer"]["max_steps"] == 5  # the resolved config, overrides applied
    assert record["environment"]["torch"] and record["summary"]["memory_method"] == "cpu_process_peak_rss"

    checkpoint = next(tmp_path.rglob("last.ckpt"))
    test = _run("test", "--config", QUICKSTART, "--ckpt_path", str(checkpoint), "--trainer.default_root_dir", str(tmp_path))
    assert test.returncode == 0, test.stderr[-2000:]
    assert "test/loss" in test.stdout
    resumed_path = tmp_path / "resumed.json"
    resumed = _run("fit", "--config", QUICKSTART, "--trainer.max_steps", "7", "--ckpt_path", str(checkpoint),
                   "--trainer.default_root_dir", str(tmp_path), env={RECORD_PATH_ENV: str(resumed_path)})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    resumed_record = read_record(resumed_path)
    assert [s["step"] for s in resumed_record["steps"]] == [6, 7]  # resumed after step 5
    assert resumed_record["resumed_from"] == {"checkpoint": str(checkpoint), "step_offset": 5}
    from lit_ablate.modules import CausalLM

    loaded = CausalLM.load_from_checkpoint(checkpoint, weights_only=True)  # Lightning's own API works too
    assert loaded.factory.preset == "tiny-llama" and loaded.hparams.loss == "torch"
    gen = _run("generate", "--ckpt_path", str(checkpoint), "--prompt", "The ", "--max_new_tokens", "8")
    assert gen.returncode == 0, gen.stderr[-2000:]
    text = gen.stdout.strip().splitlines()[-1]
    assert text.startswith("The ") and len(text) > len("The ")


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


@pytest.mark.parametrize(("args", "expected"), [
    (["--model.init_args.model.preset", "tiny-gpt9"], "model.init_args.model.preset='tiny-gpt9': choose one of"),
    (["--data.init_args.seq_len", "0"], "data.init_args.seq_len=0: use a positive integer"),
    (["--model.init_args.loss", "fused9"], "model.init_args.loss='fused9': choose one of"),
    (["--trainer.callbacks+=lit_ablate.callbacks.NoSuchMonitor"], "trainer.callbacks: cannot import"),
])
def test_bad_input_is_one_line_naming_the_key(args, expected, capsys):
    assert expected in _error_of(args, capsys)


def test_unknown_model_type_names_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"class_path": "lit_ablate.modules.CausalLM", "init_args": {
        "model": {"preset": None, "config": {"model_type": "gpt9", "hidden_size": 64}}}}}))
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
    message = _error_of(["--config", str(CONFIGS / "sft_tiny.yaml"), "--data.init_args.seq_len", "4",
                         "--data.init_args.overlong", "reject"], capsys)
    assert "lit-ablate: error:" in message and "overlong" in message
