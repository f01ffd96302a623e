"""The study report's table: one row per variant, one ``Column`` per measurement, each with its legend.

Both renderings draw it from the same columns: ``report.md`` (a Markdown table, the legend below it as
one line per column) and ``report.html`` (a sortable table, each column's legend folded under its
header). A column appears only when some variant has its measurement (an adapter's trainable
parameters, an evaluation, a loss check the study asked for).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lit_ablate.ablation.speed_verdict import INCONCLUSIVE

Variant = Mapping[str, Any]


@dataclass(frozen=True)
class Column:
    """A column of the table: its header, its cell (Markdown text), what it means, and how to sort by it."""

    header: str
    cell: Callable[[Variant], str]
    legend: str
    sort_key: Callable[[Variant], float | None] | None = None


def _median(key: str) -> Callable[[Variant], float | None]:
    return lambda v: (v.get(key) or {}).get("median")


def table_columns(summary: Mapping[str, Any]) -> list[Column]:
    """The table's columns for this study, in order."""
    study, variants = summary["study"], summary["variants"]
    baseline = study["baseline"]
    rss_only = any(v.get("memory_ratio") is None and v.get("process_memory_ratio") is not None for v in variants)
    columns = [
        Column(
            "variant",
            lambda v: f"**{v['name']}**" if v["name"] == baseline else v["name"],
            "the baseline in bold; every ratio and difference is to it",
        ),
        Column(
            "status",
            status_cell,
            "`ok`, `error`, `oom`, `timeout`, `skipped: <why>` (it cannot run here), "
            "`not run`; with seeds that differ, their counts",
        ),
        Column(
            "tokens/s",
            lambda v: format_spread(v["tokens_per_sec"], format_rate),
            "median [min–max] over every step after warm-up of every seed that finished ok; all ranks",
            _median("tokens_per_sec"),
        ),
        Column(
            "useful tokens/s",
            lambda v: format_spread(v["useful_tokens_per_sec"], format_rate),
            "as tokens/s, counting only labels that count in the loss (no padding)",
            _median("useful_tokens_per_sec"),
        ),
        Column(
            "step time (s)",
            lambda v: format_spread(v["step_time_s"], lambda x: f"{x:.3g}"),
            "from one optimizer step's end to the next (waits for a study's turn and validation left out)",
            _median("step_time_s"),
        ),
        Column(
            "predicted step (s)",
            predicted_cell,
            "the run config's model FLOPs per rank and step at the measured matmul ceiling (`lit-ablate "
            "estimate`'s model; padded or packed data compute less, so an upper bound for them), with the "
            "measured step time as a multiple of it: the excess is communication, memory-bound work and "
            "overhead",
            lambda v: v.get("predicted_step_time_s"),
        ),
        Column(
            "data wait",
            lambda v: format_spread(v.get("data_wait_share"), lambda x: f"{100 * x:.1f}%"),
            "the share of step time spent between micro-batches (fetching, collating and moving batches), "
            "median [min–max] over seeds",
            _median("data_wait_share"),
        ),
        Column(
            "MFU (spec)",
            lambda v: mfu_cell(v, "mfu"),
            "model FLOPs/s over the device's spec-sheet peak (n/a: none is known for this device or precision)",
            _median("mfu"),
        ),
        Column(
            "MFU (measured)",
            lambda v: mfu_cell(v, "mfu_measured"),
            "over the matmul ceiling measured on the run's device, dtype and threads (`lit-ablate peak`); an "
            "MFU above 1 is a measurement error and never shown",
            _median("mfu_measured"),
        ),
        Column(
            "peak tensor memory",
            lambda v: format_spread(v.get("peak_tensor_bytes"), format_bytes),
            "the most tensor bytes one rank held (the largest rank), median [min–max] over seeds: on CPU "
            "counted by `MemoryMonitor`'s tensor tracker on the last warm-up step(s), on CUDA the allocator's "
            "peak allocated bytes",
            _median("peak_tensor_bytes"),
        ),
        Column(
            "process peak",
            memory_cell,
            "the secondary measure, with its method (on CPU the process's resident set, ~0.5 GB of Python "
            "runtime included, so it hides what a technique changes)",
            _median("peak_memory_bytes"),
        ),
        Column(
            "est. memory",
            lambda v: "—" if v["estimated_memory_bytes"] is None else format_bytes(v["estimated_memory_bytes"]),
            "the analytic per-rank model of `lit-ablate estimate` for the run's config",
            lambda v: v.get("estimated_memory_bytes"),
        ),
        Column(
            "est. ÷ measured",
            lambda v: estimate_check_cell(v.get("estimate_vs_measured")),
            f"the estimate's categories that differ from the measured ones by more than their stated factor "
            f"({agreement_factors()}), or *agrees*; an *upper bound* is an activations estimate for rows of "
            "seq_len above the measured step's, whose rows were shorter (padded to the batch's longest, or "
            "packed): scaled to the step's tokens it is within the factor",
        ),
        Column(
            "final loss",
            lambda v: format_spread(v["final_loss"], lambda x: f"{x:.4f}"),
            "median over seeds",
            _median("final_loss"),
        ),
        Column(
            "Δ loss",
            lambda v: format_delta(v["loss_delta"]),
            "final loss minus the baseline's",
            lambda v: v.get("loss_delta"),
        ),
        Column(
            "speed ×",
            lambda v: speed_cell(v, baseline),
            "the median over paired blocks of the variant's useful tokens/s over the baseline's in the same "
            "round, with its interval in brackets and its verdict: *faster* or *slower* (the interval "
            "excludes 1 and the ratio is beyond the threshold), *no difference detected* (the interval lies "
            "within the threshold), or *inconclusive* (too few pairs, or an interval too wide to tell)",
            lambda v: v.get("speed_ratio"),
        ),
        Column(
            "memory ×",
            memory_ratio_cell,
            "peak tensor memory over the baseline's"
            + (
                "; *n/a (RSS only: r×)*: this run or the baseline has no tensor peak, and r is the ratio of process "
                "peaks (resident sets), which hide most of what a technique changes"
                if rss_only
                else ""
            ),
            lambda v: v.get("memory_ratio"),
        ),
    ]
    return columns + _optional_columns(summary)


def _optional_columns(summary: Mapping[str, Any]) -> list[Column]:
    """The columns only some studies have: adapters, evaluations, DPO, pipelines, the checks, fallbacks."""
    study, variants = summary["study"], summary["variants"]
    baseline, columns = study["baseline"], []
    if any(v.get("trainable_parameters") not in (None, v["parameters"]) for v in variants):  # a frozen base
        columns.append(
            Column(
                "trainable params",
                lambda v: "—" if v.get("trainable_parameters") is None else format_rate(v["trainable_parameters"]),
                "the parameters the optimizer updates (an adapter run's adapters; its frozen base is not counted), "
                "from the run record's model counts",
                lambda v: v.get("trainable_parameters"),
            )
        )
    if any(v["exact_match"] for v in variants):
        columns.append(
            Column(
                "exact match",
                lambda v: format_spread(v["exact_match"], lambda x: f"{100 * x:.1f}%"),
                "the share of held-out prompts whose greedy answer was entirely right after the last step "
                "(`ExactMatchEvaluator`), median [min–max] over seeds",
                _median("exact_match"),
            )
        )
    if any(v.get("reward_accuracy") for v in variants):  # DPO runs
        columns.append(
            Column(
                "reward accuracy",
                lambda v: format_spread(v.get("reward_accuracy"), lambda x: f"{100 * x:.1f}%"),
                "(DPO, `PreferenceMonitor`) the share of the last step's pairs whose chosen response earns the higher "
                "implicit reward, median over seeds",
                _median("reward_accuracy"),
            )
        )
        columns.append(
            Column(
                "reward margin",
                lambda v: format_spread(v.get("reward_margin"), lambda x: f"{x:.3g}"),
                "their mean reward margin, median over seeds",
                _median("reward_margin"),
            )
        )
    if any(v.get("pipeline_idle_share") for v in variants):
        columns.append(
            Column(
                "pipeline idle (schedule's)",
                pipeline_cell,
                "the share of the schedule's wall time the stages spent not computing their own chunks "
                "(`PipelineBubbleMonitor`, mean over stages, median [min–max] over steps), and in brackets the "
                "schedule's own bubble with equal stages and free communication, (pp - 1) / (m + pp - 1)",
                _median("pipeline_idle_share"),
            )
        )
    agreement = study.get("expect_equal_loss")
    if agreement:
        columns.append(
            Column(
                f"loss = {reference_word(agreement)}",
                lambda v: agreement_cell(v, baseline),
                loss_check_legend(agreement),
            )
        )
    gradients = study.get("expect_equal_gradients")
    if gradients:
        columns.append(
            Column(
                "gradients = baseline",
                lambda v: gradient_cell(v, baseline),
                f"per seed, at step {gradients['step']}, every parameter's gradient norm after the "
                "step's rescaling to its token mean and before clipping, one per expert for stacked "
                "expert weights (`GradientFingerprint`): |norm − baseline's| ≤ "
                f"{gradients['rtol']:g}·(the tensor's largest norm in the baseline); max rel diff: "
                "the largest such ratio",
            )
        )
    fallbacks = numbered_fallbacks(summary)
    if fallbacks:
        columns.append(
            Column(
                "fallbacks",
                lambda v: ", ".join(f"[{fallbacks.index(line) + 1}]" for line in v.get("fallbacks") or []) or "—",
                "what ran instead of what the row's config names, as its runs recorded (the numbered notes)",
            )
        )
    return columns


def numbered_fallbacks(summary: Mapping[str, Any]) -> list[str]:
    """Every fallback any variant's runs recorded, in the order the fallbacks column numbers them."""
    return sorted({line for v in summary["variants"] for line in v.get("fallbacks") or []})


def loss_check_legend(agreement: Mapping[str, Any]) -> str:
    steps = f"the first {agreement['steps']} steps" if agreement.get("steps") else "every step"
    word = reference_word(agreement)
    text = f"per seed, over {steps}, |loss − {word}| ≤ {_bound(agreement, word)}"
    if agreement.get("across"):
        text += (
            f"; the reference of a variant differs from it only in `{agreement['across']}`, holding the "
            "baseline's value"
        )
    if agreement.get("approximate"):
        text += f"; not checked for the variants that approximate it by design: {', '.join(agreement['approximate'])}"
    return text


def status_cell(variant: Mapping[str, Any]) -> str:
    if variant["status"] == "ok":
        return "ok"
    messages = sorted({r["message"] for r in variant["runs"] if r["status"] != "ok" and r["message"]})
    text = variant["status"] + (f": {messages[0]}" if messages else "")
    return markdown_cell(text[:120] + ("…" if len(text) > 120 else ""))


def mfu_cell(variant: Mapping[str, Any], key: str) -> str:
    if variant.get(key):
        return format_spread(variant[key], lambda x: f"{100 * x:.1f}%")
    return "n/a" if variant["status"] == "ok" else "—"


def predicted_cell(variant: Mapping[str, Any]) -> str:
    """The estimator's step time at the measured ceiling, and the measured median as a multiple of it."""
    predicted, measured = variant.get("predicted_step_time_s"), variant["step_time_s"]
    if predicted is None:
        return "—"
    return f"{predicted:.3g}" + (f" (measured ×{measured['median'] / predicted:.2f})" if measured else "")


def memory_cell(variant: Mapping[str, Any]) -> str:
    stats = variant["peak_memory_bytes"]
    if not stats:
        return "—"
    return format_spread(stats, format_bytes) + (f" ({variant['memory_method']})" if variant["memory_method"] else "")


def estimate_check_cell(comparison: Mapping[str, Any] | None) -> str:
    """The estimator's categories that disagree with the measured ones beyond their factor."""
    if not comparison:
        return "—"
    off = [f"{c} {estimate_ratio(r)}" for c, r in comparison.items() if not r["agrees"]]
    bounds = [
        f"{c} {estimate_ratio(r)}: upper bound, the tracked step held {100 * r['upper_bound']:.0f}% of its tokens"
        for c, r in comparison.items()
        if r.get("upper_bound")
    ]
    return "; ".join(off + bounds) if off else "; ".join(["agrees", *bounds])


def estimate_ratio(result: Mapping[str, Any]) -> str:
    """Estimated over measured; where either is 0 a ratio says nothing (``×0.00``), so both sizes."""
    if result["ratio"] is None or result["estimated"] == 0:
        return f"est. {format_bytes(result['estimated'])} vs {format_bytes(result['measured'])} measured"
    return f"×{result['ratio']:.2f}"


def speed_cell(variant: Mapping[str, Any], baseline: str) -> str:
    """The ratio with its interval and verdict (``speed_verdict``); the baseline's is 1 by definition."""
    if variant["name"] == baseline:
        return "1.00× (baseline)" if variant["status"] == "ok" else "—"
    speed = variant.get("speed")
    if not speed or speed.get("ratio") is None:
        return "—" if variant["status"] != "ok" else markdown_cell(f"inconclusive: {speed['reason']}" if speed else "—")
    interval = f" [{speed['low']:.2f}–{speed['high']:.2f}]" if speed.get("low") is not None else ""
    words = speed["verdict"] if speed["verdict"] != INCONCLUSIVE else f"inconclusive: {speed['reason']}"
    return markdown_cell(f"{speed['ratio']:.2f}×{interval} {words}")


def reference_word(agreement: Mapping[str, Any]) -> str:
    return "reference" if agreement.get("across") else "baseline"


def agreement_cell(variant: Mapping[str, Any], baseline: str) -> str:
    reference, result = variant.get("loss_reference"), variant["loss_agreement"]
    if reference == variant["name"]:
        return "(reference)"
    if result and result.get("incomplete"):
        return markdown_cell(f"**INCOMPLETE** ({result['reason']})")
    if not result or result["passed"] is None:
        return "n/a" + (f": {result['reason']}" if result else "")
    against = "" if reference == baseline else f" vs {reference}"
    diff = f"max abs diff {result['max_abs_diff']:.2e}" if result.get("max_abs_diff") is not None else ""
    return (
        f"pass{against}, " + diff
        if result["passed"]
        else markdown_cell(f"**FAIL**{against} ({result['reason']}; {diff})")
    )


def gradient_cell(variant: Mapping[str, Any], baseline: str) -> str:
    """``expect_equal_gradients``' verdict: pass with the largest relative difference, FAIL with where, or why
    there is none."""
    if variant["name"] == baseline:
        return "(baseline)"
    result = variant.get("gradient_agreement")
    if result and result.get("incomplete"):
        return markdown_cell(f"**INCOMPLETE** ({result['reason']})")
    if not result or result["passed"] is None:
        return "n/a" + (f": {result['reason']}" if result else "")
    return (
        f"pass, max rel diff {result['max_rel_diff']:.2e}"
        if result["passed"]
        else markdown_cell(f"**FAIL** ({result['reason']})")
    )


def memory_ratio_cell(variant: Mapping[str, Any]) -> str:
    """Peak tensor memory over the baseline's; a row without a tensor peak on either side says so and
    shows the process peaks' ratio as what it is, never in its place."""
    if variant.get("memory_ratio") is not None:
        return f"{variant['memory_ratio']:.2f}×"
    process = variant.get("process_memory_ratio")
    return "—" if process is None else f"n/a (RSS only: {process:.2f}×)"


def pipeline_cell(variant: Mapping[str, Any]) -> str:
    """The measured idle share of the pipeline's steps, with the schedule's own bubble beside it."""
    if not variant.get("pipeline_idle_share"):
        return "—"
    theory = variant.get("pipeline_bubble_theory")
    own = f" ({100 * theory['median']:.0f}%)" if theory else ""
    return format_spread(variant["pipeline_idle_share"], lambda x: f"{100 * x:.0f}%") + own


def _bound(agreement: Mapping[str, Any], word: str) -> str:
    """``atol + rtol·|word|``, without the term that is zero."""
    atol, rtol = agreement["atol"], agreement["rtol"]
    relative = f"{rtol:g}·|{word}|"
    if rtol == 0:
        return f"{atol:g}"
    return relative if atol == 0 else f"{atol:g} + {relative}"


def agreement_factors() -> str:
    from lit_ablate.estimate.agreement import AGREEMENT_FACTORS

    return ", ".join(f"{c} ×{f:g}" for c, f in AGREEMENT_FACTORS.items())


def format_spread(stats: Mapping[str, float] | None, fmt) -> str:
    if not stats:
        return "—"
    if stats["n"] == 1 or stats["min"] == stats["max"]:
        return fmt(stats["median"])
    return f"{fmt(stats['median'])} [{fmt(stats['min'])}–{fmt(stats['max'])}]"


def format_delta(x: float | None) -> str:
    """A loss difference: 4 decimals, or scientific when it is smaller than that shows."""
    if x is None:
        return "—"
    return f"{x:+.4f}" if x == 0 or abs(x) >= 5e-5 else f"{x:+.1e}"


def format_rate(x: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{suffix}"
    return f"{x:.4g}"


def format_bytes(x: float) -> str:
    """Three significant digits, in whole units from 1000 of one up to 1024 (never ``1e+03 MiB``)."""
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= scale:
            value = x / scale
            return f"{value:.0f} {suffix}" if abs(value) >= 999.5 else f"{value:.3g} {suffix}"
    return f"{x:.0f} B"


def markdown_cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no pipes, no line breaks)."""
    return text.replace("|", "\\|").replace("\n", " ")
