"""The report's figures, drawn headless (matplotlib Agg) from the study summary alone.

Loss curves overlaid; throughput and peak-memory bars with min-max whiskers; the measured
tensor categories stacked beside the estimator's; and, for a numeric
axis, final loss and useful tokens/s against the axis value (and against the parameter count
when it varies, as in a depth grid). Same summary in, same PNG bytes out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the headless backend

DPI = 100
LINE_STYLES = ("-", "--", ":", "-.")
PNG_METADATA = {"Software": None}
"""No matplotlib version in the PNG: a re-render from the same records is byte-identical."""


def write_plots(summary: Mapping[str, Any], directory: Path) -> list[str]:
    """Draw every figure the summary supports into ``directory``; returns their file names."""
    variants = summary["variants"]
    written = []
    if any(v["loss_curve"]["step"] for v in variants):
        written.append(_loss_curves(variants, directory / "loss.png"))
    if any(v["useful_tokens_per_sec"] or v["tokens_per_sec"] for v in variants):
        written.append(_throughput_bars(variants, directory / "throughput.png"))
    if any(v["peak_memory_bytes"] or v.get("peak_tensor_bytes") for v in variants):
        written.append(_memory_bars(variants, directory / "memory.png"))
    if any(v.get("tensor_breakdown") for v in variants):
        written.append(_memory_categories(variants, directory / "memory_categories.png"))
    axes = summary["study"].get("axes") or {}
    for key, values in axes.items():
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values):
            other = next((k for k in axes if k != key), None)  # a grid: one line per value of the other axis
            written.append(_versus(variants, key, key.rsplit(".", 1)[-1], directory, other))
    parameters = {v["parameters"] for v in variants if v["parameters"] is not None}
    if len(parameters) > 1:
        written.append(_versus(variants, None, "parameters", directory))
    return written


def _save(fig: plt.Figure, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
    plt.close(fig)
    return path.name


def _loss_curves(variants: Sequence[Mapping[str, Any]], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, v in enumerate(variants):
        curve = v["loss_curve"]
        if not curve["step"]:
            continue
        style = LINE_STYLES[i % len(LINE_STYLES)]  # curves that should agree stay visible on top of each other
        (line,) = ax.plot(curve["step"], curve["median"], style, label=v["name"], linewidth=1.5)
        if curve["min"] != curve["max"]:
            ax.fill_between(curve["step"], curve["min"], curve["max"], color=line.get_color(), alpha=0.2)
    ax.set(xlabel="optimizer step", ylabel="training loss", title="Loss (median over seeds, band: min-max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _bars(
    ax: plt.Axes, variants: Sequence[Mapping[str, Any]], key: str, scale: float, offset: float, width: float, label: str
) -> None:
    """One bar per variant at its median, whiskers to min and max; missing values are left out."""
    xs, heights, low, high = [], [], [], []
    for i, v in enumerate(variants):
        stats = v[key]
        if stats:
            xs.append(i + offset)
            heights.append(stats["median"] / scale)
            low.append((stats["median"] - stats["min"]) / scale)
            high.append((stats["max"] - stats["median"]) / scale)
    ax.bar(xs, heights, width, yerr=[low, high], capsize=3, label=label)


def _variant_axis(ax: plt.Axes, variants: Sequence[Mapping[str, Any]]) -> None:
    ax.set_xticks(range(len(variants)), [v["name"] for v in variants], rotation=30, ha="right")
    ax.grid(axis="y", alpha=0.3)


def _throughput_bars(variants: Sequence[Mapping[str, Any]], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(variants) + 2), 4.5))
    _bars(ax, variants, "tokens_per_sec", 1e3, -0.2, 0.4, "processed tokens/s")
    _bars(ax, variants, "useful_tokens_per_sec", 1e3, 0.2, 0.4, "useful tokens/s")
    ax.set(ylabel="thousand tokens / s (all ranks)", title="Throughput (median, whiskers: min-max)")
    _variant_axis(ax, variants)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _memory_bars(variants: Sequence[Mapping[str, Any]], path: Path) -> str:
    """The report's main memory column: the tensor peak (or, for records without it, the process peak)."""
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(variants) + 2), 4.5))
    key, method = (
        ("peak_tensor_bytes", "tensor_method")
        if any(v.get("peak_tensor_bytes") for v in variants)
        else ("peak_memory_bytes", "memory_method")
    )
    _bars(ax, variants, key, 2**20, 0.0, 0.6, "peak")
    methods = sorted({v[method] for v in variants if v.get(method)})
    what = "Peak tensor memory" if key == "peak_tensor_bytes" else "Peak memory"
    ax.set(ylabel="MiB", title=f"{what} per rank\n({', '.join(methods) or 'method unknown'})")  # 2 lines: fits 2 bars
    _variant_axis(ax, variants)
    return _save(fig, path)


MEASURED_COLORS = {
    "params": "#1f77b4",
    "grads": "#ff7f0e",
    "optimizer": "#2ca02c",
    "activations": "#d62728",
    "temporaries": "#e377c2",
    "transient": "#9467bd",
    "untracked": "#7f7f7f",
}
"""One colour per category, shared by the measured and the estimated bars (the estimator's
activations include what is measured as temporaries during forward and backward)."""


def _memory_categories(variants: Sequence[Mapping[str, Any]], path: Path) -> str:
    """Per variant two stacked bars: the measured categories at the tensor peak (median over seeds;
    they add up to the peak) and, hatched beside them, the estimator's categories (each at its own
    peak, so their sum is the estimator's total)."""
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(variants) + 3), 5))
    categories = list(MEASURED_COLORS)
    for v in variants:  # categories a module declared (a DPO reference) come after the built-in ones
        categories += [c for c in (v.get("tensor_breakdown") or {}).get("at_peak", {}) if c not in categories]
    colors = {c: MEASURED_COLORS.get(c, f"C{i}") for i, c in enumerate(categories)}
    labelled: set[str] = set()
    for i, v in enumerate(variants):
        for offset, values, hatch in (
            (-0.2, (v.get("tensor_breakdown") or {}).get("at_peak"), None),
            (0.2, v.get("estimated_memory_categories"), "//"),
        ):
            bottom = 0.0
            for category in categories:
                height = (values or {}).get(category, 0) / 2**20
                if height:
                    label = category if category not in labelled else None
                    labelled.add(category)
                    ax.bar(
                        i + offset,
                        height,
                        0.38,
                        bottom=bottom,
                        color=colors[category],
                        hatch=hatch,
                        edgecolor="white" if hatch is None else "black",
                        linewidth=0.3,
                        label=label,
                    )
                    bottom += height
    ax.set(
        ylabel="MiB per rank",
        title="Tensor memory by category\nmeasured at the peak (left, plain), estimated (right, hatched)",
    )  # two lines: one was wider than a two-variant figure
    ax.title.set_fontsize("medium")
    _variant_axis(ax, variants)
    ax.legend(fontsize="small", ncols=2)
    return _save(fig, path)


def _versus(
    variants: Sequence[Mapping[str, Any]],
    axis_key: str | None,
    label: str,
    directory: Path,
    group_key: str | None = None,
) -> str:
    """Final loss and useful tokens/s against an axis value (``axis_key``) or the parameter count (None)."""
    groups: dict[str, list[tuple[float, Mapping[str, Any]]]] = {}
    for v in variants:
        x = v["parameters"] if axis_key is None else v["axis_values"].get(axis_key)
        if x is not None:
            group = f"{group_key.rsplit('.', 1)[-1]}={v['axis_values'].get(group_key)}" if group_key else None
            groups.setdefault(group, []).append((x, v))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, ylabel in (
        (axes[0], "final_loss", "final loss"),
        (axes[1], "useful_tokens_per_sec", "useful tokens/s"),
    ):
        for group, points in groups.items():
            measured = sorted(((x, v[key]) for x, v in points if v[key]), key=lambda p: p[0])
            if not measured:
                continue
            medians = [s["median"] for _, s in measured]
            errors = [[s["median"] - s["min"] for _, s in measured], [s["max"] - s["median"] for _, s in measured]]
            ax.errorbar([x for x, _ in measured], medians, yerr=errors, marker="o", capsize=3, label=group)
        if group_key:
            ax.legend(fontsize="small")
        ax.set(xlabel=label, ylabel=ylabel, title=f"{ylabel} vs {label}")
        if axis_key is None:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    return _save(fig, directory / f"vs_{label}.png")
