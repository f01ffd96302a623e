"""From a study spec to the list of runs: resolve, check one variable, judge each run.

Every variant's config is resolved once, exactly as ``lit-ablate fit`` would resolve it (the CLI's
``resolve_fit_config``); each run gets that resolved config with its seed and folder. The resolved configs
are diffed (the single-variable check), and each is judged by the rules (``lit_ablate.rules``) of the config
and of where it runs: this machine, or the nodes a SLURM study's cluster declares. A variant a rule finds a
mistake in, or whose config does not resolve, is planned as a failed run carrying the message (``--dry-run``
shows it as ``fails:``), and ``lit-ablate ablate`` refuses the study before the first run starts; a variant
whose parts cannot run (together, or there) is planned as skipped.
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

from lit_ablate.ablation.agreements import check_within_steps
from lit_ablate.ablation.launch import Launch
from lit_ablate.ablation.single_variable import check_single_variable
from lit_ablate.ablation.spec import RUNNER_KEYS, StudySpec, Variant
from lit_ablate.config_keys import with_overrides
from lit_ablate.errors import ConfigError
from lit_ablate.rules import Scope, first_refusal
from lit_ablate.run_config import RunConfig

Resolver = Callable[[list[str]], dict[str, Any]]
"""``(fit args) -> resolved config``: what ``lit-ablate fit <args>`` would run, without running it."""
Constructor = Callable[[list[str]], None]
"""``(fit args) -> None``: make the classes ``lit-ablate fit <args>`` makes (``ConfigError`` for a refused value)."""
RESOLVE_ERRORS = (ValueError, TypeError, KeyError, argparse.ArgumentError, SystemExit)
"""What a resolver raises for a config it rejects (jsonargparse exits unless built not to)."""


@dataclass(frozen=True)
class PlannedRun:
    """One variant × seed: where it runs, the config it gets, and whether it can run.

    ``config`` is the run's ``fit`` config, resolved by the planner (as the study merges it where it does
    not resolve) and read once as ``view``; ``launch`` holds what only the runner reads (the time limit,
    the executor and its SLURM settings). ``skip_reason`` (its parts cannot run, together or where it goes)
    and ``invalid`` (the config does not resolve, or has a mistake) are mutually exclusive; a run with
    neither is launched.
    """

    variant: Variant
    seed: int
    run_dir: Path
    config: dict[str, Any]
    view: RunConfig
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


def default_constructor() -> Constructor:
    """The CLI's constructor of a config's classes (imported late, as the resolver)."""
    from lit_ablate.fit_cli import construct_fit_parts

    return construct_fit_parts


def run_dir(output_dir: Path, variant: Variant, seed: int) -> Path:
    return output_dir / "runs" / variant.name / f"seed{seed}"


def trainer_root(directory: Path) -> Path:
    """The run's ``trainer.default_root_dir``: beside, not over, the runner's own files. A planned run's
    config (its ``config.yaml``) holds it relative to the study folder, so that the folder can move; the
    runner gives the fit the absolute path (``run_folder.fit_arguments``)."""
    return directory / "trainer"


def plan_study(
    spec: StudySpec, output_dir: Path, resolve: Resolver | None = None, construct: Constructor | None = None
) -> list[PlannedRun]:
    """All runs of the study in the order they run (``spec.order``: round-robin over variants by
    default); raises ``ConfigError`` on a second variable. A variant every rule passes has its classes
    made here (``construct``; by default with the default resolver) when it runs on this machine, so a
    value only a constructor refuses (a negative ``seq_len``) refuses the study before its first run, as it
    refuses ``fit``; a SLURM job's start-up makes them on its node."""
    if resolve is None:
        resolve, construct = default_resolver(), construct or default_constructor()
    output_dir = output_dir.resolve()
    resolved: dict[str, dict[str, Any]] = {}
    invalid: dict[str, str] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lit-ablate-plan-") as tmp:
        paths = {variant.name: Path(tmp) / f"{variant.name}.yaml" for variant in spec.variants}
        for variant in spec.variants:
            seed = spec.seeds[0]
            write_config(
                paths[variant.name], spec.fit_config(variant, seed, trainer_root(run_dir(output_dir, variant, seed)))
            )
            outcome = _resolve(resolve, paths[variant.name])
            if isinstance(outcome, str):
                invalid[variant.name] = outcome
            else:
                resolved[variant.name] = outcome
        check_single_variable(resolved, spec.variables, ignored=RUNNER_KEYS)
        views = {name: RunConfig.of(config) for name, config in resolved.items()}  # each variant's, read once
        check_losses_are_a_model_s(spec, views)
        if spec.steps is None:  # the runs train the steps their base config sets
            for view in views.values():
                steps = view.trainer.max_steps
                for check in (spec.expect_equal_loss, spec.expect_equal_gradients):
                    if check is not None and isinstance(steps, int) and steps > 0:
                        check_within_steps(check, steps)
        for variant in spec.variants:
            if variant.name not in views:
                continue
            view, launch = RunConfig.of(views[variant.name], executor=variant.launch.executor), variant.launch
            mistake = first_refusal(_where(view, launch), *_scopes(launch), skips_variant=False)
            skip = None if mistake else first_refusal(_where(view, launch), *_scopes(launch), skips_variant=True)
            if not mistake and not skip and construct is not None and launch.executor == "local":
                mistake = _constructed(construct, paths[variant.name])  # a job's start-up makes them on its node
            if mistake:
                invalid[variant.name] = f"config refused: {mistake}"
            elif skip:
                skipped[variant.name] = skip
    runs = []
    pairs = [(v, s) for s in spec.seeds for v in spec.variants]
    if spec.order == "by_variant":
        pairs = [(v, s) for v in spec.variants for s in spec.seeds]
    for variant, seed in pairs:
        directory = run_dir(output_dir, variant, seed)
        root = trainer_root(directory).relative_to(output_dir)  # the study folder can move
        if variant.name in resolved:  # the variant's resolved config, with this run's seed and folder
            config = with_overrides(resolved[variant.name], spec.runner_overrides(seed, root))
        else:
            config = spec.fit_config(variant, seed, root)
        view = RunConfig.of(config, executor=variant.launch.executor)
        skip, mistake = skipped.get(variant.name), invalid.get(variant.name)
        runs.append(PlannedRun(variant, seed, directory, config, view, variant.launch, skip, mistake))
    return runs


def _scopes(launch: Launch) -> tuple[Scope, ...]:
    """What a run is judged by: the config, and this machine or (``executor: slurm``) its cluster's nodes,
    never the login node planning it."""
    return (Scope.CONFIG, Scope.MACHINE if launch.executor == "local" else Scope.CLUSTER)


def _where(view: RunConfig, launch: Launch) -> RunConfig:
    """The run's view as judged where it goes: on a SLURM cluster, accelerator ``auto`` means GPU nodes when
    the partition has GPUs (``launch.slurm.gpus_per_node``), else CPU nodes."""
    if launch.executor == "local" or view.trainer.accelerator_name != "auto":
        return view
    nodes = "gpu" if launch.slurm and launch.slurm.gpus_per_node else "cpu"
    return replace(view, trainer=replace(view.trainer, accelerator=nodes))


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


def _constructed(construct: Constructor, path: Path) -> str | None:
    """Why a constructor refuses a value of the config at ``path``, or None once every class is made."""
    try:
        construct(["--config", str(path)])
    except ConfigError as err:
        return str(err)
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


def describe(
    runs: Sequence[PlannedRun], kept: Mapping[str, str] | None = None, resumes: Mapping[str, str] | None = None
) -> str:
    """The plan as a table, one row per run (``--dry-run``): its ranks (devices x nodes) and
    accelerator, what it changes from the base config, and what will happen to it: ``run``,
    ``skip: why`` (its parts cannot run, together or there), ``fails: why`` (its config does not resolve,
    or a rule finds a mistake in it), ``done`` (``kept``: label -> status of a finished record that a
    resume keeps) or ``resume from`` (``resumes``: label -> the checkpoint an unfinished run continues from)."""
    kept, resumes = kept or {}, resumes or {}
    rows = [("run", "ranks", "device", "changes from the base config", "plan")]
    for run in runs:
        trainer, simulation = run.view.trainer, run.view.simulation
        ranks = f"{trainer.devices_per_node or 'auto'}" + (f"x{trainer.nodes}" if trainer.nodes > 1 else "")
        if simulation is not None:  # one process playing one rank of a larger job
            ranks = f"rank {simulation.rank} of {simulation.world_size} (simulated)"
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
            else f"resume from {resumes[run.label]}"
            if run.label in resumes
            else "run"
        )
        rows.append((run.label, ranks, trainer.accelerator_name, overrides or "(base config)", state))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows)


def _short(value: Any, limit: int = 60) -> str:
    """An override's value in one short line (a class_path mapping by its class name)."""
    if isinstance(value, Mapping) and isinstance(value.get("class_path"), str):
        text = value["class_path"].rsplit(".", 1)[-1] + ("(...)" if value.get("init_args") else "")
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
