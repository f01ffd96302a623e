"""A study's runs in the experiment trackers their config names (``recorder.trackers``), with the verdicts.

A study's ``lit-ablate fit`` processes leave the trackers to the runner (``TRACKERS_BY_RUNNER_ENV``):
only after the report exists are a run's verdicts known. Once every planned run has finished, each run
goes to its trackers as ``<variant> seed<k>``, grouped by the study and tagged with the variant, the seed
and the values of the keys its variant sets, its summary carrying the report's verdicts in words. A
study's ``trackers.json`` remembers what was sent, so a rerun or a resume sends nothing twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lit_ablate.ablation.report import load_runs
from lit_ablate.ablation.speed_verdict import speed_words
from lit_ablate.record import is_finished
from lit_ablate.trackers import Destination, send

SENT_FILENAME = "trackers.json"


def trackers_of(config: Mapping[str, Any]) -> list[str]:
    """The trackers a run config names (``recorder.trackers``)."""
    return list((config.get("recorder") or {}).get("trackers") or [])


def send_study(directory: Path) -> list[str]:
    """Send every finished run of the study in ``directory`` that names trackers and was not sent yet;
    nothing until every planned run has finished. Returns the runs sent (their paths)."""
    plan, runs = load_runs(directory)
    report = json.loads((directory / "report.json").read_text())
    planned = len(report["variants"]) * len((plan or {}).get("seeds") or [0])
    if len(runs) < planned or not all(is_finished(record) or _skipped(record) for _, record in runs):
        return []
    sent_path = directory / SENT_FILENAME
    sent = json.loads(sent_path.read_text()) if sent_path.is_file() else {}
    variants = {v["name"]: v for v in report["variants"]}
    variables = report["study"].get("variables") or []
    done = []
    for path, record in runs:
        names = trackers_of(record.get("config") or {})
        if not names or path in sent:
            continue
        variant = record.get("variant") or path.split("/")[1]
        tags = {"study": report["study"]["name"] or directory.name, "variant": variant, "seed": str(record["seed"])}
        tags |= {key: _text(_value_at(record.get("config") or {}, key)) for key in variables}
        to = Destination(group=tags["study"], name=f"{variant} seed{record['seed']}", folder=directory, tags=tags)
        send(names, record, to, verdicts(variants[variant], report["study"]["baseline"]))
        sent[path] = names
        done.append(path)
        sent_path.write_text(json.dumps(sent, indent=1) + "\n")
    return done


def _value_at(config: Mapping[str, Any], dotted: str) -> Any:
    """The value of a dotted key (or the section under a key prefix) in a nested config, or None."""
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _text(value: Any, limit: int = 250) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _skipped(record: Mapping[str, Any]) -> bool:
    return record.get("summary", {}).get("status") == "skipped"


def verdicts(variant: Mapping[str, Any], baseline: str) -> dict[str, str]:
    """The report's verdicts on one variant, in words: its status, speed (ratio, interval, verdict), memory
    ×, and the loss and gradient checks where the study made them."""
    words = {"status": variant["status"]}
    if variant["name"] == baseline:
        return {**words, "speed": "baseline"}
    words["speed"] = speed_words(variant.get("speed"))
    if variant.get("memory_ratio") is not None:
        words["memory"] = f"{variant['memory_ratio']:.2f}×"
    for check, key in (("loss", "loss_agreement"), ("gradients", "gradient_agreement")):
        result = variant.get(key)
        if result:
            state = "pass" if result.get("passed") else "FAIL" if result.get("passed") is False else "not made"
            words[check] = state + (f": {result['reason']}" if result.get("reason") else "")
    return words
