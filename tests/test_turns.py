"""Interleaved measurement (``lit_ablate.ablation.turns``): the runs of a seed take turns, block by block.

The runs are a stand-in for ``lit-ablate fit`` that speaks ``TurnTaking``'s protocol (arrive at a gate,
wait for the go, train to the step it names) and spends a fixed amount of CPU per step, so these tests
see the schedule in seconds; ``test_ablation_cli.py`` runs the real ``fit`` in turns.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import pytest

from lit_ablate import machine_load
from lit_ablate.ablation import turns
from lit_ablate.ablation.speed_verdict import FASTER, SLOWER
from lit_ablate.ablation.turns import block_ends
from lit_ablate.commands.ablate import run_study
from tests.test_ablation_runner import fake_resolve, make_spec, record

TURN_FIT = r"""
import json, os, socket, sys, time, yaml
from lit_ablate import record as R
config = yaml.safe_load(open(sys.argv[sys.argv.index("--config") + 1]))
fake, variant, max_steps = config.get("fake", {}), os.environ[R.VARIANT_ENV], config["trainer"]["max_steps"]
log = open(os.environ["FAKE_TURN_LOG"], "a", buffering=1)
address, run = os.environ["LIT_ABLATE_TURNS"].split(" ", 1)
host, port = address.rsplit(":", 1)
connection = socket.create_connection((host, int(port)))
reader, gate = connection.makefile("r"), 0
def arrive(step):
    global gate
    hello = {"run": run, "rank": 0, "processes": 1, "gate": gate, "step": step, "max_steps": max_steps,
             "warmup_steps": config["recorder"]["warmup_steps"]}
    connection.sendall((json.dumps(hello) + "\n").encode())
    gate += 1
    answer = reader.readline()
    return json.loads(answer)["until"] if answer else None
until, steps = arrive(0), []
for step in range(1, max_steps + 1):
    if until is not None and step - 1 >= until:
        until = arrive(step - 1)
    if fake.get("crash_at") == step:
        sys.exit(3)
    if fake.get("hang_at") == step:
        time.sleep(60)
    start = time.monotonic()
    log.write(f"{variant} {step} {start}\n")
    while time.monotonic() - start < fake.get("step_s", 0.02):
        pass
    log.write(f"{variant} {step} {time.monotonic()} end\n")
    seconds = time.monotonic() - start
    if step in fake.get("loaded_steps", []):  # a synthetic other process: one core for this step's time
        path = os.environ["FAKE_FOREIGN_SECONDS"]
        total = float(open(path).read()) if os.path.exists(path) else 0.0
        open(path, "w").write(str(total + seconds))
    steps.append({"step": step, "loss": 1.0, "useful_tokens_per_sec": 1000 / seconds, "step_time_s": seconds})
summary = R.summarize_steps(steps, 1)
summary.update(status="ok", message=None)
R.write_record(os.environ[R.RECORD_PATH_ENV], {"schema_version": R.SCHEMA_VERSION, "variant": variant,
    "seed": config["seed_everything"], "config": config, "environment": {}, "warmup_steps": 1, "fallbacks": [],
    "steps": steps, "summary": summary})
"""


@pytest.fixture
def turn_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    script = tmp_path / "turn_fit.py"
    script.write_text(TURN_FIT)
    monkeypatch.setenv("FAKE_TURN_LOG", str(tmp_path / "turns.log"))
    monkeypatch.setenv("FAKE_FOREIGN_SECONDS", str(tmp_path / "foreign"))
    return [sys.executable, str(script)]


def spec(variants: list[dict], steps: int = 11, **speed) -> object:
    base = {"trainer": {"max_steps": steps}, "model": {"init_args": {"lr": 0.1}}, "fake": {}}
    return make_spec(variants, base=base, steps=steps, speed={"interleave": "steps", "rounds": 5, **speed})


def step_spans(tmp_path: Path) -> list[tuple[str, int, float, float]]:
    """``(variant, step, start, end)`` of every step the stand-in ran, in time order."""
    starts, spans = {}, []
    for line in (tmp_path / "turns.log").read_text().splitlines():
        variant, step, at, *end = line.split()
        if end:
            spans.append((variant, int(step), starts.pop((variant, step)), float(at)))
        else:
            starts[(variant, step)] = float(at)
    return sorted(spans, key=lambda span: span[2])


def test_block_ends_cut_the_measured_steps_into_rounds():
    assert block_ends(11, 1, 5) == [1, 3, 5, 7, 9, None]
    assert block_ends(10, 3, 10) == [3, 4, 5, 6, 7, 8, 9, None]  # 7 measured steps: 7 blocks
    assert block_ends(3, 3, 10) == [None] and block_ends(None, 3, 10) == [None] and block_ends(-1, 0, 4) == [None]


def test_the_runs_of_a_seed_take_turns_one_block_each_in_a_rotating_order(tmp_path: Path, turn_fit: list[str]):
    """No two runs ever compute at once after start-up, each trains one block per round, the first of a
    round rotates, and each record holds its blocks. Seen failing with the rotation removed (``a`` first in
    every round)."""
    study = spec([{"name": "a"}, {"name": "b"}, {"name": "c"}])
    out = tmp_path / "study"
    run_study(study, out, turn_fit, fake_resolve)
    spans = step_spans(tmp_path)
    for (_, _, _, end), (_, _, start, _) in itertools.pairwise(spans):
        assert start >= end, "two runs computed at once"
    blocks = {v: record(out, v)["speed_blocks"] for v in "abc"}
    for variant, section in blocks.items():
        assert section["design"] == "steps" and section["group"] == blocks["a"]["group"]
        assert [(b["round"], b["first_step"], b["last_step"]) for b in section["blocks"]] == [
            (1, 2, 3),
            (2, 4, 5),
            (3, 6, 7),
            (4, 8, 9),
            (5, 10, 11),
        ]
        assert all(b["seconds"] > 0 for b in section["blocks"]), variant
    measured = [variant for variant, step, _, _ in spans if step > 1]
    firsts = [measured[i * 6] for i in range(5)]  # each round: 3 runs x 2 steps
    assert firsts == ["a", "b", "c", "a", "b"]


def test_a_run_that_crashes_in_its_turn_leaves_the_others_to_finish(tmp_path: Path, turn_fit: list[str]):
    study = spec([{"name": "a"}, {"name": "b", "overrides": {"fake.crash_at": 6}}])
    out = tmp_path / "study"
    run_study(study, out, turn_fit, fake_resolve)
    assert record(out, "b")["summary"]["status"] == "error" and record(out, "a")["summary"]["status"] == "ok"
    assert len(record(out, "a")["speed_blocks"]["blocks"]) == 5
    assert len(record(out, "b")["speed_blocks"]["blocks"]) == 3  # rounds 1, 2 and the one it died in


def test_a_run_s_time_limit_counts_its_own_time_not_its_waits(tmp_path: Path, turn_fit: list[str]):
    """Four runs of ~1.6 s of steps each take over 6 s in turns; each finishes under a 4.5 s limit, which a
    limit on wall time would have broken (seen failing so: every run stopped by 4.7 s). A run that hangs in
    its turn is stopped at its limit and the others go on."""
    variants = [{"name": n, "overrides": {"fake.step_s": 0.1}} for n in "abc"]
    variants.append({"name": "hangs", "overrides": {"fake.step_s": 0.1, "fake.hang_at": 5}})
    base = {"trainer": {"max_steps": 16}, "model": {"init_args": {"lr": 0.1}}, "fake": {}}
    study = make_spec(
        variants, base=base, steps=16, speed={"interleave": "steps", "rounds": 5}, launch={"timeout_s": 4.5}
    )
    out = tmp_path / "study"
    started = time.monotonic()
    run_study(study, out, turn_fit, fake_resolve)
    assert time.monotonic() - started > 4.5 * 1.2
    assert [record(out, n)["summary"]["status"] for n in "abc"] == ["ok", "ok", "ok"]
    assert record(out, "hangs")["summary"]["status"] == "timeout"


def test_pairs_whose_blocks_ran_under_different_load_are_left_out(tmp_path: Path, turn_fit, monkeypatch):
    """The runner samples the machine's load around every block and the verdict leaves out the pairs whose
    two blocks differ. Here the load is a synthetic other process that the stand-in adds during three of
    ``b``'s blocks (a ``machine_load`` that reads it, so the test does not depend on this machine's other
    work; ``machine_load`` itself is tested against real processes in ``tests/test_machine_load.py``).
    Seen failing with the runner sampling once, after the block (no load seen)."""
    foreign = tmp_path / "foreign"

    def sample(**kwargs):
        extra = float(foreign.read_text()) if foreign.exists() else 0.0
        return machine_load.CpuSample(time.monotonic(), extra, 0.0)

    monkeypatch.setattr(turns.machine_load, "sample", sample)
    loaded = [2, 3, 6, 7, 10, 11]  # b's blocks 1, 3 and 5 (two steps each after one warm-up step)
    variants = [
        {"name": "a", "overrides": {"fake.step_s": 0.15}},
        {"name": "b", "overrides": {"fake.step_s": 0.15, "fake.loaded_steps": loaded}},
    ]
    study = spec(variants, steps=21, rounds=10)  # blocks of 0.3 s: long enough for /proc's ticks
    out = tmp_path / "study"
    run_study(study, out, turn_fit, fake_resolve)
    blocks = record(out, "b")["speed_blocks"]["blocks"]
    assert [b["round"] for b in blocks if b["foreign_cores"] > 0.5] == [1, 3, 5]
    b = json.loads((out / "report.json").read_text())["variants"][1]["speed"]
    assert b["excluded_for_load"] == 3 and b["pairs"] == 7 and b["verdict"] not in (FASTER, SLOWER)
