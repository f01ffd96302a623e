"""One writer per run folder: a killed runner takes its run (and the run's ranks) down, and a
resumed study refuses to start a second writer beside a live one.

Real processes throughout: a runner in a subprocess, SIGKILLed; a stand-in fit with a second
"rank" (its own child, as Lightning's launcher starts them). Bugs caught: without the death
signal a SIGKILLed runner's fit lives on (test_die_with_runner...); without the reaper the
fit's own children live on (test_reaper...); without the lock a resumed runner clears and
rewrites a folder a live process still writes (test_resume_refuses...).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_ablation_runner import RUNNER_SCRIPT, fake_resolve, install_fake_fit, launches, make_spec, record

from lit_ablate.ablation import run_folder_lock
from lit_ablate.ablation.run_folder_lock import GroupReaper, RunFolderBusy, group_alive
from lit_ablate.commands.ablate import run_study
from lit_ablate.record import read_record

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and prctl: Linux")
GONE_WITHIN_S = 10.0
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def fake_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return install_fake_fit(tmp_path, monkeypatch)


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie may wait for a reaper that PID 1 never is)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_die_with_runner_kills_the_child_when_its_parent_is_sigkilled():
    """The kernel's death signal: a SIGKILLed parent cannot run any clean-up of its own."""
    middle = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import subprocess, sys, time\n"
                "from lit_ablate.ablation.run_folder_lock import die_with_runner\n"
                f"child = subprocess.Popen({SLEEPER!r}, preexec_fn=die_with_runner())\n"
                "print(child.pid, flush=True)\n"
                "time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(middle.stdout.readline())
    assert alive(child)
    middle.kill()
    middle.wait()
    wait_until(lambda: not alive(child), GONE_WITHIN_S, "the child outlived its SIGKILLed parent")


def test_reaper_stops_the_whole_group_when_the_runner_vanishes_and_not_after_done():
    group = [subprocess.Popen(SLEEPER, process_group=0)]
    group.append(subprocess.Popen(SLEEPER, process_group=group[0].pid))  # a "rank" in the same group
    reaper = GroupReaper(group[0].pid, grace_s=1.0)
    reaper.done()  # the runner reaped the run itself: nothing is touched
    time.sleep(0.3)
    assert all(p.poll() is None for p in group)
    reaper = GroupReaper(group[0].pid, grace_s=1.0)
    reaper._process.stdin.close()  # what the kernel does to the pipe when the runner dies
    for p in group:
        assert p.wait(timeout=GONE_WITHIN_S) == -signal.SIGTERM
    reaper._process.wait(timeout=GONE_WITHIN_S)
    assert not group_alive(group[0].pid)


def test_sigkilled_runner_takes_its_run_and_the_runs_ranks_down(tmp_path: Path, fake_fit: list[str]):
    out = tmp_path / "study"
    script = tmp_path / "runner.py"
    script.write_text(RUNNER_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out), fake=fake_fit[1]))
    env = {**os.environ, "FAKE_HANG": "first", "FAKE_RANK": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    runner = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
    run_dir = out / "runs" / "first" / "seed0"
    wait_until(lambda: (run_dir / "run.json.pid").exists() or runner.poll() is not None, 60, "the run never started")
    assert runner.poll() is None, runner.stderr.read()
    fit, rank = int((run_dir / "run.json.pid").read_text()), int((run_dir / "run.json.rank.pid").read_text())
    assert alive(fit) and alive(rank)
    runner.kill()
    runner.wait()
    wait_until(lambda: not alive(fit), GONE_WITHIN_S, "the fit outlived its SIGKILLed runner")
    wait_until(lambda: not alive(rank), GONE_WITHIN_S, "a rank of the fit outlived the SIGKILLed runner")
    assert read_record(run_dir / "run.json")["summary"]["status"] == "running"
    # resuming: the folder is free again, the run is redone
    run_study(
        make_spec([{"name": "first"}, {"name": "second", "overrides": {"model.init_args.lr": 0.2}}]),
        out,
        fake_fit,
        fake_resolve,
    )
    assert record(out, "first")["summary"]["status"] == "ok"


def test_resume_refuses_while_an_earlier_runs_processes_live(tmp_path: Path, fake_fit: list[str], monkeypatch):
    """The runner and its reaper both gone (say ``kill -9`` of both), a rank left behind: no second writer."""
    spec = make_spec([{"name": "first"}, {"name": "second", "overrides": {"model.init_args.lr": 0.2}}])
    out = tmp_path / "study"
    run_study(spec, out, fake_fit, fake_resolve)
    run_dir = out / "runs" / "first" / "seed0"
    left_behind = subprocess.Popen(SLEEPER, start_new_session=True)
    (run_dir / "run.lock").write_text(f'{{"runner_pid": 1, "process_group": {left_behind.pid}}}\n')
    crashed = read_record(run_dir / "run.json")
    crashed["summary"]["status"] = "running"  # what a killed run leaves
    (run_dir / "run.json").write_text(json.dumps(crashed))
    monkeypatch.setattr(run_folder_lock, "LOCK_WAIT_S", 0.5)
    try:
        with pytest.raises(RunFolderBusy) as info:
            run_study(spec, out, fake_fit, fake_resolve)
        assert info.value.key == str(run_dir / "run.lock") and info.value.value == [left_behind.pid]
        assert f"kill -- -{left_behind.pid}" in str(info.value)
        assert read_record(run_dir / "run.json")["summary"]["status"] == "running", "the folder was not touched"
        assert launches(tmp_path) == ["first 0", "second 0"]
    finally:
        left_behind.kill()
        left_behind.wait()
    run_study(spec, out, fake_fit, fake_resolve)
    assert launches(tmp_path)[2:] == ["first 0"] and record(out, "first")["summary"]["status"] == "ok"


def test_a_second_runner_on_the_same_run_is_refused_at_once(tmp_path: Path, fake_fit: list[str]):
    spec = make_spec([{"name": "first"}])
    out = tmp_path / "study"
    lock_path = out / "runs" / "first" / "seed0" / "run.lock"
    lock_path.parent.mkdir(parents=True)
    with open(lock_path, "a+") as held:
        held.write('{"runner_pid": 4242, "process_group": null}\n')
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another runner, at work on this run
        with pytest.raises(RunFolderBusy, match="another `lit-ablate ablate`") as info:  # not the wait for leftovers
            run_study(spec, out, fake_fit, fake_resolve)
        assert info.value.value == 4242
    assert launches(tmp_path) == []
