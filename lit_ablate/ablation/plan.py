"""From a study spec to the list of runs: resolve, check one variable, check what can run here.

Every variant's config is resolved exactly as ``lit-ablate fit`` would resolve it (the CLI's
``resolve_fit_config``), then the resolved configs are diffed (the single-variable check) and
each is checked as ``fit`` checks a config before it starts (``preflight.check_config``) and judged by
the compatibility rules. A variant whose config does not resolve or is refused is planned as a failed
run carrying the message (``--dry-run`` shows it as ``fails:``), and ``lit-ablate ablate`` refuses the
study before the first run starts; a variant that only cannot run here is planned as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from lit_ablate.ablation.single_variable import check_single_variable
from lit_ablate.ablation.spec import RUNNER_KEYS, Launch, StudySpec, Variant
from lit_ablate.compatibility import cluster_rules, incompatibility
from lit_ablate.errors import ConfigError
from lit_ablate.preflight import check_config, check_simulation
from lit_ablate.run_config import RunConfig

Resolver = Callable[[list[str]], dict[str, Any]]
"""``(fit args) -> resolved config``: what ``lit-ablate fit <args>`` would run, without running it."""
RESOLVE_ERRORS = (ValueError, TypeError, KeyError, argparse.ArgumentError, SystemExit)
"""What a resolver raises for a config it rejects (jsonargparse exits unless built not to)."""


@dataclass(frozen=True)
class PlannedRun:
    """One variant × seed: where it runs, the config it gets, and whether it can run here.

    ``skip_reason`` (a compatibility rule failed) and ``invalid`` (the config does not resolve, or ``fit``
    would refuse it) are mutually exclusive; a run with neither is launched.
    """

    variant: Variant
    seed: int
    run_dir: Path
    config: dict[str, Any]
    launch: Launch
    skip_reason: str | None = None
    invalid: str | None = None

    @property
    def label(self) -> str:
        return f"{self.variant.name} seed{self.seed}"


def default_resolver() -> Resolver:
    """The CLI's resolver (imported late: the CLI pulls in Lightning and transformers)."""
    from lit_ablate.fit_cli import resolve_fit_config

    return resolve_fit_config


def run_dir(output_dir: Path, variant: Variant, seed: int) -> Path:
    return output_dir / "runs" / variant.name / f"seed{seed}"


def trainer_root(directory: Path) -> Path:
    """The run's ``trainer.default_root_dir``: beside, not over, the runner's own files. A planned run's
    config (its ``config.yaml``) holds it relative to the study folder, so that the folder can move; the
    runner gives the fit the absolute path (``run_folder.fit_arguments``)."""
    return directory / "trainer"


def plan_study(spec: StudySpec, output_dir: Path, resolve: Resolver | None = None) -> list[PlannedRun]:
    """All runs of the study in the order they run (``spec.order``: round-robin over variants by
    default); raises ``ConfigError`` on a second variable."""
    resolve = resolve or default_resolver()
    output_dir = output_dir.resolve()
    resolved: dict[str, dict[str, Any]] = {}
    invalid: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lit-ablate-plan-") as tmp:
        for variant in spec.variants:
            seed = spec.seeds[0]
            path = Path(tmp) / f"{variant.name}.yaml"
            write_config(path, spec.run_config(variant, seed, trainer_root(run_dir(output_dir, variant, seed))))
            outcome = _resolve(resolve, path)
            if isinstance(outcome, str):
                invalid[variant.name] = outcome
            else:
                resolved[variant.name] = outcome
    check_single_variable(resolved, spec.variables, ignored=RUNNER_KEYS)
    views = {name: RunConfig.of(config) for name, config in resolved.items()}  # each variant's config, read once
    check_losses_are_a_model_s(spec, views)
    for name, view in views.items():
        refused = _refused(view)
        if refused:
            invalid[name] = refused
    runs = []
    pairs = [(v, s) for s in spec.seeds for v in spec.variants]
    if spec.order == "by_variant":
        pairs = [(v, s) for v in spec.variants for s in spec.seeds]
    for variant, seed in pairs:
        directory = run_dir(output_dir, variant, seed)
        config = spec.run_config(variant, seed, trainer_root(directory).relative_to(output_dir))
        launch = variant.launch.with_config(config)
        reason = None if variant.name in invalid else _incompatibility(views[variant.name], launch)
        runs.append(PlannedRun(variant, seed, directory, config, launch, reason, invalid.get(variant.name)))
    return runs


def _incompatibility(config: RunConfig, launch: Launch) -> str | None:
    """Why the run cannot run where it goes: this machine, or (``executor: slurm``) the cluster as the
    study declares it, never the login node planning it: with accelerator auto its nodes are GPU
    nodes when the partition has GPUs (``launch.slurm.gpus_per_node``), else CPU nodes."""
    if launch.executor == "local":
        return incompatibility(config, launch)
    if (launch.accelerator or "auto") == "auto":
        launch = replace(launch, accelerator="gpu" if launch.slurm and launch.slurm.gpus_per_node else "cpu")
    return incompatibility(config, launch, cluster_rules())


def check_losses_are_a_model_s(spec: StudySpec, views: Mapping[str, RunConfig]) -> None:
    """Refuse ``expect_equal_loss`` and ``expect_equal_gradients`` over simulated ranks (``launch.simulate``):
    their collectives move no data, so their losses and gradients are no model's and a check of them could
    only pass or fail by chance."""
    simulated = [name for name, view in views.items() if view.simulation is not None]
    for key, check, what in (
        ("expect_equal_loss", spec.expect_equal_loss, "losses"),
        ("expect_equal_gradients", spec.expect_equal_gradients, "gradients"),
    ):
        if check is not None and simulated:
            raise ConfigError(
                key,
                vars(check),
                f"the variants {simulated} are simulated ranks (simulate), whose "
                f"{what} are no model's; drop {key}, or the simulation",
            )


def _refused(view: RunConfig) -> str | None:
    """Why ``fit`` would refuse this resolved config on any machine (``preflight.check_config``,
    ``check_simulation``), or None."""
    try:
        check_config(view)
        check_simulation("fit", view)
    except ConfigError as err:
        return f"config refused: {err}"
    return None


def _resolve(resolve: Resolver, path: Path) -> dict[str, Any] | str:
    """The resolved config, or why it does not resolve (the parser's own message, from its stderr)."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            resolved = resolve(["--config", str(path)])
    except argparse.ArgumentError as err:  # jsonargparse's, from the CLI's parser: the CLI says it in one line
        from lit_ablate.parse_errors import concise_error

        return f"config does not resolve: {concise_error(str(err))}"
    except RESOLVE_ERRORS as err:
        return f"config does not resolve: {type(err).__name__}: {err}"
    if isinstance(resolved, dict):
        return resolved
    detail = " ".join(line.strip() for line in errors.getvalue().strip().splitlines()[-3:])
    return f"config does not resolve: {detail or 'the fit parser rejected it'}"


def write_config(path: Path, config: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_text(config))


def config_text(config: dict[str, Any]) -> str:
    """The YAML a run's ``config.yaml`` holds; also how resume tells whether a run's config changed."""
    return yaml.safe_dump(config, sort_keys=False)


def describe(runs: Sequence[PlannedRun], kept: Mapping[str, str] | None = None) -> str:
    """The plan as a table, one row per run (``--dry-run``): its ranks (devices x nodes) and
    accelerator, what it changes from the base config, and what will happen to it: ``run``,
    ``skip: why`` (a compatibility rule), ``fails: why`` (its config does not resolve) or ``done``
    (``kept``: label -> status of a finished record that a resume keeps)."""
    kept = kept or {}
    rows = [("run", "ranks", "device", "changes from the base config", "plan")]
    for run in runs:
        launch = run.launch
        ranks = f"{launch.devices or 'base'}" + (f"x{launch.num_nodes}" if (launch.num_nodes or 1) > 1 else "")
        if launch.simulate:  # one process playing one rank of a larger job
            ranks = f"rank {launch.simulate_rank or 0} of {launch.simulate} (simulated)"
        overrides = ", ".join(
            f"{k}={_short(v)}" for k, v in {**run.variant.overrides, **run.variant.launch_overrides}.items()
        )
        state = (
            f"skip: {run.skip_reason}"
            if run.skip_reason
            else f"fails: {run.invalid}"
            if run.invalid
            else f"done ({kept[run.label]}, kept)"
            if run.label in kept
            else "run"
        )
        rows.append((run.label, ranks, launch.accelerator or "base", overrides or "(base config)", state))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows)


def _short(value: Any, limit: int = 60) -> str:
    """An override's value in one short line (a class_path mapping by its class name)."""
    if isinstance(value, Mapping) and isinstance(value.get("class_path"), str):
        text = value["class_path"].rsplit(".", 1)[-1] + ("(...)" if value.get("init_args") else "")
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
