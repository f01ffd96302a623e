"""Does the speed verdict hold? Null studies under injected load, and known differences on a quiet machine.

    python benchmarks/speed_verdicts.py [--null-studies 4] [--known-studies 1] [--steps 62] [--out DIR]
    python benchmarks/speed_verdicts.py --null-studies 10 --known-studies 2   # the committed evidence (~10 min)

A *null study* compares two variants that cannot differ in speed: the model summary printed or not
(before training), a callback that does nothing, or sanity validation steps (before training). While
it runs, a CPU-bound process in its own session starts and stops at random (on 1.5–4 s, off 1–4 s),
as another job on a shared machine would. Its verdict must be *no difference detected* or
*inconclusive*, never *faster* or *slower*. A *known study* compares the quickstart model at 2 and 8
decoder layers on a quiet machine (no injected load): the 8-layer one must be *slower*, its interval
excluding 1. Every study is a real ``lit-ablate ablate`` of the quickstart config (tiny Llama, 16 rows of
128 tokens: blocks of 6 steps last long enough for the load to be read), in turns, with the shipped speed
design (10 rounds, 99% interval, ±5% threshold).

Prints one row per study and ends with::

    RESULT false_speed_verdicts=<n>        # null studies called faster or slower
    RESULT null_studies=<n>
    RESULT detected_differences=<n>        # known studies called slower
    RESULT known_studies=<n>
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
NULL_KINDS = {
    "model_summary": ("trainer.enable_model_summary", True, False),
    "no_op_callback": ("trainer.callbacks", None, "noop"),
    "sanity_validation": ("trainer.num_sanity_val_steps", 0, 2),
}
"""What a null study varies: each acts before training or does nothing inside it."""
MONITORS = [{"class_path": f"lit_ablate.callbacks.{name}"} for name in ("ThroughputMonitor", "MFUMonitor")]


def study(name: str, key: str, values: tuple, steps: int, warmup: int) -> dict:
    """A two-variant study of the quickstart model: ``key`` at ``values[0]`` (baseline) and ``values[1]``."""
    overrides = {
        "data.init_args.source.init_args.num_documents": 400,
        "data.init_args.seq_len": 128,
        "data.init_args.batch_size": 16,
        "data.init_args.val_examples": 16,
        "trainer.val_check_interval": None,
        "trainer.limit_val_batches": 2,
        "trainer.enable_checkpointing": False,
        "trainer.callbacks": MONITORS,
        "model.init_args.model.config.num_hidden_layers": 2,
    }
    variants = []
    for label, value in zip(("a", "b"), values):
        if key == "trainer.callbacks":
            callbacks = MONITORS + ([{"class_path": "lightning.pytorch.callbacks.Callback"}] if value else [])
            variants.append({"name": label, "overrides": {key: callbacks}})
        else:
            variants.append({"name": label, "overrides": {key: value}})
    return {
        "name": name,
        "base": str(QUICKSTART),
        "overrides": overrides,
        "variants": variants,
        "vary": [key],
        "steps": steps,
        "warmup_steps": warmup,
        "launch": {"devices": 1, "accelerator": "cpu", "timeout_s": 900},
        "speed": {"interleave": "steps"},
    }


class Load:
    """A CPU-bound process in its own session, switched on and off at random while a study runs."""

    def __init__(self, seed: int) -> None:
        self.random, self.stop, self.on_seconds = random.Random(seed), threading.Event(), 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(self.random.uniform(1.0, 4.0)):
            burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            started = time.monotonic()
            self.stop.wait(self.random.uniform(1.5, 4.0))
            burner.kill()
            burner.wait()
            self.on_seconds += time.monotonic() - started


def run_study(spec: dict, folder: Path) -> dict:
    """``lit-ablate ablate`` on ``spec``; the variant's speed judgement and the study's load line."""
    path = folder / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = folder / spec["name"]
    done = subprocess.run(
        [sys.executable, "-m", "lit_ablate.cli", "ablate", "--config", str(path), "--output_dir", str(out)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"{spec['name']}: ablate exited {done.returncode}\n{done.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    speed = report["variants"][1]["speed"]
    return {**speed, "foreign_cores": report["speed"]["foreign_cores"]}


def row(name: str, kind: str, load: str, speed: dict) -> str:
    interval = f"[{speed['low']:.3f}–{speed['high']:.3f}]" if speed.get("low") is not None else "—"
    ratio = f"{speed['ratio']:.3f}" if speed.get("ratio") is not None else "—"
    seen = speed.get("foreign_cores")
    other = f"{seen['median']:.2f} [{seen['min']:.2f}–{seen['max']:.2f}]" if seen else "not measured"
    return (
        f"| {name} | {kind} | {load} | {ratio} | {interval} | {speed['pairs']} | {speed['excluded_for_load']} "
        f"| {other} | {speed['verdict']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--null-studies", type=int, default=4, help="10 for the committed evidence")
    parser.add_argument("--known-studies", type=int, default=1, help="2 for the committed evidence")
    parser.add_argument("--steps", type=int, default=62, help="optimizer steps per run (2 of warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the injected load's timing")
    parser.add_argument("--out", type=Path, help="keep the studies here (default: a temporary folder)")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="speed-verdicts-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(
        "| study | compares | injected load | ratio | interval | pairs | left out for load "
        "| other processes' load (cores) | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    false = detected = 0
    kinds = list(NULL_KINDS)
    started = time.monotonic()
    for index in range(args.null_studies):
        kind = kinds[index % len(kinds)]
        key, baseline, other = NULL_KINDS[kind]
        with Load(args.seed + index) as load:
            speed = run_study(study(f"null{index}", key, (baseline, other), args.steps, 2), folder)
        false += speed["verdict"] in ("faster", "slower")
        print(row(f"null{index}", f"{kind}: {baseline} vs {other}", f"{load.on_seconds:.0f} s on", speed), flush=True)
    for index in range(args.known_studies):
        spec = study(f"known{index}", "model.init_args.model.config.num_hidden_layers", (2, 8), args.steps, 2)
        speed = run_study(spec, folder)
        detected += speed["verdict"] == "slower" and speed["high"] is not None and speed["high"] < 1
        print(row(f"known{index}", "2 vs 8 layers", "none", speed), flush=True)
    print(f"\n{time.monotonic() - started:.0f} s in all; studies under {folder}")
    print(f"RESULT false_speed_verdicts={false}")
    print(f"RESULT null_studies={args.null_studies}")
    print(f"RESULT detected_differences={detected}")
    print(f"RESULT known_studies={args.known_studies}")


if __name__ == "__main__":
    main()
