"""The GPU lane's lane.json as the README of ``benchmarks/results/gpu/<kind>-<date>/``.

    benchmarks/gpu/render LANE_JSON            # print the README
    benchmarks/gpu/render LANE_JSON --save     # write it, lane.json and log_tails.md into the results folder
    benchmarks/gpu/render LANE_JSON --rerun mfu 150 mfu.log [--rerun STEP LIMIT_S LOG ...] --save

One table puts each figure beside its anchor (what the seed study or a library's own claim
measured) and its goal; then every step with its status and time, every gpu-marked test's outcome
(each skip with its reason), the fit's memory categories from its run.json, and the log tail of
each step that did not finish ``ok`` (all tails go to log_tails.md).

``--rerun STEP LIMIT_S LOG``: the whole output of one step run again by hand on the same warm
machine (``bash benchmarks/gpu/run --only STEP`` under a longer limit). Its figures (``RESULT``
lines; a pytest step's outcomes) get their own section beside the lane's, labelled with the limit
they ran under, and the log is saved into the folder as ``rerun_<STEP>.log``: the lane's own
figures are never replaced by a rerun's.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lane as lane_steps  # a script beside this one, not a package

RESULTS = Path(__file__).resolve().parents[1] / "results" / "gpu"


@dataclass(frozen=True)
class Rerun:
    """One step run again by hand on the same machine: its limit and its whole output."""

    step: str
    limit_s: int
    log: Path

    def results(self) -> dict[str, object]:
        lines = self.log.read_text(errors="replace").splitlines()
        if self.step == "gpu_tests":
            return lane_steps.collect_pytest(lines, self.log.parent / "no-junit-xml-for-a-rerun")
        return lane_steps.result_lines(lines)


@dataclass(frozen=True)
class Figure:
    """One row of the figures table: ``step``'s result ``key``, its anchor and its goal."""

    benchmark: str
    step: str
    key: str
    label: str
    anchor: str = "—"
    goal: tuple[str, object] | None = None
    """``(op, value)`` with op one of ``>=``, ``<=``, ``>``, ``<``, ``==``; None: reported, no goal."""
    unit: str = ""

    def entry(self, lane: dict) -> dict:
        """The lane's entry of this figure's step: ``step`` may name alternatives, ``a|b`` (a step renamed
        since an older lane run, whose JSON still renders)."""
        return next((lane["steps"][s] for s in self.step.split("|") if s in lane["steps"]), {})


FIGURES: tuple[Figure, ...] = (
    Figure(
        "seed headline",
        "mfu_seed",
        "seed_useful_tokens_per_s",
        "useful tokens/s, Qwen3-0.6B + 65,537 tokens (vocab 217,473), 10,240-token packed rows, bf16, compiled",
        "~61k (seed: one H100, 32 x 10,240-token packs, FA3 varlen + Liger + compile)",
        (">=", 65000),
        "tok/s",
    ),
    Figure(
        "seed headline",
        "mfu_seed",
        "seed_lit_vs_hand",
        "lit-ablate / the hand-written loop, useful tokens/s, same run",
        goal=(">=", 0.98),
        unit="x",
    ),
    Figure(
        "seed headline",
        "mfu_seed",
        "seed_mfu_seed_formula",
        "seed-formula MFU: (6 (N - N_emb) + 12 L H d seq) / spec peak",
        "0.60-0.62 (seed's own formula and run)",
    ),
    Figure(
        "seed headline", "mfu_seed", "seed_mfu", "our MFU (per-document causal attention, head counted) / spec peak"
    ),
    Figure("seed headline", "mfu_seed", "seed_mfu_measured", "our MFU / the measured bf16 matmul ceiling"),
    Figure("seed headline", "mfu_seed", "seed_mean_document_tokens", "mean document length", unit="tokens"),
    Figure(
        "seed headline",
        "mfu_seed",
        "seed_hand_useful_tokens_per_s",
        "the hand-written loop's useful tokens/s",
        unit="tok/s",
    ),
    Figure(
        "seed headline",
        "mfu_seed",
        "seed_loss_max_abs_diff",
        "largest per-step loss difference, lit-ablate vs hand loop",
    ),
    Figure(
        "seed headline",
        "mfu_seed",
        "seed_attention",
        "packed attention used",
        goal=("==", "fa_varlen or torch_varlen or flex"),
    ),
    Figure("seed headline", "mfu_seed", "seed_loss", "loss used"),
    Figure(
        "dense MFU",
        "mfu_dense|mfu",
        "dense_useful_tokens_per_s",
        "useful tokens/s, Qwen3-0.6B (vocab 151,936), 8,192-token packed rows, bf16, compiled",
        unit="tok/s",
    ),
    Figure("dense MFU", "mfu_dense|mfu", "dense_mfu", "our MFU / spec peak"),
    Figure("dense MFU", "mfu_dense|mfu", "dense_mfu_measured", "our MFU / the measured bf16 matmul ceiling"),
    Figure("dense MFU", "mfu_dense|mfu", "dense_mfu_seed_formula", "seed-formula MFU / spec peak"),
    Figure(
        "dense MFU",
        "mfu_dense|mfu",
        "dense_attention",
        "packed attention used",
        goal=("==", "fa_varlen or torch_varlen or flex"),
    ),
    Figure("dense MFU", "mfu_dense|mfu", "dense_loss", "loss used"),
    Figure("dense MFU", "mfu_dense|mfu", "dense_peak_allocated_gib", "peak allocated", unit="GiB"),
    Figure("dense MFU", "mfu_dense|mfu", "dense_spec_peak_tflops", "spec peak, dense bf16", unit="TFLOP/s"),
    Figure("dense MFU", "mfu_dense|mfu", "dense_ceiling_tflops", "measured bf16 matmul ceiling", unit="TFLOP/s"),
    Figure(
        "loss backends",
        "loss",
        "liger_memory_ratio",
        "Liger fused linear-CE peak / torch's (V 151,936, H 1024, 16k tokens)",
        "0.21 (Liger: -79% memory)",
        ("<=", 0.21),
    ),
    Figure("loss backends", "loss", "liger_time_ratio", "Liger time / torch's"),
    Figure(
        "loss backends",
        "loss",
        "liger_best_chunk_tokens",
        "Liger's fastest chunk size at this shape (own: Liger's choice)",
    ),
    Figure("loss backends", "loss", "liger_best_accum_dtype", "with the weight gradient summed in"),
    Figure("loss backends", "loss", "liger_best_time_ratio", "Liger at that setting, time / torch's", goal=("<", 1.0)),
    Figure(
        "loss backends",
        "loss",
        "torch_working_mib",
        "torch: loss memory beyond its gradients",
        "24 GB (CCE paper)",
        unit="MiB",
    ),
    Figure(
        "loss backends",
        "loss",
        "cce_working_mib",
        "CCE: loss memory beyond its gradients",
        "1 MB (CCE paper)",
        ("<=", 1.0),
        unit="MiB",
    ),
    Figure("loss backends", "loss", "cce_time_ratio", "CCE time / torch's"),
    Figure("loss backends", "loss", "chunked_memory_ratio", "chunked peak / torch's"),
    Figure(
        "MoE",
        "moe",
        "grouped_speedup",
        "grouped vs loop experts, Qwen3-30B-A3B layer, bf16 fwd+bwd",
        "~10x fused vs naive (seed)",
        (">=", 10.0),
        "x",
    ),
    Figure(
        "MoE", "moe", "grouped_speedup_vs_hf_eager", "grouped vs transformers' eager experts", goal=(">", 1.0), unit="x"
    ),
    Figure("MoE", "moe", "grouped_fallback", "grouped kernel fallback", goal=("==", "none")),
    Figure(
        "fp8",
        "fp8",
        "fp8_tensorwise_speedup",
        "tensorwise vs bf16 step (Qwen3-8B shape, 4 layers, 8k tokens)",
        goal=(">", 1.0),
        unit="x",
    ),
    Figure("fp8", "fp8", "fp8_rowwise_speedup", "rowwise vs bf16 step", goal=(">", 1.0), unit="x"),
    Figure("fp8", "fp8", "fp8_tensorwise_memory_ratio", "tensorwise peak / bf16's"),
    Figure("fp8", "fp8", "fp8_kernels", "fp8 matmuls that ran", goal=("==", "real")),
    Figure(
        "packing",
        "packing",
        "packing_speedup",
        "FFD packing vs padding, useful tokens/s (Qwen3-0.6B shape, 8 layers)",
        "2.26-2.29x (CPU, tiny model)",
        (">=", 1.8),
        "x",
    ),
    Figure(
        "packing",
        "packing",
        "packing_speedup_vs_grouped",
        "FFD packing vs length-grouped padding",
        "0.87-0.89x (CPU, tiny model)",
        (">", 1.0),
        "x",
    ),
    Figure("packing", "packing", "packing_attention", "packed attention of those rows"),
    Figure(
        "DPO",
        "dpo",
        "dpo_chunked_memory_ratio",
        "chunked log-probs' working memory / torch's (Qwen3-32B head, 15k tokens)",
        "0.126 (CPU, 1k tokens)",
        ("<=", 0.15),
    ),
    Figure("DPO", "dpo", "dpo_liger_memory_ratio", "Liger DPO's working memory / torch's", "6.0 (CPU, 1k tokens)"),
    Figure("fit", "fit", "status", "lit-ablate fit (quickstart, --trainer.accelerator gpu)", goal=("==", "ok")),
    Figure(
        "mesh on one GPU",
        "mesh_sim",
        "sim_dimensions_ok",
        "mesh dimensions whose CUDA path ran (rank 0 of 8, simulated)",
        goal=("==", 6),
        unit="of 6",
    ),
    *(
        Figure("mesh on one GPU", "mesh_sim", f"sim_{dim}", f"{dim}: rank 0 of 8, two bf16 steps", goal=("==", "ok"))
        for dim in ("dp_shard", "dp_replicate", "tp", "cp", "ep", "pp")
    ),
    *(
        Figure("mesh on one GPU", "mesh_sim", f"sim_{dim}_estimate", f"{dim}: the rank's memory vs the estimate")
        for dim in ("dp_shard", "dp_replicate", "tp", "cp", "ep", "pp")
    ),
    Figure("fit", "fit", "tensor_method", "memory measured by", goal=("==", "cuda_max_allocated")),
    Figure("gpu tests", "gpu_tests", "failed", "gpu-marked tests failed", goal=("==", 0)),
    Figure("gpu tests", "gpu_tests", "error", "gpu-marked tests in error", goal=("==", 0)),
    Figure("gpu tests", "gpu_tests", "passed", "gpu-marked tests passed"),
    Figure("gpu tests", "gpu_tests", "skipped", "gpu-marked tests skipped (reasons below)"),
)


def met(figure: Figure, value: object) -> str:
    if figure.goal is None:
        return "—"
    if value is None or value == "n/a":
        return "n/a"
    op, target = figure.goal
    if op == "==":
        wanted = [t.strip() for t in str(target).split(" or ")]
        return "yes" if str(value) in wanted else "no"
    if not isinstance(value, (int, float)):
        return "n/a"
    ok = {">=": value >= target, "<=": value <= target, ">": value > target, "<": value < target}[op]
    return "yes" if ok else "no"


def formatted(value: object, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if unit in ("tok/s", "MiB") or abs(value) >= 1000:
        text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    elif isinstance(value, int):
        text = str(value)
    else:
        text = f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return f"{text}{unit}" if unit == "x" else f"{text} {unit}".strip()


def goal_text(figure: Figure) -> str:
    if figure.goal is None:
        return "—"
    op, target = figure.goal
    return f"{op} {target}{figure.unit if figure.unit == 'x' else ''}"


def figures_table(lane: dict) -> str:
    lines = ["| benchmark | figure | measured | anchor | goal | met |", "|---|---|---|---|---|---|"]
    for figure in FIGURES:
        results = figure.entry(lane).get("results") or {}
        if figure.key in results:
            value = formatted(results[figure.key], figure.unit)
            verdict = met(figure, results[figure.key])
        else:
            status = figure.entry(lane).get("status", "not run")
            value = "(not reported)" if status == "ok" else f"({status})"
            verdict = "n/a" if figure.goal else "—"
        lines.append(
            f"| {figure.benchmark} | {figure.label} | {value} | {figure.anchor} | {goal_text(figure)} | {verdict} |"
        )
    return "\n".join(lines)


def steps_table(lane: dict) -> str:
    lines = ["| step | status | seconds / limit | what |", "|---|---|---|---|"]
    for name, entry in lane["steps"].items():
        lines.append(
            f"| {name} | {entry['status']} | {entry.get('seconds', '-')} / {entry['timeout_s']} | {entry['what']} |"
        )
    return "\n".join(lines)


def tests_table(lane: dict) -> str:
    results = (lane["steps"].get("gpu_tests") or {}).get("results") or {}
    tests = results.get("tests") or {}
    if not tests:
        return "No gpu-marked test ran" + (f" ({results['selected']} collected)." if results.get("selected") else ".")
    lines = ["| test | outcome | reason / message |", "|---|---|---|"]
    for name, test in sorted(tests.items(), key=lambda item: (item[1]["outcome"] == "passed", item[0])):
        message = " ".join(test["message"].split())[:300].replace("|", "\\|")
        lines.append(f"| `{name}` | {test['outcome']} | {message} |")
    return "\n".join(lines)


def memory_table(lane: dict) -> str:
    results = (lane["steps"].get("fit") or {}).get("results") or {}
    breakdown = results.get("tensor_breakdown") or {}
    if not breakdown.get("at_peak"):
        return "No memory categories recorded."
    mib = 2**20
    lines = [
        f"Tracked step {breakdown.get('step')}, method {breakdown.get('method')}; peak tensor bytes "
        f"{formatted((results.get('peak_tensor_bytes') or 0) / mib, 'MiB')}.",
        "",
        "| category | at the peak (MiB) | its own max (MiB) |",
        "|---|---|---|",
    ]
    for category, at_peak in breakdown["at_peak"].items():
        lines.append(f"| {category} | {at_peak / mib:.2f} | {breakdown.get('max', {}).get(category, 0) / mib:.2f} |")
    return "\n".join(lines)


def reruns_section(lane: dict, reruns: list[Rerun]) -> str:
    """What each rerun gave: the step's headline figures beside the lane's own, and a rerun's
    gpu-marked test outcomes in full (a lane step cut at its limit lists only what finished)."""
    if not reruns:
        return "No step was rerun."
    parts = []
    for rerun in reruns:
        results = rerun.results()
        entry = lane["steps"].get(rerun.step) or {}
        lane_results = entry.get("results") or {}
        keys = [f.key for f in FIGURES if rerun.step in f.step.split("|")] or list(results)
        lines = [
            f"### {rerun.step}: lane {entry.get('status', 'not run')} at {entry.get('seconds', '-')} / "
            f"{entry.get('timeout_s', '-')} s; rerun under {rerun.limit_s} s (`rerun_{rerun.step}.log`)",
            "",
            "| figure | lane | rerun |",
            "|---|---|---|",
        ]
        for key in keys:
            if key in results or key in lane_results:
                lines.append(f"| {key} | {formatted(lane_results.get(key))} | {formatted(results.get(key))} |")
        if rerun.step == "gpu_tests":
            lines += ["", tests_table({"steps": {"gpu_tests": {"results": results}}})]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def header(lane: dict) -> tuple[str, str]:
    env = (lane["steps"].get("env") or {}).get("results") or {}
    meta = lane["lane"]
    prepared = meta.get("prepared") or {}
    commit = (prepared.get("git_commit") or "unknown")[:10] + (
        " + uncommitted changes" if prepared.get("git_dirty") else ""
    )
    title = f"# GPU lane: {env.get('gpu', 'unknown device')}, {meta['started_at'][:10]}"
    kind = " (dry run on the CPU: the figures mean nothing)" if meta.get("dry_run") else ""
    line = (
        f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, transformers "
        f"{env.get('transformers')}, lightning {env.get('lightning')}; lit-ablate at {commit}; "
        f"{meta.get('elapsed_s')} s of the {meta['budget_s']} s budget{kind}."
    )
    return title, line


def readme(lane: dict, reruns: list[Rerun] | None = None) -> str:
    title, line = header(lane)
    failed = [name for name, entry in lane["steps"].items() if entry["status"] != "ok"]
    tails = (
        "\n\n".join(
            f"### {name} ({lane['steps'][name]['status']})\n\n```\n{lane['steps'][name].get('tail', '')}\n```"
            for name in failed
        )
        or "Every step finished ok."
    )
    return (
        "\n\n".join(
            [
                title,
                line,
                "Made by `benchmarks/gpu/render` from `lane.json` (`benchmarks/gpu/README.md` says how the lane runs).",
                "## Figures",
                figures_table(lane),
                "## Steps",
                steps_table(lane),
                "## gpu-marked tests",
                tests_table(lane),
                "## Memory categories of the fit (run.json)",
                memory_table(lane),
                "## Reruns on the same machine, after the lane",
                reruns_section(lane, reruns or []),
                "## Log tails of the steps that did not finish ok",
                tails,
            ]
        )
        + "\n"
    )


def log_tails(lane: dict) -> str:
    return (
        "\n\n".join(
            f"## {name} ({entry['status']}, {entry.get('seconds', '-')} s)\n\n`{entry['command']}`\n\n"
            f"```\n{entry.get('tail', '')}\n```"
            for name, entry in lane["steps"].items()
        )
        + "\n"
    )


def results_folder(lane: dict) -> Path:
    """``benchmarks/results/gpu/<kind>-<date>``: kind from the GPU's name (h100, h200, ...)."""
    gpu = str(((lane["steps"].get("env") or {}).get("results") or {}).get("gpu", "unknown"))
    match = re.search(r"\b([a-z]+\d{2,4})\b", gpu.lower().replace("nvidia ", ""))
    kind = match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown"
    return RESULTS / f"{kind}-{lane['lane']['started_at'][:10]}"


def save(lane_json: Path, folder: Path, reruns: list[Rerun] | None = None) -> Path:
    lane = json.loads(lane_json.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(readme(lane, reruns))
    for rerun in reruns or []:
        shutil.copyfile(rerun.log, folder / f"rerun_{rerun.step}.log")
    (folder / "log_tails.md").write_text(log_tails(lane))
    if lane_json.resolve() != (folder / "lane.json").resolve():
        shutil.copyfile(lane_json, folder / "lane.json")
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("lane_json", type=Path, help="lane.json from the device ($OUT)")
    parser.add_argument(
        "--save", action="store_true", help="write README.md, lane.json, log_tails.md to the results folder"
    )
    parser.add_argument(
        "--folder", type=Path, help="with --save: this folder instead of benchmarks/results/gpu/<kind>-<date>"
    )
    parser.add_argument(
        "--rerun",
        nargs=3,
        action="append",
        default=[],
        metavar=("STEP", "LIMIT_S", "LOG"),
        help="a step rerun by hand on the same machine: its limit and its whole output",
    )
    args = parser.parse_args()
    lane = json.loads(args.lane_json.read_text())
    reruns = [Rerun(step, int(limit), Path(log)) for step, limit, log in args.rerun]
    if args.save:
        print(f"wrote {save(args.lane_json, args.folder or results_folder(lane), reruns)}")
    else:
        print(readme(lane, reruns), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
