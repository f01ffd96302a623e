"""A study a user can shorten, preview and watch: ``--steps/--seeds/--only``, ``--dry-run``, the live
progress of the run in flight, the end-of-study summary, and report cells and plots that read right.

Mutations each test was seen failing on are in its docstring.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import yaml
from rich.console import Console
from rich.progress import Progress
from test_ablation_report import make_record, make_study

from lit_ablate import extras
from lit_ablate.ablation import plots
from lit_ablate.ablation.plan import config_text, plan_study
from lit_ablate.ablation.report import render_markdown
from lit_ablate.ablation.runner import LiveLines, _wait, duration, run_line
from lit_ablate.ablation.spec import parse_study
from lit_ablate.ablation.summary import study_summary
from lit_ablate.ablation.terminal_summary import verdict
from lit_ablate.callbacks.progress_file import PROGRESS_PATH_ENV, read_progress
from lit_ablate.cli import main
from lit_ablate.commands.ablate import ablate_main
from lit_ablate.commands.report import report_main
from lit_ablate.errors import ConfigError
from lit_ablate.record import summarize_steps, write_record

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
LOSS, DTYPE, LR = "model.init_args.loss", "model.init_args.model.dtype", "model.init_args.learning_rate"


def grid_study(**extra) -> dict:
    return {
        "name": "grid",
        "base": str(QUICKSTART),
        "axes": {LOSS: ["torch", "chunked"], DTYPE: ["float32", "bfloat16"]},
        "baseline": "loss=torch,dtype=float32",
        "seeds": [3, 7],
        "steps": 20,
        "warmup_steps": 3,
        "expect_equal_loss": {"rtol": 1e-4, "atol": 1e-6, "across": LOSS},
        **extra,
    }


# --- --steps / --seeds / --only ---------------------------------------------------------------------


def test_shortened_study_keeps_the_baseline_and_the_loss_references():
    """``--only`` a grid variant (its name holds a comma) keeps it, the baseline and its loss reference
    (torch at its own dtype). Seen failing with ``--only`` split at every comma (a grid name is refused),
    and without the reference (the report's loss check would be incomplete: exit 1)."""
    spec = parse_study(grid_study())
    short = spec.shortened(steps=5, seeds=3, only="loss=chunked,dtype=bfloat16")
    assert [v.name for v in short.variants] == [
        "loss=torch,dtype=float32",
        "loss=torch,dtype=bfloat16",
        "loss=chunked,dtype=bfloat16",
    ]
    assert short.steps == 5 and short.seeds == (3, 7, 8)  # the study's seeds, then the integers after its last
    assert parse_study(grid_study(expect_equal_loss={"steps": 10})).shortened(steps=5).expect_equal_loss.steps == 5
    assert spec.shortened(seeds=1).seeds == (3,)
    two = spec.shortened(only="loss=chunked,dtype=float32,loss=chunked,dtype=bfloat16")
    assert {v.name for v in two.variants} >= {"loss=chunked,dtype=float32", "loss=chunked,dtype=bfloat16"}
    assert spec.shortened() == spec


def test_shortened_steps_replace_a_study_max_steps_override():
    raw = {k: v for k, v in grid_study().items() if k != "steps"} | {"overrides": {"trainer.max_steps": 50}}
    spec = parse_study(raw)
    short = spec.shortened(steps=6)
    assert short.fit_config(short.variants[0], 0, "/x")["trainer"]["max_steps"] == 6


@pytest.mark.parametrize(
    ("kwargs", "flag", "words"),
    [
        ({"steps": 0}, "--steps", "positive integer"),
        ({"steps": 3}, "--steps", "more than 3"),  # the study leaves 3 warm-up steps out of its numbers
        ({"seeds": 0}, "--seeds", "positive integer"),
        ({"only": "loss=liger"}, "--only", "starts no variant's name"),
        ({"only": ","}, "--only", "starts no variant"),
    ],
)
def test_bad_shortening_is_one_line_naming_the_flag(kwargs, flag, words):
    with pytest.raises(ConfigError) as err:
        parse_study(grid_study()).shortened(**kwargs)
    assert str(err.value).startswith(flag) and words in str(err.value) and "\n" not in str(err.value)


# --- --dry-run ------------------------------------------------------------------------------------


def test_dry_run_shows_runs_ranks_skips_and_fails_and_runs_nothing(tmp_path, capsys):
    """Seen failing with the counts line counting skipped runs as runs, and (done row) with the
    resume check left out of the dry run."""
    study = {
        "name": "dry",
        "base": str(QUICKSTART),
        "vary": [LOSS, "trainer.devices", LR],
        "steps": 20,
        "seeds": [0, 1],
        "warmup_steps": 2,
        "launch": {"devices": 1, "accelerator": "cpu"},
        "variants": [
            {"name": "torch"},
            {"name": "chunked", "overrides": {LOSS: "chunked"}, "launch": {"devices": 2}},
            {"name": "liger", "overrides": {LOSS: "liger"}},
            {"name": "typo", "overrides": {LR: "fast"}},
        ],
    }
    path = tmp_path / "dry.yaml"
    path.write_text(yaml.safe_dump(study))
    out = tmp_path / "out"
    args = ["--config", str(path), "--output_dir", str(out), "--steps", "4", "--seeds", "1", "--dry-run"]
    assert ablate_main(args) == 2, "a variant that would fail refuses the study, after its plan is printed"
    printed = capsys.readouterr().out.splitlines()
    assert not out.exists(), "a dry run writes nothing"
    assert printed[0].startswith("study dry: 4 variants × 1 seeds (seeds 0) = 4 runs, 4 steps, baseline torch")
    assert printed[1] == "shortened: steps 4 (study: 20), seeds 1 (study: 2)"
    rows = {line.split()[0]: line for line in printed[3:7]}
    assert rows["torch"].split()[2:4] == ["1", "cpu"] and rows["torch"].endswith("  run")
    assert rows["chunked"].split()[2] == "2" and "model.init_args.loss='chunked'" in rows["chunked"]
    # Without liger-kernel (the README's install has no kernels-cpu extra) the package is what is missing.
    why = "liger needs CUDA" if extras.installed("liger_kernel") else "the liger loss needs liger-kernel"
    assert f"skip: model.init_args.loss='liger': {why}" in rows["liger"]
    assert "fails: config does not resolve" in rows["typo"] and "learning_rate" in rows["typo"]
    assert printed[-1] == "dry run, nothing ran: 2 would run, 1 skipped, 1 would fail (bad config)"

    # a run an earlier invocation finished (same config) is shown as kept
    from lit_ablate.ablation.spec import load_study

    spec = load_study(path).shortened(steps=4, seeds=1)
    torch_run = next(r for r in plan_study(spec, out) if r.variant.name == "torch")
    torch_run.run_dir.mkdir(parents=True)
    (torch_run.run_dir / "config.yaml").write_text(config_text(torch_run.config))
    write_record(torch_run.run_dir / "run.json", make_record("torch", 0, speed=1, peak_mib=1, losses=[3, 2, 1, 0.5]))
    assert ablate_main(args) == 2
    printed = capsys.readouterr().out.splitlines()
    assert next(line for line in printed if line.startswith("torch ")).endswith("done (ok, kept)")
    assert printed[-1].startswith("dry run, nothing ran: 1 would run, 1 skipped, 1 would fail") and printed[
        -1
    ].endswith("1 already done (kept)")


# --- live progress --------------------------------------------------------------------------------


def test_a_fit_in_a_study_writes_its_progress_file(tmp_path, monkeypatch):
    """The file the runner watches: the last step, its loss and tokens/s. Seen failing with the
    ``ProgressFile`` left out of ``LitAblateCLI.instantiate_trainer`` (no file)."""
    progress = tmp_path / "progress.json"
    monkeypatch.setenv(PROGRESS_PATH_ENV, str(progress))
    main(
        [
            "fit",
            "--config",
            str(QUICKSTART),
            "--trainer.max_steps",
            "4",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.val_check_interval",
            "100",
        ]
    )
    written = read_progress(progress)
    assert written["step"] == written["max_steps"] == 4 and written["eta_s"] == 0
    assert math.isfinite(written["loss"]) and 3 < written["loss"] < 7  # byte-level vocabulary: ln(256) = 5.5
    assert written["tokens_per_sec"] > 0 and written["elapsed_s"] > 0


PRETEND_RUN = """
import json, os, sys, time
path = sys.argv[1]
for step in (1, 2, 3):
    with open(path + ".partial", "w") as f:
        json.dump({"step": step, "max_steps": 3, "loss": 5.0 - step, "tokens_per_sec": 2500.0,
                   "elapsed_s": step * 0.6, "eta_s": (3 - step) * 0.6}, f)
    os.replace(path + ".partial", path)
    time.sleep(0.6)
"""


def test_the_runner_shows_the_run_in_flight_and_the_study(tmp_path):
    """While a run's process lives, the runner reads its progress file every ``POLL_S`` and its two
    live lines show it. Seen failing with ``_wait`` not calling its tick (one blocking wait: no line)."""
    path = tmp_path / "progress.json"
    process = subprocess.Popen([sys.executable, "-c", PRETEND_RUN, str(path)])
    progress = Progress(console=Console(file=io.StringIO(), width=200))
    lines = LiveLines(progress, total=3)
    run = type("Run", (), {"label": "chunked seed0"})()
    lines.start(run, index=1)
    seen: list[str] = []

    def tick() -> None:
        lines.watch(read_progress(path))
        seen.append(progress.tasks[1].description)

    assert _wait(process, 30, tick) == 0
    assert any(line.startswith("  chunked seed0: step 2/3, loss 3, 2.5k tokens/s, ETA") for line in seen), seen
    assert progress.tasks[0].description.startswith("study: run 2 of 3, ETA")
    assert progress.tasks[1].completed in (2, 3) and progress.tasks[1].total == 3


def test_progress_line_words():
    assert (
        run_line({"step": 12, "max_steps": 60, "loss": 4.21349, "tokens_per_sec": 5123.0, "eta_s": 25.2})
        == "step 12/60, loss 4.213, 5.12k tokens/s, ETA 25s"
    )
    assert run_line({"step": 3, "max_steps": None, "loss": None, "tokens_per_sec": None, "eta_s": None}) == "step 3"
    assert [duration(s) for s in (0.4, 59, 185, 7620)] == ["0s", "59s", "3m05s", "2h07m"]


# --- the end-of-study summary ---------------------------------------------------------------------


def summary_of(records: list[dict], plan: dict) -> dict:
    return study_summary(plan, [(f"runs/{r['variant']}/seed{r['seed']}/run.json", r) for r in records])


EQUAL = {"rtol": 1e-4, "atol": 1e-6, "steps": None}


def flat_record(
    variant: str, seed: int, *, speed: float, peak_mib: float, losses: list[float], status: str = "ok"
) -> dict:
    """``make_record`` with the same tokens/s at every step."""
    record = make_record(variant, seed, speed=speed, peak_mib=peak_mib, losses=losses, status=status)
    for step in record["steps"]:
        step["tokens_per_sec"], step["useful_tokens_per_sec"] = speed, speed / 2
    kept = {k: record["summary"][k] for k in ("status", "message", "memory_method")}
    record["summary"] = {**summarize_steps(record["steps"], 1), **kept}
    record["summary"]["peak_tensor_bytes"] = int(peak_mib * 2**20)  # what memory × compares (a CPU run tracks tensors)
    return record


def five_variants() -> tuple[list[dict], dict]:
    """base; fast (2x, same loss); slow_fat (half speed, double memory, loss differs); oom; within noise.
    Eight seeds, one block each (records without blocks pair by seed): enough pairs for a verdict."""
    losses = [4.0, 3.0, 2.0, 1.0]
    records = []
    for seed in range(8):
        records += [
            flat_record("base", seed, speed=100 + seed, peak_mib=10, losses=losses),
            flat_record("fast", seed, speed=200 + seed, peak_mib=10.1, losses=losses),
            flat_record("slow_fat", seed, speed=50 + seed, peak_mib=20, losses=[4.0, 3.0, 2.5, 1.5]),
            flat_record("same", seed, speed=100.5 + seed, peak_mib=5, losses=losses),
        ]
    records.append(flat_record("oom", 0, speed=1, peak_mib=1, losses=[4.0], status="oom"))
    plan = {
        "name": "five",
        "baseline": "base",
        "expect_equal_loss": EQUAL,
        "seeds": list(range(8)),
        "warmup_steps": 1,
        "variants": [{"name": n} for n in ("base", "fast", "slow_fat", "same", "oom")],
    }
    return records, plan


def test_verdicts_say_speed_memory_and_loss_in_words():
    """Seen failing with the threshold ignored ('same', 0.5% faster, read as faster) and with a failed
    loss check left out of the verdict."""
    records, plan = five_variants()
    by_name = {v["name"]: v for v in summary_of(records, plan)["variants"]}
    assert verdict(by_name["base"], "base") == "baseline"
    assert verdict(by_name["fast"], "base") == "faster 1.97× [1.93–2.00], same memory, loss = baseline"
    assert verdict(by_name["slow_fat"], "base", with_figures=False) == "slower, more memory, LOSS DIFFERS"
    assert verdict(by_name["same"], "base", with_figures=False) == "same speed, less memory, loss = baseline"
    assert verdict(by_name["oom"], "base") == "oom: boom"


def test_a_study_ends_with_a_short_summary_and_the_reports_path(tmp_path, capsys):
    """``report`` (like the end of ``ablate``) prints one row per variant, not the report's Markdown
    table. Seen failing with ``print(report.read_text())`` back (18-column table rows on stdout)."""
    records, plan = five_variants()
    directory = make_study(tmp_path, records, plan)
    assert report_main([str(directory)]) == 1  # slow_fat's loss check failed: a study problem
    printed = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("|") for line in printed)
    assert printed[1].split() == ["variant", "speed", "×", "[interval]", "memory", "×", "Δ", "loss", "verdict"]
    rows = {line.split()[0]: line.split() for line in printed[2:7]}
    assert rows["fast"][1:5] == ["1.97×", "[1.93–2.00]", "1.01", "+0.0000"]  # (200 + s) / (100 + s), 10.1 / 10 MiB
    assert rows["fast"][5:] == ["faster,", "same", "memory,", "loss", "=", "baseline"]
    assert rows["slow_fat"][4] == "+0.5000"
    assert rows["oom"][1:4] == ["—", "—", "—"]
    assert any(line.startswith("problem: loss check failed: slow_fat") for line in printed)
    assert printed[-1] == f"report: {directory / 'report.md'}"
    assert (directory / "report.md").read_text().count("\n| ") >= 5  # the full table is in the file


# --- report cells and plots -----------------------------------------------------------------------


def test_estimate_cell_gives_sizes_where_a_ratio_says_nothing():
    """A one-rank run's transient category estimated at 0 read ``transient ×0.00``; seen failing
    with ``_ratio`` printing the ratio whatever the estimate."""
    records, plan = five_variants()
    summary = summary_of(records[:4], {**plan, "variants": plan["variants"][:4]})
    summary["variants"][0]["estimate_vs_measured"] = {
        "params": {"estimated": 3479040, "measured": 3479168, "ratio": 0.99996, "agrees": True},
        "activations": {"estimated": 13959168, "measured": 5014264, "ratio": 2.78, "agrees": False},
        "transient": {"estimated": 0, "measured": 3481160, "ratio": 0.0, "agrees": False},
    }
    row = next(line for line in render_markdown(summary).splitlines() if line.startswith("| **base**"))
    assert "activations ×2.78; transient est. 0 B vs 3.32 MiB measured" in row and "×0.00" not in row


def _drawn_texts(fig: plt.Figure) -> list[plt.Text]:
    """Titles, axis labels, legend entries and the tick labels inside each axis's view (matplotlib
    keeps unused tick labels outside it, undrawn)."""
    texts = []
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
        texts += ax.get_legend().get_texts() if ax.get_legend() else []
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            texts += [
                t.label1
                for t in axis.get_major_ticks() + axis.get_minor_ticks()
                if low - 1e-9 * abs(high) <= t.get_loc() <= high * (1 + 1e-9) and t.label1.get_visible()
            ]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def _text_outside(fig: plt.Figure) -> list[str]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    outside = []
    for text in _drawn_texts(fig):
        box = text.get_window_extent(renderer)
        if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5:
            outside.append(text.get_text())
    return outside


@pytest.mark.parametrize("count", [1, 2, 6])
def test_every_plot_keeps_its_text_inside_the_figure(count, tmp_path, monkeypatch):
    """Titles, labels, ticks and legends within the canvas at the default size, for 1, 2 and 6
    variants with grid-length names. Seen failing with the memory-categories title on one line (cut
    at both edges with 1 and 2 variants), and with the memory bars' method on the title's line (cut)."""
    names = [f"loss=chunked,dtype=bfloat16,n={i}" for i in range(count)]
    records = [
        make_record(n, 0, speed=100 + i, peak_mib=10 + i, losses=[4.0, 3.0, 2.0], parameters=1000 * (i + 1))
        for i, n in enumerate(names)
    ]
    breakdown = {
        "params": 3 * 2**20,
        "grads": 3 * 2**20,
        "optimizer": 6 * 2**20,
        "activations": 5 * 2**20,
        "temporaries": 2**19,
        "transient": 2**20,
    }
    for r in records:
        r["summary"]["tensor_breakdown"] = {"at_peak": breakdown, "max": breakdown, "forward_backward_max": 6 * 2**20}
        r["summary"]["peak_tensor_bytes"] = 19 * 2**20
        r["summary"]["tensor_method"] = "cpu_tracked_tensors"
    axis = "model.init_args.model.config.num_hidden_layers"
    plan = {
        "name": "p",
        "baseline": names[0],
        "axes": {axis: list(range(1, count + 1))},
        "seeds": [0],
        "warmup_steps": 1,
        "variants": [{"name": n, "axis_values": {axis: i + 1}} for i, n in enumerate(names)],
    }
    summary = summary_of(records, plan)
    for v in summary["variants"]:
        v["estimated_memory_categories"] = {
            "params": 3 * 2**20,
            "grads": 3 * 2**20,
            "optimizer": 6 * 2**20,
            "activations": 14 * 2**20,
            "transient": 0,
        }
    problems: dict[str, list[str]] = {}
    save = plots._save

    def checked_save(fig: plt.Figure, path: Path) -> str:
        fig.tight_layout()
        problems[path.name] = _text_outside(fig)
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", checked_save)
    written = plots.write_plots(summary, tmp_path)
    assert "memory_categories.png" in written and "loss.png" in written
    assert {name: texts for name, texts in problems.items() if texts} == {}
    json.dumps(summary)  # the summary stays plain data
