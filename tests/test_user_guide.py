"""docs/user-guide.md works as written after the README's set-up: every ``bash`` block runs, in order, as a
user would paste it.

The blocks run with ``bash -e`` in a temporary folder holding a copy of ``configs/`` (the guide's
commands use paths relative to the repository root, and their outputs must not land in the
checkout), with this interpreter's ``bin/`` first on PATH (``lit-ablate``, ``python``). Besides each
block's exit code, the test checks what the guide promises: the run record's path, transformers'
text equal to ``lit-ablate generate``'s, a dry run that runs nothing, and a study summary whose
chunked row passes the loss check. Seen failing with the guide's transformers block printing only the
continuation (``out[0, prompt_length:]``: 'the the ...' against generate's 'The the the ...'), with
``--only`` split at every comma in ``StudySpec.shortened`` (the grid variant's name: the dry run exits 1),
and with the guide's fit writing where the README's set-up had trained (its run took ``version_1`` and the
blocks read the set-up's ``version_0``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_ablate.cli import main
from lit_ablate.record import read_record

REPOSITORY = Path(__file__).parents[1]
GUIDE = REPOSITORY / "docs" / "user-guide.md"
README = REPOSITORY / "README.md"


def bash_blocks(markdown: str) -> list[str]:
    """The guide's fenced ``bash`` blocks, in order (``text`` blocks show output and are not run)."""
    return re.findall(r"^```bash\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL)


def readme_set_up_fit() -> list[str]:
    """The arguments of the ``lit-ablate fit`` the README's set-up runs after installing."""
    block = re.search(r"^## Set up\n.*?^```bash\n(.*?)^```$", README.read_text(), re.MULTILINE | re.DOTALL).group(1)
    commands = [part.strip() for part in block.replace("\n", "&&").split("&&")]
    return shlex.split(next(c for c in commands if c.startswith("lit-ablate fit")))[1:]


def test_the_guide_has_its_commands():
    blocks = bash_blocks(GUIDE.read_text())
    commands = " ".join(blocks)
    for command in (
        "lit-ablate fit",
        "lit-ablate generate",
        "lit-ablate export",
        "from_pretrained",
        "lit-ablate ablate",
        "--dry-run",
        "lit-ablate report",
    ):
        assert command in commands, command


@pytest.mark.slow
def test_the_user_guide_runs_as_written(tmp_path, capsys, monkeypatch):
    shutil.copytree(REPOSITORY / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)  # the README's set-up first, where the guide runs (one step: what it leaves)
    main([*readme_set_up_fit(), "--trainer.max_steps", "1"])
    assert (tmp_path / "runs" / "quickstart" / "lightning_logs" / "version_0" / "run.json").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    before = {p.name for p in REPOSITORY.iterdir()}
    outputs = []
    for block in bash_blocks(GUIDE.read_text()):
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, f"{block}\nexit {done.returncode}\n{done.stderr[-3000:]}"
        outputs.append((block, done.stdout, done.stderr))

    def output_of(command: str) -> tuple[str, str]:
        return next((out, err) for block, out, err in outputs if command in block)

    assert "run record: runs/guide/lightning_logs/version_0/run.json" in output_of("lit-ablate fit")[1]
    assert output_of("json.load")[0].startswith("status: ok | final loss:")
    sampled = output_of("lit-ablate generate")[0].splitlines()[-1]
    assert sampled.startswith("The ") and len(sampled) > len("The ")
    assert output_of("from_pretrained")[0].splitlines()[-1] == sampled  # the exported model, same greedy text
    dry = output_of("--dry-run")[0]
    assert dry.splitlines()[-1] == "dry run, nothing ran: 2 would run"
    study = next(out for block, out, _ in outputs if block.startswith("lit-ablate ablate") and "--dry-run" not in block)
    chunked = next(line for line in study.splitlines() if line.startswith("loss=chunked,dtype=float32"))
    assert chunked.endswith("loss = baseline"), study
    assert study.splitlines()[-1] == f"report: {tmp_path / 'studies' / 'liger_vs_cce' / 'report.md'}"
    assert "| variant |" in output_of("sed -n")[0]
    the_guide_s_run_tests_and_resumes(tmp_path, capsys)
    assert {p.name for p in REPOSITORY.iterdir()} == before, "the guide wrote into the checkout"


def the_guide_s_run_tests_and_resumes(folder: Path, capsys: pytest.CaptureFixture) -> None:
    """What the CLI promises beyond the guide, on the guide's own run (one fit and one generate fewer than
    a quickstart run of its own): the record's steps, throughput, resolved config and environment;
    ``lit-ablate test`` on its last checkpoint; a fit resumed from it that records only the new steps and
    where it resumed from; Lightning's own loader. The guide's blocks ran the console script; these run
    its ``main`` in this process (~8 s of imports fewer each)."""
    run = folder / "runs" / "guide" / "lightning_logs" / "version_0"
    record = read_record(run / "run.json")
    assert [s["step"] for s in record["steps"]] == list(range(1, 21))
    assert (
        record["summary"]["tokens_per_sec"]["median"] > 0 and record["summary"]["useful_tokens_per_sec"]["median"] > 0
    )
    assert record["config"]["trainer"]["max_steps"] == 20  # the resolved config, the override applied
    assert record["environment"]["torch"] and record["summary"]["memory_method"] == "cpu_process_peak_rss"
    checkpoint = run / "checkpoints" / "last.ckpt"
    config = str(folder / "configs" / "quickstart.yaml")

    capsys.readouterr()
    main(
        [
            "test",
            "--config",
            config,
            "--ckpt_path",
            str(checkpoint),
            "--trainer.default_root_dir",
            str(folder / "runs" / "tested"),
        ]
    )
    assert "test/loss" in capsys.readouterr().out
    resumed_path = folder / "resumed.json"
    main(
        [
            "fit",
            "--config",
            config,
            "--trainer.max_steps",
            "22",
            "--ckpt_path",
            str(checkpoint),
            "--trainer.default_root_dir",
            str(folder / "runs" / "resumed"),
            "--recorder.path",
            str(resumed_path),
        ]
    )
    resumed = read_record(resumed_path)
    assert [s["step"] for s in resumed["steps"]] == [21, 22]  # resumed after step 20
    assert resumed["resumed_from"] == {"checkpoint": str(checkpoint), "step_offset": 20}
    from lit_ablate.modules import CausalLM

    loaded = CausalLM.load_from_checkpoint(checkpoint, weights_only=True)
    assert loaded.factory.preset == "tiny-llama" and loaded.hparams.loss == "torch"
