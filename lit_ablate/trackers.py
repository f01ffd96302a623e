"""Experiment trackers: a run's record sent where researchers already look (TensorBoard, W&B, MLflow).

The run record is the source of truth; a tracker gets a copy of it, through the tracker's own library,
once the figures are final: every per-step series (loss, processed and useful tokens/s, step time, MFU
both ways, memory), the resolved config, the environment and the summary, and, for a study's run, the
report's verdicts (speed with its interval, memory ×, the loss and gradient checks). ``lit-ablate fit``
sends its run when it ends; under ``lit-ablate ablate`` the study's runner sends every run once the report
is written, grouped by study (a W&B group and project, an MLflow experiment, a TensorBoard folder), named
``<variant> seed<k>`` and tagged with the values of the keys the study varies.

Offline and local by default, never waiting on a network: W&B writes an offline run (``wandb sync``
uploads it later) unless ``WANDB_MODE`` or ``WANDB_API_KEY`` says otherwise; MLflow writes a local file
store (``mlruns/``) unless ``MLFLOW_TRACKING_URI`` names a server. The file store is in maintenance
mode in MLflow 3 and refused unless ``MLFLOW_ALLOW_FILE_STORE=true``, which is set for it here: a local
SQLite store would need the full ``mlflow`` package (about 600 MB more than ``mlflow-skinny``, which the
``trackers`` extra installs), and the file store is what ``mlflow ui --backend-store-uri`` reads.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lit_ablate.errors import ConfigError
from lit_ablate.extras import require

MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""Each tracker and the package (import name) its library comes in."""
EXTRA = "trackers"
TRACKERS_BY_RUNNER_ENV = "LIT_ABLATE_TRACKERS_BY_RUNNER"
"""Set by a study's runner: its runs leave the trackers to it, which sends them with the report's verdicts."""
MLFLOW_VALUE_CHARS = 6000
"""MLflow refuses a parameter value longer than this."""


def check_trackers(names: Sequence[str], key: str) -> tuple[str, ...]:
    """``names`` as a tuple, refused in one line (the key, the value, the fix) when one is unknown or its
    package is not installed."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(key, names, f"give a list of trackers, e.g. [{', '.join(MODULES)}]")
    for name in names:
        if name not in MODULES:
            raise ConfigError(key, names, f"{name!r} is no tracker here; give any of {list(MODULES)}")
        require(MODULES[name], key, list(names), f"the {name} tracker", EXTRA)
    return tuple(names)


@dataclass(frozen=True)
class Destination:
    """Where a record goes in every tracker: its group (a study), its name, its tags, and the folder
    holding the offline stores (``tensorboard/``, ``wandb/``, ``mlruns/``)."""

    group: str
    name: str
    folder: Path
    tags: dict[str, str] = field(default_factory=dict)


def send(
    names: Sequence[str], record: Mapping[str, Any], to: Destination, verdicts: Mapping[str, str] | None = None
) -> None:
    """Send ``record`` (and a study's ``verdicts``, words keyed by check) to each tracker in ``names``."""
    series = _series(record.get("steps") or [])
    summary = {**_numbers(record.get("summary") or {}), **{f"verdict/{k}": v for k, v in (verdicts or {}).items()}}
    about = {"config": record.get("config") or {}, "environment": record.get("environment") or {}}
    for name in names:
        SENDERS[name](series, summary, about, to)


def _series(steps: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Every per-step number of the record, by name: ``[(step, value), ...]``."""
    series: dict[str, list[tuple[int, float]]] = {}
    for step in steps:
        for name, value in step.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if name != "step" and number and math.isfinite(value):
                series.setdefault(name, []).append((int(step["step"]), float(value)))
    return series


def _numbers(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The summary flattened: each median (``tokens_per_sec``), each number, and the status words."""
    flat: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and "median" in value:
            flat[name] = value["median"]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            flat[name] = value
        elif key in ("status", "message") and value is not None:
            flat[name] = str(value)
    return flat


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys and their values as text (what a tracker's parameters hold)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_config(value, name + "."))
        else:
            flat[name] = json.dumps(value) if not isinstance(value, str) else value
    return flat


def _tensorboard(series: Mapping, summary: Mapping, about: Mapping, to: Destination) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(to.folder / "tensorboard" / to.group / to.name.replace(" ", "_")))
    for name, points in series.items():
        for step, value in points:
            writer.add_scalar(name, value, step)
    writer.add_text("summary", _markdown_table({**to.tags, **summary}))
    writer.add_text("config", _markdown_table(flat_config(about["config"])))
    writer.add_text("environment", _markdown_table(flat_config(about["environment"])))
    writer.close()


def _markdown_table(values: Mapping[str, Any]) -> str:
    return "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in values.items())


def _wandb(series: Mapping, summary: Mapping, about: Mapping, to: Destination) -> None:
    import wandb

    online = os.environ.get("WANDB_MODE") == "online" or bool(os.environ.get("WANDB_API_KEY"))
    folder = to.folder / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT") or to.group,
        group=to.group,
        name=to.name,
        dir=str(folder),
        mode=os.environ.get("WANDB_MODE") or ("online" if online else "offline"),
        config={**about["config"], "environment": about["environment"], **to.tags},
        tags=[f"{k}={v}"[:64] for k, v in to.tags.items()],
        settings=wandb.Settings(silent=True, console="off"),
        reinit="create_new",
    )
    for step in sorted({s for points in series.values() for s, _ in points}):
        run.log({name: value for name, points in series.items() for s, value in points if s == step}, step=step)
    run.summary.update(dict(summary))
    run.finish()


def _mlflow(series: Mapping, summary: Mapping, about: Mapping, to: Destination) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    uri = os.environ.get("MLFLOW_TRACKING_URI") or (to.folder / "mlruns").resolve().as_uri()
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # see the module docstring: the local store
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(to.group)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(to.group)
    run = client.create_run(experiment_id, run_name=to.name, tags=dict(to.tags))
    now = int(time.time() * 1000)
    metrics = [Metric(name, value, now, step) for name, points in series.items() for step, value in points]
    metrics += [Metric(f"summary/{k}", float(v), now, 0) for k, v in summary.items() if isinstance(v, (int, float))]
    params = [Param(k, v[:MLFLOW_VALUE_CHARS]) for k, v in flat_config(about["config"]).items()]
    tags = [RunTag(k, str(v)) for k, v in summary.items() if not isinstance(v, (int, float))]
    tags += [RunTag(f"environment.{k}", v[:MLFLOW_VALUE_CHARS]) for k, v in flat_config(about["environment"]).items()]
    for start in range(0, len(metrics), 1000):  # MLflow's limits per batch: 1000 metrics, 100 params, 100 tags
        client.log_batch(run.info.run_id, metrics=metrics[start : start + 1000])
    for start in range(0, max(len(params), len(tags)), 100):
        client.log_batch(run.info.run_id, params=params[start : start + 100], tags=tags[start : start + 100])
    client.set_terminated(run.info.run_id)


SENDERS: dict[str, Callable[[Mapping, Mapping, Mapping, Destination], None]] = {
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "mlflow": _mlflow,
}
