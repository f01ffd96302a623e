"""The commands a user tries first: help and version, refused abbreviations, file modes, the
estimate's exact numbers, an exported folder that Hugging Face tools load and round-trip, and a
quiet console."""

import importlib.metadata
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_ablate import __version__
from lit_ablate.cli import main
from lit_ablate.command_table import COMMANDS, SUMMARIES
from lit_ablate.commands.estimate import MEMORY_KINDS, estimate_main
from lit_ablate.commands.export import export_main
from lit_ablate.commands.generate import generate
from lit_ablate.data.tokenizers import ByteTokenizer
from lit_ablate.estimate.from_config import estimate_for_config
from lit_ablate.estimate.shapes import GIB
from lit_ablate.fit_cli import LitAblateCLI, resolve_fit_config
from lit_ablate.models.factory import ModelFactory
from lit_ablate.record import write_record

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
FSDP2_TINY = str(Path(__file__).parents[1] / "configs" / "fsdp2_tiny.yaml")
TEXTS = ["12+7=", "héllo wörld ✓ 🤖", " two  spaces\n\ttab", "<eos> is text here", ""]

UMASK = 0o007  # differs from the usual 0o022, and from mkstemp's owner-only 0o600


@pytest.fixture
def umask():
    previous = os.umask(UMASK)
    yield 0o666 & ~UMASK
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_run_record_is_written_with_the_users_umask(tmp_path, umask):
    """Catches a record created through mkstemp (0o600: other users of a shared study cannot read it)."""
    path = write_record(tmp_path / "run.json", {"schema_version": 1})
    assert _mode(path) == umask == 0o660
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left behind


def _exit_code(argv: list[str]) -> int | str | None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


def test_help_lists_every_command_on_one_line_and_version_prints_the_package_version(capsys):
    """Catches a help that lists LightningCLI's subcommands only, a command missing from it, a
    ``predict`` that is offered but crashes, and a version that drifts from the installed package."""
    assert _exit_code(["--help"]) == 0
    help_text = capsys.readouterr().out
    commands = {*COMMANDS, *LitAblateCLI.subcommands()}
    assert (
        commands
        == set(SUMMARIES)
        >= {"fit", "validate", "test", "generate", "ablate", "report", "estimate", "export", "peak"}
    )
    for command, summary in SUMMARIES.items():
        assert re.search(rf"^ +{command} +{re.escape(summary)}$", help_text, re.MULTILINE), command
    assert "predict" not in help_text and "predict" not in LitAblateCLI.subcommands()
    assert _exit_code(["--version"]) == 0
    assert (
        capsys.readouterr().out.strip()
        == f"lit-ablate {__version__}"
        == f"lit-ablate {importlib.metadata.version('lit-ablate')}"
    )
    assert _exit_code([]) == 2 and "export" in capsys.readouterr().err  # no command: the help, as an error


ABBREVIATED = [  # each command with an unambiguous prefix of one of its options (``--hel`` of --help)
    ["fit", "--config", QUICKSTART, "--hel"],
    ["validate", "--config", QUICKSTART, "--hel"],
    ["test", "--config", QUICKSTART, "--hel"],
    ["generate", "--ckpt_path", "x.ckpt", "--prompt", "1+1=", "--hel"],
    ["ablate", "--config", "study.yaml", "--hel"],
    ["report", "study_dir", "--hel"],
    ["estimate", "--config", QUICKSTART, "--hel"],
    ["export", "--ckpt_path", "x.ckpt", "--output_dir", "out", "--hel"],
    ["peak", "--hel"],
]


@pytest.mark.parametrize("argv", ABBREVIATED, ids=[a[0] for a in ABBREVIATED])
def test_every_command_refuses_an_abbreviated_option(argv, capsys):
    """Catches a parser built without allow_abbrev=False: it would print the help and exit 0."""
    try:
        code: int | str | None = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    except Exception as err:  # a traceback also refuses; its one-line form is test_bad_inputs's job
        code = str(err)
    said = f"{code} {capsys.readouterr()}"
    assert code not in (0, None) and re.search(r"\bhel\b", said), said[-400:]


def test_trainer_max_step_is_not_taken_for_max_steps(capsys):
    """The issue's example: ``--trainer.max_step 20`` silently became ``max_steps``."""
    code = _exit_code(["fit", "--config", QUICKSTART, "--trainer.max_step", "20", "--print_config"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"trainer\.max_step(?!s)", err), err


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory) -> tuple[Path, str]:
    """A 3-step quickstart fit as a user runs it (a subprocess): (its root dir, what it printed)."""
    root = tmp_path_factory.mktemp("fit")
    fit = subprocess.run(
        [
            sys.executable,
            "-m",
            "lit_ablate.cli",
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.max_steps",
            "3",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.default_root_dir",
            str(root),
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=600,
    )
    assert fit.returncode == 0, fit.stderr[-2000:]
    return root, fit.stdout + fit.stderr


@pytest.fixture(scope="module")
def exported(fit_run, tmp_path_factory) -> tuple[Path, Path]:
    """(the fit's last.ckpt, the folder ``lit-ablate export`` wrote from it under UMASK)."""
    checkpoint = next(fit_run[0].rglob("last.ckpt"))
    out = tmp_path_factory.mktemp("export") / "hf"
    previous = os.umask(UMASK)
    try:
        assert export_main(["--ckpt_path", str(checkpoint), "--output_dir", str(out)]) == 0
    finally:
        os.umask(previous)
    return checkpoint, out


def test_export_shows_no_progress_bar(exported):
    """``lit-ablate export`` printed transformers' "Writing model shards" bar for a one-file folder (issue 31:
    a quiet terminal). Seen failing without disabling it."""
    from transformers.utils import logging as hf_logging

    assert not hf_logging.is_progress_bar_enabled()


def test_exported_tokenizer_round_trips_lit_ablate_ids(exported):
    """Catches the empty tokenizer export wrote before (every text encoded to []) and ids that differ
    from the byte tokenizer the model was trained with."""
    from transformers import AutoTokenizer

    tok, hf = ByteTokenizer(), AutoTokenizer.from_pretrained(exported[1])
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ids == tok.encode(text), text
        assert hf.decode(ids) == tok.decode(ids) == text
        assert hf(text, split_special_tokens=True).input_ids == [tok.bos_id, *ids]  # as the documents/SFT formats
    # As in any HF tokenizer, text spelling a special token is that token unless split_special_tokens:
    assert hf.encode("<eos>!", add_special_tokens=False) == [tok.eos_id, *tok.encode("!")]
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (
        tok.pad_id,
        tok.bos_id,
        tok.eos_id,
        tok.vocab_size,
    )
    assert hf.decode([tok.bos_id, *tok.encode("ok"), tok.eos_id, tok.pad_id], skip_special_tokens=True) == "ok"
    conversation = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2="},
    ]
    assert hf.apply_chat_template(conversation, tokenize=True)["input_ids"] == tok.chat(conversation)[0]


def test_exported_folder_generates_offline_like_lit_ablate(exported):
    """Catches config/generation_config without the tokenizer's special ids (export wrote Llama's
    defaults bos=1, eos=2, pad=null: byte ids) and weights or decoding that differ from ``generate``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, folder = exported
    tok, hf = ByteTokenizer(), AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    for config in (model.config, model.generation_config):
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    prompt = hf("The ", add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    text = hf.decode(out[0, prompt.input_ids.shape[1] :], skip_special_tokens=True)
    assert text == generate(str(checkpoint), "The ", max_new_tokens=12)


def test_exported_weights_get_the_users_umask(exported):
    """Catches safetensors' owner-only (0o600) weight files."""
    files = list(exported[1].iterdir())
    assert {f.name for f in files} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert {f.name: _mode(f) for f in files} == {f.name: 0o660 for f in files}


def test_estimate_prints_the_exact_parameter_count_and_the_same_numbers_as_json(capsys):
    """Catches a count only given rounded ("869.5k") and a --json that disagrees with the table."""
    exact = sum(p.numel() for p in ModelFactory(preset="tiny-llama").build().parameters())
    args = ["--config", QUICKSTART, "--gpu_memory_gib", "0.05", "--max_gpus", "8"]
    assert estimate_main(args) == 0
    table = capsys.readouterr().out
    assert f"parameters ({exact:,})" in table
    assert estimate_main([*args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"]["parameters"] == exact and summary["world_size"] == 1
    reference = estimate_for_config(resolve_fit_config(["--config", QUICKSTART]))  # the report's own estimate
    assert summary["shardings"][0]["bytes_per_rank"] == {k: getattr(reference, k) for k in MEMORY_KINDS}
    unit = 2**20  # the table is in MiB for a tiny model
    assert "MiB" in table and summary["shardings"][0]["bytes_per_rank"]["total"] < GIB
    for row in summary["shardings"]:
        name = "configured (auto)" if row["sharding"] == "configured" else row["sharding"]
        line = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in line.strip("|").split("|")][1:]
        table_mib = [
            float(c) for c in cells[: len(MEMORY_KINDS)]
        ]  # cells are rounded to 0.1 MiB or 2 significant digits
        assert table_mib == pytest.approx([row["bytes_per_rank"][k] / unit for k in MEMORY_KINDS], rel=0.05, abs=0.05)
        need, there = row["gpus_needed"], row["total_bytes_per_rank_at_gpus_needed"]
        if need is None:
            assert cells[-1] == "none up to 8"
        else:  # the count, and each rank's total at that count, which fits the budget
            count, total = re.fullmatch(r"(\d+) \(([0-9.e-]+)\)", cells[-1]).groups()
            assert int(count) == need and float(total) == pytest.approx(there / unit, rel=0.05, abs=0.05)
            assert there <= 0.05 * 0.9 * GIB


def test_the_configured_strategy_and_its_row_agree_on_the_gpus_it_needs(capsys):
    """``estimate`` of ``fsdp2_tiny.yaml`` (FSDP2Strategy): the configured row and the ``fsdp2`` row are one
    layout, so at every count they hold the same bytes and need the same GPUs. Seen failing with the
    ``fsdp2`` row counting no FSDP gathers on one rank (a Qwen3-8B shape: the configured FSDP2 needed 2 GPUs,
    the fsdp2 row 1; here the fsdp2 row's total on its one GPU 36.9 MiB against the configured 40.4)."""
    assert estimate_main(["--config", FSDP2_TINY, "--json"]) == 0
    rows = {row["sharding"]: row for row in json.loads(capsys.readouterr().out)["shardings"]}
    assert rows["configured"] == {**rows["fsdp2"], "sharding": "configured"}
    assert rows["fsdp2"]["gpus_needed"] == 1


def test_fit_prints_no_noise_and_keeps_what_informs(fit_run):
    """Catches each line a user learned to ignore: Lightning's litlogger tip, the tensorboardX notice,
    ``Epoch 0/-2`` (max_epochs -1 under max_steps), ``v_num: 0.000`` and ``Total FLOPs: 0``."""
    root, printed = fit_run
    for noise in ("Tip:", "litlogger", "tensorboardX", "v_num", "FLOPs", "Trainer already configured"):
        assert noise not in printed, noise
    assert not re.search(r"Epoch \d+/-\d", printed)
    informs = [
        "Parameters: 869 K (869 K trainable)",
        "Epoch 0",
        "train/loss",
        "`Trainer.fit` stopped: `max_steps=3`",
        f"run record: {root}/lightning_logs/version_0/run.json",
    ]
    assert [line for line in informs if line not in printed] == []
    assert (root / "lightning_logs" / "version_0" / "metrics.csv").is_file()  # fit still logs CSV


@pytest.mark.parametrize("command", ["validate", "test"])
def test_validate_and_test_add_no_version_folder(fit_run, command, capsys):
    """Catches an evaluation that makes lightning_logs/version_1 (holding a config.yaml and one metric),
    which sends the user's next fit to version_2."""
    root = fit_run[0]
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    main(
        [
            command,
            "--config",
            QUICKSTART,
            "--ckpt_path",
            str(next(root.rglob("last.ckpt"))),
            "--trainer.default_root_dir",
            str(root),
            "--trainer.limit_val_batches",
            "2",
            "--trainer.limit_test_batches",
            "2",
        ]
    )
    assert f"{command.replace('validate', 'val')}/loss" in capsys.readouterr().out  # the metrics are printed
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


@pytest.mark.parametrize(
    ("data_format", "with_bos"),
    [("sft", True), ("documents", True), ("preference", True), ("pretrain", False), (None, False)],
)
def test_generate_starts_the_prompt_as_the_run_started_its_examples(data_format, with_bos):
    """An SFT model trained on ``bos + 38+45=`` answers a bare ``38+45=`` wrongly (the 95% SFT
    example gave ``11111`` for ``99+99=``): generate begins the prompt as the run's format did."""
    from lit_ablate.commands.generate import prompt_ids
    from lit_ablate.data import load_tokenizer

    tok = load_tokenizer("byte")
    state = {"tokenizer": "byte", **({"format": data_format} if data_format else {})}
    ids = prompt_ids(tok, "38+45=", {"LMDataModule": state, "state_dict": {}})
    assert ids == ([tok.bos_id] if with_bos else []) + tok.encode("38+45=")
