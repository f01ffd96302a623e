"""A study started again after an interruption, on fewer ranks: what it finished is kept, the run it was in
continues from its newest checkpoint, and speeds measured on different layouts are not compared.

The runs are ``test_ablation_runner.py``'s stand-in fit (it logs each launch with the checkpoint it was given);
that a checkpoint written on one layout continues the loss curve on another, through the real ``fit``, is
``test_resume_any_layout.py``'s. Seen failing with ``layout_change.trains_the_same`` always False (the
finished run launched again and the interrupted one started over: ``done 0`` and ``victim 0`` relaunched,
no ``from step=2.ckpt``), and with the checkpoint left out of the fit's arguments (``victim 0`` without it).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from lit_ablate.ablation.plan import describe, plan_study
from lit_ablate.ablation.run_folder import checkpoint_to_resume
from lit_ablate.ablation.speed_verdict import SpeedDesign, judge_speed
from lit_ablate.commands.ablate import run_study
from lit_ablate.record import read_record
from tests.test_ablation_runner import (
    BASE,
    fake_resolve,
    install_fake_fit,
    kill_when_started,
    launches,
    make_spec,
    record,
)

DATA = {"class_path": "lit_ablate.data.LMDataModule", "init_args": {"batch_size": 1}}


@pytest.fixture
def fake_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return install_fake_fit(tmp_path, monkeypatch)


def study(devices: int, batch_size: int):
    base = copy.deepcopy(BASE) | {"data": copy.deepcopy(DATA)}
    base["data"]["init_args"]["batch_size"] = batch_size
    variants = [{"name": "done"}, {"name": "victim", "overrides": {"model.init_args.lr": 0.2}}]
    return make_spec(variants, base=base, launch={"devices": devices, "accelerator": "cpu"})


def interrupt_the_victim(out: Path, spec, fake_fit: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the study with ``victim`` killed (SIGKILL, as a pre-empted node) after its checkpoint of step 2."""
    monkeypatch.setenv("FAKE_HANG", "victim")
    monkeypatch.setenv("FAKE_CHECKPOINT", "1")
    killer = kill_when_started(out / "runs" / "victim" / "seed0" / "run.json.pid")
    run_study(spec, out, fake_fit, fake_resolve)
    killer.join()
    monkeypatch.delenv("FAKE_HANG")
    assert record(out, "victim")["summary"]["status"] == "interrupted"


@pytest.mark.parametrize(
    ("batch_size", "kept"),
    [(2, True), (1, False)],
    ids=["global-batch-kept", "global-batch-changed"],
)
def test_a_study_started_again_on_fewer_ranks_keeps_what_it_trained(tmp_path, fake_fit, monkeypatch, batch_size, kept):
    """2 ranks x batch 1, interrupted; then 1 rank x ``batch_size``: with the global batch kept (2) the
    finished run stays and the interrupted one resumes from its checkpoint; with another global batch both
    are other runs, and train from their first step."""
    out = tmp_path / "study"
    interrupt_the_victim(out, study(devices=2, batch_size=1), fake_fit, monkeypatch)
    again = study(devices=1, batch_size=batch_size)
    victim = next(run for run in plan_study(again, out, fake_resolve) if run.variant.name == "victim")
    checkpoint = out / "runs" / "victim" / "seed0" / "trainer" / "checkpoints" / "step=2.ckpt"
    assert checkpoint_to_resume(victim) == (checkpoint if kept else None)
    run_study(again, out, fake_fit, fake_resolve)
    if kept:
        assert launches(tmp_path) == ["done 0", "victim 0", "victim 0 from step=2.ckpt"]
        folder = out / "runs" / "victim" / "seed0"
        assert read_record(folder / "attempts" / "run.0.json")["summary"]["status"] == "interrupted"
        resumed_line = "--- resuming from runs/victim/seed0/trainer/checkpoints/step=2.ckpt ---"  # paths made portable
        assert resumed_line in (folder / "stderr.log").read_text()
        assert record(out, "done")["config"]["trainer"]["devices"] == 2, "the finished run's record is its own"
    else:
        assert launches(tmp_path) == ["done 0", "victim 0", "done 0", "victim 0"]
    assert record(out, "victim")["summary"]["status"] == "ok"
    assert record(out, "victim")["config"]["trainer"]["devices"] == 1


def test_the_dry_run_says_which_runs_resume():
    """A resumed run's row names its checkpoint; the planner's other states keep precedence."""
    runs = plan_study(study(devices=1, batch_size=2), Path("/nonexistent/study"), fake_resolve)
    table = describe(runs, kept={"done seed0": "ok"}, resumes={"victim seed0": "runs/victim/seed0/step=2.ckpt"})
    assert [line.rsplit("  ", 1)[-1] for line in table.splitlines()[1:]] == [
        "done (ok, kept)",
        "resume from runs/victim/seed0/step=2.ckpt",
    ]


def speed_record(seed: int, world_size: int, tokens_per_sec: float) -> dict:
    """A finished run measured as one block of 8 steps on ``world_size`` ranks."""
    steps = [{"step": s, "useful_tokens_per_sec": tokens_per_sec, "step_time_s": 0.1} for s in range(1, 9)]
    return {"seed": seed, "environment": {"world_size": world_size}, "warmup_steps": 0, "steps": steps}


@pytest.mark.parametrize("same_ranks", [True, False], ids=["one-layout-asked", "ranks-vary-by-design"])
def test_a_pair_measured_on_different_numbers_of_ranks_is_left_out_unless_the_study_varies_them(same_ranks):
    """Seed 0 of both variants ran on 4 ranks; seed 1 of the variant on 2 (the study resumed on fewer) and the
    baseline's on 4. Where the study asks both for as many ranks, that pair compares layouts, not variants
    (2.0x here): it is left out. Seen failing with the rank check removed (2 pairs, ratio 1.5)."""
    variant = [speed_record(0, 4, 1000.0), speed_record(1, 2, 2000.0)]
    baseline = [speed_record(0, 4, 1000.0), speed_record(1, 4, 1000.0)]
    speed = judge_speed(variant, baseline, SpeedDesign(), same_ranks=same_ranks)
    assert (speed["pairs"], speed["excluded_for_layout"]) == ((1, 1) if same_ranks else (2, 0))
    assert speed["ratio"] == (1.0 if same_ranks else 1.5)
    assert ("left out: measured on different numbers of ranks" in speed["reason"]) is same_ranks
