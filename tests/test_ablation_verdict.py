"""A study report cannot mislead: a loss check that could not be made is not a pass, a study
where nothing finished exits non-zero, and a speed ratio is judged from blocks paired by seed, with its interval.

Bugs these catch (each seen failing with the fix removed): a variant whose reference has no ok run
"passed" by silence (exit 0); a study of only failed runs exited 0; a report without its baseline
silently took another variant as the baseline; speed ratios had no noise floor.
"""

from __future__ import annotations

import json
from pathlib import Path

from test_ablation_report import make_record, make_study

from lit_ablate.ablation.report import write_report
from lit_ablate.ablation.summary import study_summary
from lit_ablate.commands.report import report_main

EQUAL = {"rtol": 1e-4, "atol": 1e-6, "steps": None}
LOSSES = [4.0, 3.0, 2.0]


def plan(names: list[str], agreement: dict | None = EQUAL, baseline: str | None = None) -> dict:
    return {
        "name": "t",
        "baseline": baseline or names[0],
        "expect_equal_loss": agreement,
        "seeds": [0, 1],
        "warmup_steps": 1,
        "variants": [{"name": n} for n in names],
    }


def by_name(summary: dict) -> dict:
    return {v["name"]: v for v in summary["variants"]}


def summarise(records: list[dict], study: dict) -> dict:
    return study_summary(study, [(f"runs/{r['variant']}/seed{r['seed']}/run.json", r) for r in records])


def test_reference_without_an_ok_run_makes_the_loss_check_incomplete_and_exit_1(tmp_path: Path):
    records = [
        make_record("ref", 0, speed=1, peak_mib=1, losses=LOSSES, status="error"),
        make_record("v", 0, speed=1, peak_mib=1, losses=LOSSES),
    ]
    summary = summarise(records, plan(["ref", "v"]))
    check = by_name(summary)["v"]["loss_agreement"]
    assert check["passed"] is None and check["incomplete"] is True
    assert summary["problems"] == ["loss check incomplete: v: reference ref has no ok run of seed 0"]
    directory = make_study(tmp_path, records, plan(["ref", "v"]))
    assert report_main([str(directory)]) == 1, "an unchecked promise of equal losses must not exit 0"
    text = (directory / "report.md").read_text()
    assert "**INCOMPLETE** (reference ref has no ok run of seed 0)" in text and "Study problems (exit code 1)" in text


def test_a_seed_the_reference_lacks_is_incomplete_but_a_mismatch_still_fails():
    ref = [
        make_record("ref", 0, speed=1, peak_mib=1, losses=LOSSES),
        make_record("ref", 1, speed=1, peak_mib=1, losses=LOSSES, status="oom"),
    ]
    same = [make_record("same", s, speed=1, peak_mib=1, losses=LOSSES) for s in (0, 1)]
    off = [make_record("off", s, speed=1, peak_mib=1, losses=[4.0, 3.5, 2.0]) for s in (0, 1)]
    summary = summarise(ref + same + off, plan(["ref", "same", "off"]))
    assert by_name(summary)["same"]["loss_agreement"]["incomplete"] is True  # seed 0 agrees, seed 1 unchecked
    assert by_name(summary)["off"]["loss_agreement"]["passed"] is False  # a seen mismatch is a failure
    assert summary["problems"] == [
        "loss check incomplete: same: reference ref has no ok run of seed 1",
        "loss check failed: off: seed 0, step 2: 3.5 vs 3",
    ]


def test_a_variant_that_failed_itself_is_not_a_loss_problem():
    records = [
        make_record("ref", 0, speed=1, peak_mib=1, losses=LOSSES),
        make_record("broken", 0, speed=1, peak_mib=1, losses=LOSSES[:1], status="error"),
    ]
    summary = summarise(records, plan(["ref", "broken"]))
    assert by_name(summary)["broken"]["loss_agreement"] == {
        "passed": None,
        "incomplete": False,
        "reason": "this variant has no ok run",
    }
    assert summary["problems"] == []  # its row says error; the study goes on (a result, not a crash)


def test_a_baseline_that_never_ran_is_not_replaced_by_another_variant():
    records = [make_record("v", 0, speed=1, peak_mib=1, losses=LOSSES)]
    summary = summarise(records, plan(["base", "v"]))
    assert summary["study"]["baseline"] == "base" and by_name(summary)["base"]["status"] == "not run"
    assert by_name(summary)["v"]["speed_ratio"] is None
    assert summary["problems"] == ["loss check incomplete: v: reference base has no ok run of seed 0"]


def test_a_study_where_every_variant_failed_exits_non_zero(tmp_path: Path):
    records = [
        make_record(n, 0, speed=1, peak_mib=1, losses=LOSSES[:1], status=s)
        for n, s in (("a", "error"), ("b", "oom"), ("c", "skipped"))
    ]
    directory = make_study(tmp_path, records, plan(["a", "b", "c"], agreement=None))
    assert report_main([str(directory)]) == 1
    assert json.loads((directory / "report.json").read_text())["problems"] == [
        "no variant finished ok: nothing was measured"
    ]


def with_useful(record: dict, useful: list[float]) -> dict:
    """``record`` with these useful tokens/s at steps 2.. (step 1 is warm-up)."""
    record["steps"] = [
        {**record["steps"][0], "step": i + 1, "useful_tokens_per_sec": u} for i, u in enumerate([1.0, *useful])
    ]
    return record


def test_speed_is_judged_from_blocks_paired_by_seed_and_the_report_shows_the_interval(tmp_path: Path):
    """Records without blocks (older ones, SLURM jobs) are one block per seed. With eight seeds a variant 4%
    faster in every pair is *no difference detected* (within the 5% threshold) and one 30% faster is
    *faster*; the report's cell carries the interval. Replaces the baseline-only noise floor, which let
    load on a variant's runs read as its speed."""
    seeds = range(8)
    base = [with_useful(make_record("base", s, speed=1, peak_mib=1, losses=[1.0]), [100 + s] * 4) for s in seeds]
    close = [with_useful(make_record("close", s, speed=1, peak_mib=1, losses=[1.0]), [104 + s] * 4) for s in seeds]
    fast = [with_useful(make_record("fast", s, speed=1, peak_mib=1, losses=[1.0]), [130 + s] * 4) for s in seeds]
    study = plan(["base", "close", "fast"], agreement=None)
    study["seeds"] = list(seeds)
    variants = by_name(summarise(base + close + fast, study))
    assert variants["close"]["speed"]["verdict"] == "no difference detected"
    assert variants["fast"]["speed"]["verdict"] == "faster" and variants["fast"]["speed"]["low"] > 1.2
    text = write_report(make_study(tmp_path, base + close + fast, study)).read_text()
    assert "| 1.00× (baseline) |" in text and "| 1.29× [1.28–1.30] faster |" in text
    assert "| 1.04× [1.04–1.04] no difference detected |" in text


def test_one_measured_step_gives_no_verdict():
    base = [with_useful(make_record("base", 0, speed=1, peak_mib=1, losses=[1.0]), [100])]
    other = [with_useful(make_record("v", 0, speed=1, peak_mib=1, losses=[1.0]), [1000])]
    variants = by_name(summarise(base + other, plan(["base", "v"], agreement=None)))
    assert variants["v"]["speed"]["verdict"] == "inconclusive" and variants["v"]["speed_ratio"] == 10.0


def test_a_study_with_a_failed_run_exits_1_with_a_count_unless_failures_are_allowed(tmp_path: Path, capsys):
    """Issue 49: a study where 2 of 4 variants crashed exited 0, so a script running it could not tell. A
    failed run (error, oom, timeout) now exits 1 with one line counting them; ``--allow-failures`` keeps the
    old tolerance for studies that expect some variants not to fit; a skipped run (it cannot run here, as
    the plan said) is no failure. Seen failing with the old rule (exit 0: only study problems counted)."""
    records = [make_record("a", 0, speed=1, peak_mib=1, losses=LOSSES)]
    records += [
        make_record(n, 0, speed=1, peak_mib=1, losses=LOSSES[:1], status=s)
        for n, s in (("b", "error"), ("c", "oom"), ("d", "skipped"))
    ]
    directory = make_study(tmp_path, records, plan(["a", "b", "c", "d"], agreement=None))
    assert report_main([str(directory)]) == 1
    assert capsys.readouterr().err.strip() == "study failed: 2 of 4 runs failed (error 1, oom 1)"
    assert report_main([str(directory), "--allow-failures"]) == 0
    assert "2 of 4 runs failed (error 1, oom 1): tolerated (--allow-failures)" in capsys.readouterr().err
    skipped_only = make_study(tmp_path / "skipped", [records[0], records[3]], plan(["a", "d"], agreement=None))
    assert report_main([str(skipped_only)]) == 0


def test_ablate_exits_1_when_a_variant_crashes(tmp_path: Path, monkeypatch, capsys):
    """The same rule at the end of ``lit-ablate ablate`` (a stand-in fit: one variant raises)."""
    from test_ablation_runner import fake_resolve, install_fake_fit

    from lit_ablate.ablation import plan as planning
    from lit_ablate.ablation import runner
    from lit_ablate.commands.ablate import ablate_main

    fit = install_fake_fit(tmp_path, monkeypatch)
    monkeypatch.setattr(runner, "default_fit_command", lambda: fit)
    monkeypatch.setattr(planning, "default_resolver", lambda: fake_resolve)
    monkeypatch.setattr(planning, "default_constructor", lambda: None)  # the stand-in configs name no class
    study = {
        "name": "crash",
        "base": {"trainer": {"max_steps": 3}, "model": {"init_args": {"lr": 0.1}}, "fake": {}},
        "variants": [{"name": "ok"}, {"name": "crashes", "overrides": {"fake.crash": True}}],
        "vary": ["fake"],
        "speed": {"interleave": "runs"},
    }
    path = tmp_path / "crash.yaml"
    path.write_text(json.dumps(study))
    out = tmp_path / "out"
    assert ablate_main(["--config", str(path), "--output_dir", str(out)]) == 1
    assert "study failed: 1 of 2 runs failed (error 1)" in capsys.readouterr().err
    assert ablate_main(["--config", str(path), "--output_dir", str(out), "--allow-failures"]) == 0  # a rerun
