"""``lit-ablate ablate``: the study command the CLI dispatches to (``lit-ablate report``: ``commands.report``).

``ablate --config STUDY.yaml`` plans the study (resolve every variant, refuse a second
variable, mark what cannot run here), runs what is not finished yet, and writes the report.
``--steps N --seeds K --only a,b`` shorten it for a first try (``StudySpec.shortened``);
``--dry-run`` prints the plan and runs nothing. A study with a variant whose config does not resolve or
that ``fit`` would refuse is refused (status 2) before any run starts (``--dry-run`` prints the plan
first). While it runs, two live lines follow the study and the run in flight; at the end it prints one
row per variant (``terminal_summary``) and the report's path. It parses its own arguments with argparse:
``--config`` here is the study file, not a LightningCLI config.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape

from lit_ablate.ablation.interleaving import interleaving
from lit_ablate.ablation.plan import PlannedRun, Resolver, describe, plan_study
from lit_ablate.ablation.portable_paths import portable
from lit_ablate.ablation.report import PLAN_FILENAME, write_report
from lit_ablate.ablation.run_folder import checkpoint_to_resume, is_kept, previous_record
from lit_ablate.ablation.runner import run_runs
from lit_ablate.ablation.slurm import require_submitit
from lit_ablate.ablation.spec import StudySpec, load_study
from lit_ablate.ablation.study_trackers import send_study
from lit_ablate.commands.report import ALLOW_FAILURES_HELP, EXIT_REFUSED, printed_summary, study_exit_code
from lit_ablate.config_keys import NOT_GIVEN, PairedKey, ignored_key
from lit_ablate.cpu_half_matmuls import slow_bf16_matmuls
from lit_ablate.errors import ConfigError
from lit_ablate.path_checks import writable_dir

NO_WAIT = PairedKey("--no-wait", "launch.executor", lambda executor: executor == "slurm", "'slurm'")
"""``--no-wait`` returns once the jobs are queued; a local study has no queue (it ran to the end)."""
EXIT_INTERRUPTED = 130


def run_study(
    spec: StudySpec,
    output_dir: Path,
    fit_command: Sequence[str] | None = None,
    resolve: Resolver | None = None,
    retry_failed: bool = False,
    console: Console | None = None,
    wait: bool = True,
) -> Path:
    """Plan, run (resuming) and report one study; returns ``report.md``.

    On Ctrl-C the current run is stopped, the report of what finished is written, and
    ``KeyboardInterrupt`` propagates. ``fit_command`` and ``resolve`` default to the real CLI.
    """
    runs = check_every_variant_resolves(plan_study(spec, output_dir, resolve))
    if any(run.launch.executor == "slurm" for run in runs):
        require_submitit()
    output_dir.mkdir(parents=True, exist_ok=True)
    plan = {**spec.plan(), "source": os.path.relpath(spec.source.resolve(), output_dir) if spec.source else None}
    (output_dir / PLAN_FILENAME).write_text(json.dumps(portable(plan, output_dir), indent=1) + "\n")
    design = interleaving(spec.speed, runs)
    for line in filter(None, (design.describe(), slow_bf16_line(runs))):
        (console or Console(stderr=True)).print(line, markup=False, highlight=False)
    try:
        run_runs(runs, fit_command, retry_failed, console, wait, design)
    finally:
        if any(output_dir.glob("runs/*/*/run.json")):
            write_report(output_dir)
    if (output_dir / "report.json").is_file():  # not before a queued SLURM study's first job finished
        send_study(output_dir)
    return output_dir / "report.md"


def slow_bf16_line(runs: list[PlannedRun]) -> str | None:
    """The plan's line naming the variants that compute in bf16 on a CPU without bf16 matrix kernels (they
    run, far slower), or None."""
    slow = {
        run.variant.name: why
        for run in runs
        if not (run.skip_reason or run.invalid) and run.launch.executor == "local"
        if (why := slow_bf16_matmuls(run.view.compute_dtype, run.view.trainer.device_type))
    }
    return f"variants computing in bf16 ({', '.join(slow)}): {next(iter(slow.values()))}" if slow else None


def check_every_variant_resolves(runs: list[PlannedRun]) -> list[PlannedRun]:
    """``runs``, unless a variant's config does not resolve or ``fit`` would refuse it: then the study is
    refused before its first run starts (a study that trained the others and reported this one as failed
    made a typo cost the whole study's time, and exited 0)."""
    bad = list(dict.fromkeys((run.variant.name, run.invalid) for run in runs if run.invalid))
    if bad:
        names = [name for name, _ in bad]
        total = len({run.variant.name for run in runs})
        which = (
            "no variant's config can run"
            if len(names) == total
            else f"{len(names)} of {total} variants' configs cannot run"
        )
        raise ConfigError(
            "variants",
            names,
            f"{which}, nothing ran ({bad[0][0]}: {bad[0][1]}); fix the variant's "
            "overrides, or the base config (--dry-run lists every variant's problem)",
        )
    return runs


def _load_study(path: Path) -> StudySpec:
    """``load_study`` with a YAML syntax error as a one-line ``ConfigError``."""
    try:
        return load_study(path)
    except yaml.YAMLError as err:
        raise ConfigError(
            "--config", str(path), f"not valid YAML ({' '.join(str(err).split())}); fix the study file"
        ) from err


def ablate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lit-ablate ablate", description="Run an ablation study and write its report.", allow_abbrev=False
    )
    parser.add_argument("--config", required=True, type=Path, help="the study YAML (configs/studies/*.yaml)")
    parser.add_argument("--output_dir", type=Path, help="where runs and the report go (default: studies/<study name>/)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run, instead of the study's (a first try)")
    parser.add_argument(
        "--seeds", type=int, help="how many seeds: the study's first K (more: the integers after its last)"
    )
    parser.add_argument("--only", help="comma-separated variants to run (the baseline and loss references come along)")
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="resolve and check every variant, print the plan (runs, ranks, skips and why), run nothing",
    )
    parser.add_argument(
        "--retry-failed",
        "--retry_failed",
        dest="retry_failed",
        action="store_true",
        help="also redo runs that ended in error, oom or timeout (finished ok runs are kept)",
    )
    parser.add_argument(
        "--allow-failures", "--allow_failures", dest="allow_failures", action="store_true", help=ALLOW_FAILURES_HELP
    )
    parser.add_argument(
        "--no-wait",
        "--no_wait",
        dest="no_wait",
        action="store_true",
        help="launch.executor slurm: submit, print the queue and return; the same command collects later",
    )
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        full = _load_study(args.config)
        spec = full.shortened(steps=args.steps, seeds=args.seeds, only=args.only)
        submitted = "slurm" if any(v.launch.executor == "slurm" for v in spec.variants) else spec.launch.executor
        refusal = ignored_key([NO_WAIT], lambda key: True if args.no_wait else NOT_GIVEN, lambda key: submitted)
        if refusal:
            raise refusal.error()
        output_dir = (args.output_dir or Path("studies") / spec.name).resolve()
        if args.dry_run:
            runs = plan_study(spec, output_dir)
            print(dry_run(full, spec, runs, output_dir, args.retry_failed))
            check_every_variant_resolves(runs)
            return 0
        writable_dir("--output_dir", output_dir)
        report = run_study(spec, output_dir, retry_failed=args.retry_failed, console=console, wait=not args.no_wait)
    except ConfigError as err:
        console.print(f"[red]study refused:[/red] {escape(str(err))}", markup=True, highlight=False, soft_wrap=True)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        console.print("interrupted: finished runs are kept; run the same command again to resume")
        return EXIT_INTERRUPTED
    print(printed_summary(report))
    return study_exit_code(report.parent, args.allow_failures)


def dry_run(full: StudySpec, spec: StudySpec, runs: list[PlannedRun], output_dir: Path, retry_failed: bool) -> str:
    """The plan ``--dry-run`` prints: the study's size and what shortened it, then one row per run."""
    steps = f"{spec.steps} steps" if spec.steps is not None else "the base config's steps"
    lines = [
        f"study {spec.name}: {len(spec.variants)} variants × {len(spec.seeds)} seeds (seeds "
        f"{', '.join(map(str, spec.seeds))}) = {len(runs)} runs, {steps}, baseline {spec.baseline} -> {output_dir}"
    ]
    cut = []
    if spec.steps != full.steps:
        cut.append(f"steps {spec.steps} (study: {full.steps if full.steps is not None else 'the base config'})")
    if spec.seeds != full.seeds:
        cut.append(f"seeds {len(spec.seeds)} (study: {len(full.seeds)})")
    if len(spec.variants) != len(full.variants):
        cut.append(f"variants {len(spec.variants)} of {len(full.variants)}")
    if cut:
        lines.append("shortened: " + ", ".join(cut))
    kept = {}
    for run in runs:
        previous = previous_record(run)
        if previous is not None and is_kept(previous, run, retry_failed):
            kept[run.label] = previous["summary"]["status"]
    resumes = {
        run.label: os.path.relpath(checkpoint, output_dir)
        for run in runs
        if run.label not in kept and (checkpoint := checkpoint_to_resume(run)) is not None
    }
    lines.append(describe(runs, kept, resumes))
    lines.append(interleaving(spec.speed, runs).describe())
    lines.extend(filter(None, [slow_bf16_line(runs)]))
    counts = {
        "would run": sum(not (r.skip_reason or r.invalid or r.label in kept or r.label in resumes) for r in runs),
        "would resume from a checkpoint": len(resumes),
        "skipped": sum(bool(r.skip_reason) for r in runs),
        "would fail (bad config)": sum(bool(r.invalid) for r in runs),
        "already done (kept)": len(kept),
    }
    lines.append(
        "dry run, nothing ran: " + ", ".join(f"{n} {what}" for what, n in counts.items() if n or what == "would run")
    )
    return "\n".join(lines)
