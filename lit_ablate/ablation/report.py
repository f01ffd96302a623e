"""The study report: ``report.md``, ``report.json`` and PNG plots, made from the records alone.

It reads ``<dir>/study.json`` (the plan the runner wrote: baseline, axes, warm-up, tolerance)
and every ``<dir>/runs/<variant>/seed<k>/run.json``; nothing else. So ``lit-ablate report DIR``
re-renders the same files at any time, on any machine, and a study interrupted half-way still
gets a report of what finished.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_ablate.ablation.loss_divergence import loss_divergence_section
from lit_ablate.ablation.plots import write_plots
from lit_ablate.ablation.speed_verdict import INCONCLUSIVE
from lit_ablate.ablation.summary import study_summary
from lit_ablate.ablation.terminal_summary import verdict
from lit_ablate.record import RECORD_FILENAME, read_record

PLAN_FILENAME = "study.json"
ORDER_WORDS = {
    "round_robin": "round-robin (the first seed of every variant, then the second seed of every variant, ...)",
    "by_variant": "variant by variant (every seed of a variant, then the next variant)",
}
STDERR_TAIL_SHOWN = 15
ACCURACY_LEGEND = (
    " Exact match: the share of held-out prompts whose greedy answer was entirely right after the "
    "last step (`ExactMatchEvaluator`), median [min–max] over seeds."
)
TRAINABLE_LEGEND = (
    " Trainable params: the parameters the optimizer updates (an adapter run's adapters; its frozen "
    "base is not counted), from the run record's model counts."
)
PREFERENCE_LEGEND = (
    " Reward accuracy / margin (DPO, `PreferenceMonitor`): the share of the last step's pairs whose "
    "chosen response earns the higher implicit reward, and their mean reward margin, median over seeds."
)
PIPELINE_LEGEND = (
    " Pipeline idle: the share of the schedule's wall time the stages spent not computing their own "
    "chunks (`PipelineBubbleMonitor`, mean over stages, median [min–max] over steps), and in brackets "
    "the schedule's own bubble with equal stages and free communication, (pp - 1) / (m + pp - 1)."
)


def load_runs(directory: Path) -> tuple[dict[str, Any] | None, list[tuple[str, dict[str, Any]]]]:
    """The study plan (None when absent) and ``(relative path, record)`` of every run in ``directory``."""
    plan_path = directory / PLAN_FILENAME
    try:
        plan = json.loads(plan_path.read_text()) if plan_path.is_file() else None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{plan_path}: not valid JSON ({err.msg}); run lit-ablate ablate on the study again, which rewrites it"
        ) from err
    planned = {v["name"] for v in plan["variants"]} if plan else None
    runs = []
    for path in sorted(directory.glob(f"runs/*/*/{RECORD_FILENAME}")):
        try:
            record = read_record(path)
        except ValueError as err:
            raise ValueError(f"{err}; run lit-ablate ablate on the study again, which redoes that run") from err
        if planned is None or (record.get("variant") or path.parent.parent.name) in planned:
            runs.append((path.relative_to(directory).as_posix(), record))
    return plan, runs


def write_report(directory: str | Path) -> Path:
    """Write ``report.md``, ``report.json`` and the plots into ``directory``; returns the Markdown path."""
    directory = Path(directory)
    plan, runs = load_runs(directory)
    if not runs:
        raise FileNotFoundError(f"{directory}: no run records under runs/<variant>/<seed>/{RECORD_FILENAME}")
    summary = study_summary(plan, runs)
    summary["plots"] = write_plots(summary, directory)
    (directory / "report.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    path = directory / "report.md"
    path.write_text(render_markdown(summary))
    return path


def render_markdown(summary: Mapping[str, Any]) -> str:
    """The report page: header, environment, the side-by-side table, loss check, plots, failures."""
    study, variants = summary["study"], summary["variants"]
    lines = [f"# Study `{study.get('name') or 'runs'}`", "", _environment_line(summary), ""]
    details = [f"baseline **{study['baseline']}**"]
    if study.get("variables"):
        details.append("variable " + ", ".join(f"`{k}`" for k in study["variables"]))
    if study.get("seeds"):
        details.append(f"seeds {study['seeds']}")
    if study.get("steps"):
        details.append(f"{study['steps']} steps")
    if study.get("warmup_steps") is not None:
        details.append(f"warm-up steps excluded: {study['warmup_steps']}")
    if study.get("order"):
        details.append(f"run order: {ORDER_WORDS.get(study['order'], study['order'])}")
    lines += ["; ".join(details) + ".", ""]
    if speed_line := _speed_design_line(summary.get("speed")):
        lines += [speed_line, ""]
    if ceiling_line := _ceiling_line(summary):
        lines += [ceiling_line, ""]
    if summary.get("problems"):
        lines += ["**Study problems (exit code 1):**", "", *(f"- {p}" for p in summary["problems"]), ""]
    lines += ["## Verdicts", "", *(f"- **{v['name']}**: {verdict(v, study['baseline'])}" for v in variants), ""]
    agreement = study.get("expect_equal_loss")
    header = [
        "variant",
        "status",
        "tokens/s",
        "useful tokens/s",
        "step time (s)",
        "predicted step (s)",
        "data wait",
        "MFU (spec)",
        "MFU (measured)",
        "peak tensor memory",
        "process peak",
        "est. memory",
        "est. ÷ measured",
        "final loss",
        "Δ loss",
        "speed ×",
        "memory ×",
    ]
    adapters = any(v.get("trainable_parameters") not in (None, v["parameters"]) for v in variants)  # a frozen base
    header += ["trainable params"] if adapters else []
    accuracy = any(v["exact_match"] for v in variants)  # a column only when some run was evaluated
    header += ["exact match"] if accuracy else []
    preference = any(v.get("reward_accuracy") for v in variants)  # DPO runs
    header += ["reward accuracy", "reward margin"] if preference else []
    pipeline = any(v.get("pipeline_idle_share") for v in variants)  # pipeline-parallel runs
    header += ["pipeline idle (schedule's)"] if pipeline else []
    header += [f"loss = {_reference_word(agreement)}"] if agreement else []
    gradients = study.get("expect_equal_gradients")
    header += ["gradients = baseline"] if gradients else []
    fallbacks = sorted({line for v in variants for line in v.get("fallbacks") or []})  # numbered notes below
    header += ["fallbacks"] if fallbacks else []
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v in variants:
        row = [
            f"**{v['name']}**" if v["name"] == study["baseline"] else v["name"],
            _status_cell(v),
            _spread(v["tokens_per_sec"], _rate),
            _spread(v["useful_tokens_per_sec"], _rate),
            _spread(v["step_time_s"], lambda x: f"{x:.3g}"),
            _predicted_cell(v),
            _spread(v.get("data_wait_share"), lambda x: f"{100 * x:.1f}%"),
            _mfu_cell(v, "mfu"),
            _mfu_cell(v, "mfu_measured"),
            _spread(v.get("peak_tensor_bytes"), _bytes),
            _memory_cell(v),
            "—" if v["estimated_memory_bytes"] is None else _bytes(v["estimated_memory_bytes"]),
            _estimate_check_cell(v.get("estimate_vs_measured")),
            _spread(v["final_loss"], lambda x: f"{x:.4f}"),
            _delta(v["loss_delta"]),
            _speed_cell(v, study["baseline"]),
            _memory_ratio_cell(v),
        ]
        if adapters:
            row.append("—" if v.get("trainable_parameters") is None else _rate(v["trainable_parameters"]))
        if accuracy:
            row.append(_spread(v["exact_match"], lambda x: f"{100 * x:.1f}%"))
        if preference:
            row += [
                _spread(v.get("reward_accuracy"), lambda x: f"{100 * x:.1f}%"),
                _spread(v.get("reward_margin"), lambda x: f"{x:.3g}"),
            ]
        if pipeline:
            row.append(_pipeline_cell(v))
        if agreement:
            row.append(_agreement_cell(v, study["baseline"]))
        if gradients:
            row.append(_gradient_cell(v, study["baseline"]))
        if fallbacks:
            row.append(", ".join(f"[{fallbacks.index(line) + 1}]" for line in v.get("fallbacks") or []) or "—")
        lines.append("| " + " | ".join(row) + " |")
    rss_only = any(v.get("memory_ratio") is None and v.get("process_memory_ratio") is not None for v in variants)
    lines += [
        "",
        _legend(agreement, rss_only, gradients)
        + (TRAINABLE_LEGEND if adapters else "")
        + (ACCURACY_LEGEND if accuracy else "")
        + (PREFERENCE_LEGEND if preference else "")
        + (PIPELINE_LEGEND if pipeline else ""),
        "",
    ]
    if fallbacks:  # what ran instead of what a row's config names (the run records' ``fallbacks``)
        lines += [
            "Fallbacks: what ran instead of what the row's config names, as its runs recorded.",
            "",
            *(f"{i}. {line}" for i, line in enumerate(fallbacks, start=1)),
            "",
        ]
    lines += simulated_ranks_section(variants)
    lines += [f"![{Path(name).stem}]({name})" for name in summary.get("plots", [])]
    lines += loss_divergence_section(summary)
    failures = [(v["name"], r) for v in variants for r in v["runs"] if r["status"] != "ok"]
    if failures:
        lines += ["", "## Runs that did not finish ok", ""]
        for name, run in failures:
            lines.append(
                f"- `{name}` seed {run['seed']}: **{run['status']}** — {run['message'] or 'no message'} "
                f"(`{run['path']}`)"
            )
            tail = (run.get("stderr_tail") or "").splitlines()[-STDERR_TAIL_SHOWN:]
            if tail and run["status"] != "skipped":
                lines += ["", "  ```text", *(f"  {line}" for line in tail), "  ```"]
    return "\n".join(lines).rstrip() + "\n"


SIMULATED_CATEGORIES = ("params", "grads", "optimizer", "activations", "transient")


def simulated_ranks_section(variants: Sequence[Mapping[str, Any]]) -> list[str]:
    """For variants whose runs were simulated ranks (``launch.simulate``): each category the rank held beside
    the estimate of that rank, by the rule the table's est. ÷ measured column applies, and its step time and
    MFU (no collective waits for another rank). Nothing for a study without them."""
    simulated = [v for v in variants if v.get("simulated")]
    if not simulated:
        return []
    lines = [
        "## Simulated ranks: estimate beside measurement",
        "",
        "Each row is one process that played one rank of the layout over a fake process group "
        "(lit-ablate's `docs/simulation.md`): its tensors by category on the tracked step "
        "(measured) beside the estimate of that rank (`lit-ablate estimate`; a pipeline rank's own stage), "
        f"as estimated / measured (estimate ÷ measured), **bold** where outside its factor ({_factors()}). "
        "Step time and MFU are the rank's own: its compute, and the local copies a fake collective makes (an "
        "all-gather fills its output with the rank's shard), never a wait for another rank.",
        "",
        "| variant | rank | " + " | ".join(SIMULATED_CATEGORIES) + " | step time (s) | MFU (measured) |",
        "|" + "---|" * (len(SIMULATED_CATEGORIES) + 4),
    ]
    for v in simulated:
        comparison = v.get("estimate_vs_measured") or {}
        cells = []
        for category in SIMULATED_CATEGORIES:
            result = comparison.get(category)
            text = (
                "—"
                if result is None
                else f"{_bytes(result['estimated'])} / {_bytes(result['measured'])} ({_ratio(result)})"
            )
            cells.append(text if result is None or result["agrees"] else f"**{text}**")
        rank = f"{v['simulated']['rank']} of {v['simulated']['world_size']}"
        lines.append(
            f"| {v['name']} | {rank} | "
            + " | ".join(cells)
            + f" | {_spread(v['step_time_s'], lambda x: f'{x:.3g}')} | {_mfu_cell(v, 'mfu_measured')} |"
        )
    return [*lines, ""]


def _pipeline_cell(variant: Mapping[str, Any]) -> str:
    """The measured idle share of the pipeline's steps, with the schedule's own bubble beside it."""
    if not variant.get("pipeline_idle_share"):
        return "—"
    theory = variant.get("pipeline_bubble_theory")
    own = f" ({100 * theory['median']:.0f}%)" if theory else ""
    return _spread(variant["pipeline_idle_share"], lambda x: f"{100 * x:.0f}%") + own


CEILING_REPEATABILITY = 0.10
"""How far ceilings measured under one condition spread on a quiet machine: the sweep's own noise
(measured on the 2-core VM: 2.5% over 6 one-process runs; up to 6.4% over the one-thread ranks of
2- and 4-rank runs, whose sweeps share the cores); a move within this is no evidence that the load changed."""


def _ceiling_line(summary: Mapping[str, Any]) -> str | None:
    """The matmul ceilings the runs measured at their start (``mfu_measured``'s denominators), their spread
    per condition (dtype, device, threads: only ceilings of one condition are comparable), and a warning
    when one condition's moved more than ``CEILING_REPEATABILITY``: the machine's load changed during the
    study (the speed verdicts judge load per block on their own)."""
    groups = summary.get("matmul_ceilings")
    if not groups:
        return None
    floor = CEILING_REPEATABILITY
    parts, moved_conditions = [], []
    for group in groups:
        moved = (group["max"] - group["min"]) / group["median"]
        condition = group["conditions"] or "condition not recorded"
        parts.append(
            f"{condition}: {_spread(group, lambda x: f'{x:.4g}')} TFLOP/s over {group['n']} runs "
            f"(moved {100 * moved:.1f}%)"
        )
        if moved > floor:
            moved_conditions.append(condition)
    line = "Matmul ceiling measured at each run's start, by condition: " + "; ".join(parts) + "."
    if moved_conditions:
        line += (
            f" **Warning: under {', '.join(moved_conditions)} it moved more than {100 * floor:.0f}%: "
            "the machine's load changed during the study, so MFU (measured) compares runs under different "
            "loads.**"
        )
    return line


def _environment_line(summary: Mapping[str, Any]) -> str:
    env = summary["environment"]
    if not env:
        return "Environment: not recorded."
    parts = [f"device {env.get('device_name')} ({env.get('device_type')})"]
    parts += [f"{k} {env[k]}" for k in ("torch", "lightning", "transformers", "python") if env.get(k)]
    parts.append(f"commit {str(env['git_commit'])[:10]}" if env.get("git_commit") else "commit unknown")
    from lit_ablate.callbacks.run_recorder import git_commit  # imports Lightning: only when a report is written

    rendered = git_commit()
    if rendered and env.get("git_commit") and rendered != env["git_commit"]:  # the runs' numbers, a later renderer
        parts.append(f"report rendered at commit {rendered[:10]}")
    if env.get("hostname"):
        parts.append(f"host {env['hostname']}")
    if env.get("triton_kernels"):
        parts.append(f"Triton kernels {env['triton_kernels']}")
    line = "Environment: " + ", ".join(parts) + "."
    if summary["environment_mismatch"]:
        line += f" **Warning: runs differ in {', '.join(summary['environment_mismatch'])}; compare with care.**"
    return line


def _status_cell(variant: Mapping[str, Any]) -> str:
    if variant["status"] == "ok":
        return "ok"
    messages = sorted({r["message"] for r in variant["runs"] if r["status"] != "ok" and r["message"]})
    text = variant["status"] + (f": {messages[0]}" if messages else "")
    return _cell(text[:120] + ("…" if len(text) > 120 else ""))


def _mfu_cell(variant: Mapping[str, Any], key: str) -> str:
    if variant.get(key):
        return _spread(variant[key], lambda x: f"{100 * x:.1f}%")
    return "n/a" if variant["status"] == "ok" else "—"


def _predicted_cell(variant: Mapping[str, Any]) -> str:
    """The estimator's step time at the measured ceiling, and the measured median as a multiple of it."""
    predicted, measured = variant.get("predicted_step_time_s"), variant["step_time_s"]
    if predicted is None:
        return "—"
    return f"{predicted:.3g}" + (f" (measured ×{measured['median'] / predicted:.2f})" if measured else "")


def _memory_cell(variant: Mapping[str, Any]) -> str:
    stats = variant["peak_memory_bytes"]
    if not stats:
        return "—"
    return _spread(stats, _bytes) + (f" ({variant['memory_method']})" if variant["memory_method"] else "")


def _estimate_check_cell(comparison: Mapping[str, Any] | None) -> str:
    """The estimator's categories that disagree with the measured ones beyond their factor."""
    if not comparison:
        return "—"
    off = [f"{c} {_ratio(r)}" for c, r in comparison.items() if not r["agrees"]]
    bounds = [
        f"{c} {_ratio(r)}: upper bound, the tracked step held {100 * r['upper_bound']:.0f}% of its tokens"
        for c, r in comparison.items()
        if r.get("upper_bound")
    ]
    return "; ".join(off + bounds) if off else "; ".join(["agrees", *bounds])


def _ratio(result: Mapping[str, Any]) -> str:
    """Estimated over measured; where either is 0 a ratio says nothing (``×0.00``), so both sizes."""
    if result["ratio"] is None or result["estimated"] == 0:
        return f"est. {_bytes(result['estimated'])} vs {_bytes(result['measured'])} measured"
    return f"×{result['ratio']:.2f}"


def _speed_cell(variant: Mapping[str, Any], baseline: str) -> str:
    """The ratio with its interval and verdict (``speed_verdict``); the baseline's is 1 by definition."""
    if variant["name"] == baseline:
        return "1.00× (baseline)" if variant["status"] == "ok" else "—"
    speed = variant.get("speed")
    if not speed or speed.get("ratio") is None:
        return "—" if variant["status"] != "ok" else _cell(f"inconclusive: {speed['reason']}" if speed else "—")
    interval = f" [{speed['low']:.2f}–{speed['high']:.2f}]" if speed.get("low") is not None else ""
    words = speed["verdict"] if speed["verdict"] != INCONCLUSIVE else f"inconclusive: {speed['reason']}"
    return _cell(f"{speed['ratio']:.2f}×{interval} {words}")


def _speed_design_line(speed: Mapping[str, Any] | None) -> str | None:
    """How speed was measured and judged: the design, the interval, the threshold and the load seen."""
    if not speed:
        return None
    design = speed["design"]
    how = {
        "steps": f"the variants of each seed took turns, {design['rounds']} blocks of steps each",
        "runs": "one block per run, paired by seed",
    }
    modes = "; ".join(how.get(mode, mode) for mode in speed["interleave"])
    load = speed.get("foreign_cores")
    seen = (
        f"other processes' load during the blocks: {_spread(load, lambda x: f'{x:.2f}')} cores"
        if load
        else "other processes' load not measured"
    )
    return (
        f"Speed: {modes}; each ratio is the median of the paired blocks' ratios with its "
        f"{design['confidence']:.0%} sign-test interval (a verdict needs {speed['needed_pairs']} pairs; pairs whose "
        f"load differed by more than {design['load_tolerance']:g} cores are left out); within "
        f"±{design['threshold']:.0%} is no difference; {seen}."
    )


def _reference_word(agreement: Mapping[str, Any]) -> str:
    return "reference" if agreement.get("across") else "baseline"


def _agreement_cell(variant: Mapping[str, Any], baseline: str) -> str:
    reference, result = variant.get("loss_reference"), variant["loss_agreement"]
    if reference == variant["name"]:
        return "(reference)"
    if result and result.get("incomplete"):
        return _cell(f"**INCOMPLETE** ({result['reason']})")
    if not result or result["passed"] is None:
        return "n/a" + (f": {result['reason']}" if result else "")
    against = "" if reference == baseline else f" vs {reference}"
    diff = f"max abs diff {result['max_abs_diff']:.2e}" if result.get("max_abs_diff") is not None else ""
    return f"pass{against}, " + diff if result["passed"] else _cell(f"**FAIL**{against} ({result['reason']}; {diff})")


def _gradient_cell(variant: Mapping[str, Any], baseline: str) -> str:
    """``expect_equal_gradients``' verdict: pass with the largest relative difference, FAIL with where, or why
    there is none."""
    if variant["name"] == baseline:
        return "(baseline)"
    result = variant.get("gradient_agreement")
    if result and result.get("incomplete"):
        return _cell(f"**INCOMPLETE** ({result['reason']})")
    if not result or result["passed"] is None:
        return "n/a" + (f": {result['reason']}" if result else "")
    return (
        f"pass, max rel diff {result['max_rel_diff']:.2e}"
        if result["passed"]
        else _cell(f"**FAIL** ({result['reason']})")
    )


def _memory_ratio_cell(variant: Mapping[str, Any]) -> str:
    """Peak tensor memory over the baseline's; a row without a tensor peak on either side says so and
    shows the process peaks' ratio as what it is, never in its place."""
    if variant.get("memory_ratio") is not None:
        return f"{variant['memory_ratio']:.2f}×"
    process = variant.get("process_memory_ratio")
    return "—" if process is None else f"n/a (RSS only: {process:.2f}×)"


def _legend(
    agreement: Mapping[str, Any] | None, rss_only: bool = False, gradients: Mapping[str, Any] | None = None
) -> str:
    text = (
        "tokens/s and step time: median [min–max] over every step after warm-up of every seed that "
        "finished ok; tokens/s count all ranks, useful tokens are labels that count in the loss. Step time "
        "runs from one optimizer step's end to the next; data wait: the share of it spent between "
        "micro-batches (fetching, collating and moving batches), median [min–max] over seeds. "
        "Peak tensor memory: the most tensor bytes one rank held (the largest rank), median [min–max] over "
        "seeds: on CPU counted by `MemoryMonitor`'s tensor tracker on the last warm-up step(s), on CUDA the "
        "allocator's peak allocated bytes; memory.png shows it, memory_categories.png its categories. Process "
        "peak: the secondary measure, with its method (on CPU the process's resident set, ~0.5 GB of Python "
        "runtime included, so it hides what a technique changes). Est. memory: the analytic per-rank model of "
        "`lit-ablate estimate` for the run's config; est. ÷ measured: its categories that differ from the "
        f"measured ones by more than their stated factor ({_factors()}), or *agrees*; an *upper bound* is an "
        "activations estimate for rows of seq_len above the measured step's, whose rows were shorter (padded to "
        "the batch's longest, or packed): scaled to the step's tokens it is within the factor. Final loss: "
        "median over seeds. Speed ×: useful tokens/s over the baseline's; memory ×: peak tensor memory over the "
        "baseline's"
        + (
            "; *n/a (RSS only: r×)*: this run or the baseline has no tensor peak, and r is the "
            "ratio of process peaks (resident sets), which hide most of what a technique changes"
            if rss_only
            else ""
        )
        + "; speed × is the median over paired blocks of the variant's useful tokens/s over the baseline's in "
        "the same round, with its interval in brackets and its verdict: *faster* or *slower* (the interval "
        "excludes 1 and the ratio is beyond the threshold), *no difference detected* (the interval lies "
        "within the threshold), or *inconclusive* (too few pairs, or an interval too wide to tell). "
        "MFU (spec): model FLOPs/s over the device's spec-sheet peak (n/a: none is known for this device "
        "or precision); MFU (measured): over the matmul ceiling measured on the run's device, dtype and "
        "threads (`lit-ablate peak`). Predicted step: the run config's model FLOPs per rank and step at that "
        "ceiling (`lit-ablate estimate`'s model; padded or packed data compute less, so an upper bound for "
        "them), with the measured step time as a multiple of it: the excess is communication, "
        "memory-bound work and overhead."
    )
    if agreement:
        steps = f"the first {agreement['steps']} steps" if agreement.get("steps") else "every step"
        word = _reference_word(agreement)
        text += f" Loss = {word}: per seed, over {steps}, |loss − {word}| ≤ {_bound(agreement, word)}."
        if agreement.get("across"):
            text += (
                f" The reference of a variant differs from it only in `{agreement['across']}`, "
                "holding the baseline's value."
            )
    if gradients:
        text += (
            f" Gradients = baseline: per seed, at step {gradients['step']}, every parameter's gradient norm "
            "after the step's rescaling to its token mean and before clipping, one per expert for stacked "
            "expert weights (`GradientFingerprint`): |norm − baseline's| ≤ "
            f"{gradients['rtol']:g}·(the tensor's largest norm in the baseline); max rel diff: the largest "
            "such ratio."
        )
    return text


def _bound(agreement: Mapping[str, Any], word: str) -> str:
    """``atol + rtol·|word|``, without the term that is zero."""
    atol, rtol = agreement["atol"], agreement["rtol"]
    relative = f"{rtol:g}·|{word}|"
    if rtol == 0:
        return f"{atol:g}"
    return relative if atol == 0 else f"{atol:g} + {relative}"


def _factors() -> str:
    from lit_ablate.estimate.agreement import AGREEMENT_FACTORS

    return ", ".join(f"{c} ×{f:g}" for c, f in AGREEMENT_FACTORS.items())


def _spread(stats: Mapping[str, float] | None, fmt) -> str:
    if not stats:
        return "—"
    if stats["n"] == 1 or stats["min"] == stats["max"]:
        return fmt(stats["median"])
    return f"{fmt(stats['median'])} [{fmt(stats['min'])}–{fmt(stats['max'])}]"


def _delta(x: float | None) -> str:
    """A loss difference: 4 decimals, or scientific when it is smaller than that shows."""
    if x is None:
        return "—"
    return f"{x:+.4f}" if x == 0 or abs(x) >= 5e-5 else f"{x:+.1e}"


def _rate(x: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{suffix}"
    return f"{x:.4g}"


def _bytes(x: float) -> str:
    """Three significant digits, in whole units from 1000 of one up to 1024 (never ``1e+03 MiB``)."""
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= scale:
            value = x / scale
            return f"{value:.0f} {suffix}" if abs(value) >= 999.5 else f"{value:.3g} {suffix}"
    return f"{x:.0f} B"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no pipes, no line breaks)."""
    return text.replace("|", "\\|").replace("\n", " ")
