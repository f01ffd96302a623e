"""The numbers of a study report, computed from run records alone (plus the study plan).

Per variant: throughput, step time and MFU (against the spec peak and the measured matmul
ceiling) as median [min, max] over every measured step of every successful seed (steps after
warm-up), and the step time the estimator predicts at the measured ceiling; the tensor peak
(with its categories, and the estimator's categories against them), the process peak, final loss and
an evaluation's accuracy (``exact_match``, when the runs had an ``ExactMatchEvaluator``) as median
[min, max] over seeds; the ratio of each to the baseline variant, the speed ratio from paired blocks
with its interval and verdict (``speed_verdict``); and, where the study expects it, whether the loss
series matches the reference's. A study-level ``problems`` list says what makes the study's
result untrustworthy as a whole (no variant finished ok; a loss check failed or could not be made),
and ``lit-ablate ablate``/``report`` exit non-zero on it. Everything here is plain data:
``report.json`` is this dict, and the Markdown table and plots are drawn from it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from lit_ablate.ablation.gradient_agreement import gradient_check
from lit_ablate.ablation.loss_divergence import loss_delta_by_step
from lit_ablate.ablation.speed_verdict import SpeedDesign, judge_speed, min_pairs
from lit_ablate.record import FINAL_VALUE_SERIES, SUMMARISED_SERIES, spread
from lit_ablate.run_config import RunConfig

ENVIRONMENT_KEYS = (
    "device_name",
    "device_type",
    "python",
    "torch",
    "lightning",
    "transformers",
    "git_commit",
    "hostname",
    "triton_kernels",
)
"""Environment fields that must agree for records to be comparable (world size may vary by design)."""
RANK_KEYS = ("trainer.devices", "trainer.num_nodes", "trainer")
"""A study variable among these varies its runs' ranks by design (their speeds are then compared across them)."""


def study_summary(plan: Mapping[str, Any] | None, runs: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The report's data: ``runs`` are ``(path relative to the study dir, record)`` pairs."""
    plan = dict(plan or {})
    by_variant: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for path, record in runs:
        by_variant.setdefault(str(record.get("variant") or path.split("/")[1]), []).append((path, record))
    planned = [v["name"] for v in plan.get("variants", [])]
    names = planned + sorted(n for n in by_variant if n not in planned)  # a planned variant never run is a row too
    baseline = plan.get("baseline") or (names[0] if names else None)  # never silently another variant
    axis_values = {v["name"]: v.get("axis_values", {}) for v in plan.get("variants", [])}
    variants = [_variant(n, by_variant.get(n, []), plan.get("warmup_steps"), axis_values.get(n, {})) for n in names]
    base = next((v for v in variants if v["name"] == baseline), None)
    agreement, gradients = plan.get("expect_equal_loss"), plan.get("expect_equal_gradients")
    design = SpeedDesign(**(plan.get("speed") or {}))
    launches = {v["name"]: _ranks_asked(v.get("launch") or {}) for v in plan.get("variants", [])}
    ranks_vary = any(key in RANK_KEYS for key in plan.get("variables", []))
    for variant in variants:
        variant["speed"] = (
            judge_speed(
                _ok(by_variant.get(variant["name"], [])),
                _ok(by_variant.get(baseline, [])),
                design,
                same_ranks=not ranks_vary and launches.get(variant["name"]) == launches.get(baseline),
            )
            if variant is not base
            else None
        )
        variant.update(_relative_to(variant, base))
        variant["loss_delta_by_step"] = loss_delta_by_step(variant, base)
        reference = _loss_reference(variant, base, variants, agreement)
        variant["loss_reference"] = reference["name"] if reference else None
        checked = agreement and reference is not variant
        if checked and variant["name"] in (agreement.get("approximate") or ()):
            variant["loss_agreement"] = {"passed": None, "incomplete": False, "reason": APPROXIMATE}
        else:
            variant["loss_agreement"] = _loss_check(variant, reference, agreement) if checked else None
        if gradients and variant is not base and variant["name"] in (gradients.get("approximate") or ()):
            variant["gradient_agreement"] = {"passed": None, "incomplete": False, "reason": APPROXIMATE}
        else:
            variant["gradient_agreement"] = (
                gradient_check(by_variant.get(variant["name"], []), by_variant.get(baseline, []), gradients)
                if gradients and variant is not base
                else None
            )
    environment, mismatched = _environment([r for _, r in runs], by_variant.get(baseline, []))
    return {
        "study": {
            k: plan.get(k)
            for k in (
                "name",
                "baseline",
                "variables",
                "axes",
                "seeds",
                "steps",
                "warmup_steps",
                "expect_equal_loss",
                "expect_equal_gradients",
                "order",
            )
        }
        | {"baseline": baseline},
        "environment": environment,
        "environment_mismatch": mismatched,
        "matmul_ceilings": _ceilings_by_condition([r for _, r in runs if r.get("summary", {}).get("status") == "ok"]),
        "speed": _speed_measurement(design, _ok(runs)),
        "variants": variants,
        "problems": _problems(variants),
    }


def _variant(
    name: str, runs: Sequence[tuple[str, Mapping[str, Any]]], warmup: int | None, axis_values: Mapping[str, Any]
) -> dict[str, Any]:
    runs = sorted(runs, key=lambda pr: (pr[1].get("seed") is None, pr[1].get("seed") or 0, pr[0]))
    ok = [r for _, r in runs if r["summary"].get("status") == "ok"]
    measured = [s for r in ok for s in r.get("steps", []) if s["step"] > _warmup(r, warmup)]
    counts = [r.get("model") or {} for r in ok]
    parameters = sorted({c["total"] for c in counts if c.get("total") is not None})
    trainable = sorted({c["trainable"] for c in counts if c.get("trainable") is not None})
    methods = sorted({r["summary"]["memory_method"] for r in ok if r["summary"].get("memory_method")})
    breakdowns = [r["summary"]["tensor_breakdown"] for r in ok if r["summary"].get("tensor_breakdown")]
    return {
        "name": name,
        "axis_values": dict(axis_values),
        "status": _status([r["summary"].get("status") for _, r in runs]),
        **{key: spread(s.get(series) for s in measured) for series, key in SUMMARISED_SERIES.items()},
        "data_wait_share": spread(r["summary"].get("data_wait_share") for r in ok),
        "peak_tensor_bytes": spread(r["summary"].get("peak_tensor_bytes") for r in ok),
        "tensor_method": ", ".join(
            sorted({r["summary"]["tensor_method"] for r in ok if r["summary"].get("tensor_method")})
        )
        or None,
        "tensor_breakdown": _median_breakdown(breakdowns),
        "peak_memory_bytes": spread(r["summary"].get("peak_memory_bytes") for r in ok),
        "memory_method": ", ".join(methods) or None,
        "final_loss": spread(r["summary"].get("final_loss") for r in ok),
        "fp8": ", ".join(sorted({r["environment"]["fp8"] for r in ok if (r.get("environment") or {}).get("fp8")}))
        or None,
        "fallbacks": sorted({line for r in ok for line in r.get("fallbacks") or []}),
        "simulated": next((r["simulated"] for r in ok if r.get("simulated")), None),  # the rank one process played
        **{key: spread(r["summary"].get(key) for r in ok) for key in FINAL_VALUE_SERIES.values()},  # exact_match
        **_estimate(
            next((r for _, r in runs if r.get("config")), None),
            breakdowns,
            _tracked_tokens(next((r for r in ok if r["summary"].get("tensor_breakdown")), None)),
        ),
        **_predicted_step_time(next((r for r in ok if r.get("config")), None)),
        "parameters": parameters[0] if len(parameters) == 1 else None,
        "trainable_parameters": trainable[0] if len(trainable) == 1 else None,
        "loss_curve": _loss_curve([r for _, r in runs if r.get("steps")]),
        "runs": [
            {
                "seed": r.get("seed"),
                "path": path,
                "status": r["summary"].get("status"),
                "message": r["summary"].get("message"),
                "stderr_tail": r["summary"].get("stderr_tail"),
                "loss": _loss_by_step(r.get("steps", [])),
            }
            for path, r in runs
        ],
    }


def _tracked_tokens(record: Mapping[str, Any] | None) -> float | None:
    """Tokens one rank processed per micro-batch in the step whose tensors were tracked (the first ok
    seed's), or None when unknown."""
    if record is None:
        return None
    tracked = record["summary"]["tensor_breakdown"].get("step")
    step = next((s for s in record.get("steps", []) if s.get("step") == tracked), None)
    if not step or not step.get("tokens_per_sec_per_device") or not step.get("step_time_s"):
        return None
    accumulate = RunConfig.of(record.get("config") or {}).trainer.accumulation
    return step["tokens_per_sec_per_device"] * step["step_time_s"] / accumulate


def _token_share(config: RunConfig, world_size: int | None, tracked_tokens: float | None) -> float | None:
    """The tracked step's tokens over the ``micro_batch x seq_len`` the estimate counts, where they are
    comparable: one process's tokens are its own under data parallelism alone (tp, cp and pp ranks
    count shares of a batch)."""
    from lit_ablate.estimate.from_config import training_shape_of

    training = training_shape_of(config, world_size=world_size)
    split = training.tensor_parallel * training.context_parallel * training.pipeline_parallel
    if tracked_tokens is None or split > 1:
        return None
    return tracked_tokens / (training.micro_batch * training.seq_len)


def _estimate(
    record: Mapping[str, Any] | None, breakdowns: Sequence[Mapping[str, Any]] = (), tracked_tokens: float | None = None
) -> dict[str, Any]:
    """The analytic per-rank memory of the run's config (``lit_ablate.estimate``), or why there is
    none: its total, its categories, and each category against the measured one (first ok seed; the
    activations an upper bound when that seed's tracked step held fewer tokens than the config's rows:
    ``compare_with_measured``'s ``token_share``)."""
    from lit_ablate.errors import ConfigError
    from lit_ablate.estimate.agreement import compare_with_measured
    from lit_ablate.estimate.from_config import estimate_for_config

    none = {"estimated_memory_bytes": None, "estimated_memory_categories": None, "estimate_vs_measured": None}
    if record is None:
        return {**none, "estimate_note": "no run config recorded"}
    world_size = (record.get("environment") or {}).get("world_size")
    simulated = (record.get("simulated") or {}).get("rank")  # a simulated rank measured itself: its own estimate
    try:
        run = RunConfig.of(record["config"])  # the run's config, read once
        estimate = estimate_for_config(run, world_size, simulated)
        share = _token_share(run, world_size, tracked_tokens)
    except ConfigError as err:
        return {**none, "estimate_note": str(err)}
    except Exception as err:  # an advisory column must never cost the report
        return {**none, "estimate_note": f"estimate failed: {type(err).__name__}: {err}"}
    categories = {k: getattr(estimate, k) for k in ("params", "grads", "optimizer", "activations", "transient")}
    return {
        "estimated_memory_bytes": estimate.total,
        "estimated_memory_categories": categories,
        "estimate_vs_measured": compare_with_measured(estimate, breakdowns[0], share) if breakdowns else None,
        "estimate_note": None,
    }


def _predicted_step_time(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """The estimator's step time at the run's measured matmul ceiling (``predicted_step_seconds``,
    first ok seed), or why there is none: set beside the measured step time, the gap is what is
    not matmul at the ceiling (communication, memory-bound kernels, overhead)."""
    from lit_ablate.errors import ConfigError
    from lit_ablate.estimate.from_config import predicted_step_seconds

    ceilings = (record or {}).get("summary", {}).get("mfu_ceilings") or {}
    ceiling = (ceilings.get("mfu_measured") or {}).get("tflops")
    if record is None or not ceiling:
        return {"predicted_step_time_s": None, "predicted_note": "no measured matmul ceiling recorded (MFUMonitor)"}
    world_size = (record.get("environment") or {}).get("world_size")
    try:
        return {
            "predicted_step_time_s": predicted_step_seconds(dict(record["config"]), ceiling, world_size),
            "predicted_note": None,
        }
    except ConfigError as err:
        return {"predicted_step_time_s": None, "predicted_note": str(err)}
    except Exception as err:  # an advisory column must never cost the report
        return {"predicted_step_time_s": None, "predicted_note": f"prediction failed: {type(err).__name__}: {err}"}


def _median_breakdown(breakdowns: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The measured categories over seeds: the median of each number (``at_peak``, ``max``,
    ``forward_backward_max``); None when no run tracked its tensors."""
    if not breakdowns:
        return None
    median = {
        kind: {c: statistics.median(b[kind].get(c, 0) for b in breakdowns) for c in breakdowns[0][kind]}
        for kind in ("at_peak", "max")
    }
    return {**median, "forward_backward_max": statistics.median(b["forward_backward_max"] for b in breakdowns)}


def _loss_by_step(steps: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """The loss series with index ``i`` holding step ``i + 1`` (None where a step has no loss)."""
    by_step = {int(s["step"]): s.get("loss") for s in steps}
    return [by_step.get(step) for step in range(1, max(by_step, default=0) + 1)]


def _warmup(record: Mapping[str, Any], study_warmup: int | None) -> int:
    return study_warmup if study_warmup is not None else int(record.get("warmup_steps") or 0)


def _status(statuses: Sequence[str | None]) -> str:
    """``ok`` when every seed is ok, the one status they share, else counts such as ``ok 2/3, oom 1``;
    ``not run`` for a planned variant without a record (an interrupted study)."""
    if not statuses:
        return "not run"
    statuses = [s or "missing" for s in statuses]
    if len(set(statuses)) == 1:
        return statuses[0]
    counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    return ", ".join(f"{s} {n}/{len(statuses)}" for s, n in counts.items())


def _loss_curve(records: Sequence[Mapping[str, Any]]) -> dict[str, list[float | None]]:
    """Loss per step: median and range over the seeds that reached that step."""
    per_step: dict[int, list[float]] = {}
    for record in records:
        for step in record["steps"]:
            if step.get("loss") is not None and math.isfinite(step["loss"]):
                per_step.setdefault(int(step["step"]), []).append(float(step["loss"]))
    steps = sorted(per_step)
    return {
        "step": steps,
        "median": [statistics.median(per_step[s]) for s in steps],
        "min": [min(per_step[s]) for s in steps],
        "max": [max(per_step[s]) for s in steps],
    }


def _median(stats: Mapping[str, float] | None) -> float | None:
    return stats["median"] if stats else None


def _relative_to(variant: Mapping[str, Any], base: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Final-loss difference and speed / memory ratios to the baseline (None where either lacks it)."""

    def ratio(key: str) -> float | None:
        mine, theirs = _median(variant[key]), _median(base[key]) if base else None
        return mine / theirs if mine is not None and theirs else None

    loss, base_loss = _median(variant["final_loss"]), _median(base["final_loss"]) if base else None
    speed = variant.get("speed")
    return {
        "loss_delta": loss - base_loss if loss is not None and base_loss is not None else None,
        "speed_ratio": (1.0 if variant is base and base is not None else None) if speed is None else speed["ratio"],
        "memory_ratio": ratio("peak_tensor_bytes") if variant.get("peak_tensor_bytes") else None,
        "process_memory_ratio": ratio("peak_memory_bytes"),
    }


def _ranks_asked(launch: Mapping[str, Any]) -> tuple[Any, ...]:
    """The ranks a variant's ``launch`` asks for (None: its config's)."""
    return tuple(launch.get(key) for key in ("devices", "num_nodes", "simulate"))


def _ok(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    return [record for _, record in runs if record.get("summary", {}).get("status") == "ok"]


def _speed_measurement(design: SpeedDesign, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How the study's speed was measured: the design asked for, the one the runs had, and the load
    other processes put on the machine during their blocks."""
    sections = [record.get("speed_blocks") or {} for record in records]
    loads = [b["foreign_cores"] for s in sections for b in s.get("blocks", []) if b.get("foreign_cores") is not None]
    return {
        "design": asdict(design),
        "interleave": sorted({s.get("design", "runs") for s in sections}),
        "needed_pairs": min_pairs(design.confidence),
        "blocks": sum(len(s.get("blocks", [])) or 1 for s in sections),
        "foreign_cores": spread(loads),
    }


def _loss_reference(
    variant: dict[str, Any],
    base: dict[str, Any] | None,
    variants: Sequence[dict[str, Any]],
    agreement: Mapping[str, Any] | None,
) -> dict[str, Any] | None:
    """The variant whose loss ``variant``'s must equal: the baseline, or (``across``) the variant
    that differs only in that axis and holds the baseline's value of it."""
    if not agreement or base is None:
        return None
    across = agreement.get("across")
    if not across:
        return base
    wanted = {**variant["axis_values"], across: base["axis_values"].get(across)}
    return next((v for v in variants if v["axis_values"] == wanted), None)


APPROXIMATE = "approximate by design (listed under approximate): shown, not checked"


def _loss_check(
    variant: Mapping[str, Any], reference: Mapping[str, Any] | None, tolerance: Mapping[str, Any]
) -> dict[str, Any]:
    """``expect_equal_loss`` for one variant: pass, fail, or ``incomplete`` (never a silent pass).

    A variant without an ok seed is not checked (``passed: None``; its row already says why).
    A variant with an ok seed whose reference has no ok run of that seed (or no reference
    variant at all) is ``incomplete``: the check it promised was not made, a study problem.
    """
    mine = {r["seed"] for r in variant["runs"] if r["status"] == "ok"}
    if not mine:
        return {"passed": None, "incomplete": False, "reason": "this variant has no ok run"}
    if reference is None:
        return {"passed": None, "incomplete": True, "reason": "no variant holds its reference's values"}
    missing = sorted(mine - {r["seed"] for r in reference["runs"] if r["status"] == "ok"}, key=_seed_order)
    result = _loss_agreement(variant, reference, tolerance)
    if missing and result["passed"] is not False:
        seeds = ", ".join(str(s) for s in missing)
        return {
            **result,
            "passed": None,
            "incomplete": True,
            "reason": f"reference {reference['name']} has no ok run of seed {seeds}",
        }
    return {**result, "incomplete": False}


def _loss_agreement(
    variant: Mapping[str, Any], base: Mapping[str, Any], tolerance: Mapping[str, Any]
) -> dict[str, Any]:
    """Seed by seed, step by step: ``|loss - base| <= atol + rtol * |base|`` over the first ``steps``."""
    rtol, atol, limit = tolerance["rtol"], tolerance["atol"], tolerance.get("steps")
    base_curves = {r["seed"]: r["loss"] for r in base["runs"] if r["status"] == "ok"}
    mine = {r["seed"]: r["loss"] for r in variant["runs"] if r["status"] == "ok"}
    seeds = sorted(set(base_curves) & set(mine), key=_seed_order)
    if not seeds:
        return {"passed": None, "reason": "no seed finished ok in both this variant and its reference"}
    worst = {"max_abs_diff": 0.0, "worst_step": None, "worst_seed": None}
    for seed in seeds:
        a, b = mine[seed], base_curves[seed]
        n = limit or max(len(a), len(b))
        if len(a) < n or len(b) < n:
            return {"passed": False, "reason": f"seed {seed}: fewer than {n} steps to compare ({len(a)} vs {len(b)})"}
        for step, (x, y) in enumerate(zip(a[:n], b[:n]), start=1):
            if x is None or y is None:
                return {"passed": False, "reason": f"seed {seed}, step {step}: no loss"}
            diff = abs(x - y)
            if diff > worst["max_abs_diff"]:
                worst = {"max_abs_diff": diff, "worst_step": step, "worst_seed": seed}
            if diff > atol + rtol * abs(y):
                return {"passed": False, "reason": f"seed {seed}, step {step}: {x:.6g} vs {y:.6g}", **worst}
    return {"passed": True, "reason": None, "compared_seeds": seeds, **worst}


def _seed_order(seed: int | None) -> tuple[bool, int]:
    return seed is None, seed or 0


def _ceilings_by_condition(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The matmul ceilings (TFLOP/s) the runs measured at their start, spread per condition (dtype,
    device, threads: ``MatmulCeiling.conditions``; None for records that predate it). Only ceilings of
    one condition can show a load change: a rank of a 2-rank run on 2 cores has one thread and half a
    1-rank run's ceiling. Runs without MFUMonitor, or with a given ceiling, have none."""
    by_condition: dict[str | None, list[float]] = {}
    for record in records:
        ceiling = ((record.get("summary") or {}).get("mfu_ceilings") or {}).get("mfu_measured") or {}
        if ceiling.get("measured_at") is not None and ceiling.get("tflops") is not None:
            by_condition.setdefault(ceiling.get("conditions"), []).append(ceiling["tflops"])
    return [{"conditions": c, **spread(v)} for c, v in sorted(by_condition.items(), key=lambda cv: str(cv[0]))]


def _problems(variants: Sequence[Mapping[str, Any]]) -> list[str]:
    """What makes the study's result untrustworthy as a whole, one line each (empty: none)."""
    problems = []
    if not any(r["status"] == "ok" for v in variants for r in v["runs"]):
        problems.append("no variant finished ok: nothing was measured")
    for v in variants:
        for what, key in (("loss", "loss_agreement"), ("gradient", "gradient_agreement")):
            check = v.get(key) or {}
            if check.get("passed") is False:
                problems.append(f"{what} check failed: {v['name']}: {check['reason']}")
            elif check.get("incomplete"):
                problems.append(f"{what} check incomplete: {v['name']}: {check['reason']}")
    return problems


def _environment(
    records: Sequence[Mapping[str, Any]], baseline_runs: Sequence[tuple[str, Mapping[str, Any]]]
) -> tuple[dict[str, Any], list[str]]:
    """The baseline's environment (first record that has one) and the keys on which records disagree."""
    environments = [r.get("environment") or {} for r in records if r.get("environment")]
    preferred = [r.get("environment") for _, r in baseline_runs if r.get("environment")]
    shown = dict((preferred or environments or [{}])[0])
    mismatched = [k for k in ENVIRONMENT_KEYS if len({repr(e.get(k)) for e in environments}) > 1]
    return shown, mismatched
