"""``lit-ablate estimate``: parameters and per-rank memory of a fit config under each sharding, before running it;
with ``--measure``, one rank of the configured mesh run as a simulated process beside its estimate."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from lit_ablate.estimate.from_config import (
    SHARDINGS,
    canonical_sharding,
    configured_sharding,
    context_parallel_of,
    model_of,
    pipeline_of,
    smallest_world_size,
    tensor_parallel_of,
    training_shape_of,
    world_size_of,
)
from lit_ablate.estimate.memory import estimate_memory
from lit_ablate.estimate.shapes import GIB, OPTIMIZERS, MemoryEstimate
from lit_ablate.rules import Scope, check
from lit_ablate.run_config import RunConfig, on_ranks


def estimate_main(argv: list[str]) -> int:
    """``lit-ablate estimate --config FIT.yaml [--gpu_memory_gib 80] [--json] [--measure] [--dotted.key value ...]``.

    Prints the per-rank breakdown at the config's world size under its own strategy and each of
    ``SHARDINGS``, and the smallest number of GPUs of the given size that fits each; ``--json``
    prints the same numbers (exact counts and bytes) as one JSON object instead of the table.
    ``--measure`` also runs rank ``--simulate_rank`` of the configured mesh at that world size as one
    process over a fake process group (``lit-ablate fit --simulate``, a few steps) and puts its measured
    memory beside that rank's estimate, per category, judged by the rule every study report uses.
    """
    import argparse

    from lit_ablate.errors import ConfigError

    parser = argparse.ArgumentParser(
        prog="lit-ablate estimate", description=estimate_main.__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--config", required=True, help="a fit config (extra --dotted.key value pairs override it)")
    parser.add_argument("--gpu_memory_gib", type=float, default=80.0, help="memory of one GPU")
    parser.add_argument(
        "--usable_fraction",
        type=float,
        default=0.9,
        help="share of it training may use (CUDA context, allocator fragmentation take the rest)",
    )
    parser.add_argument("--gpus_per_node", type=int, default=8, help="HSDP shards within a node of this many GPUs")
    parser.add_argument("--max_gpus", type=int, default=4096, help="search limit for the smallest fitting number")
    parser.add_argument("--world_size", type=int, help="ranks for the breakdown (default: devices x num_nodes)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the config's (CausalLM: adamw)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON (bytes, exact counts)")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also run one rank of the configured mesh as a simulated process (fake process group, "
        f"{MEASURE_STEPS} steps) and show its measured memory beside its estimate (docs/simulation.md)",
    )
    parser.add_argument("--simulate_rank", type=int, default=0, help="the rank --measure runs")
    args, overrides = parser.parse_known_args(argv)
    from lit_ablate.fit_cli import resolve_fit_config

    try:
        _check_estimate_arguments(args)
        config = RunConfig.of(resolve_fit_config(["--config", args.config, *overrides]))
        world = args.world_size or world_size_of(config)
        if world < 1:
            raise ConfigError("trainer.devices", config.trainer.devices, "use a positive number of devices per node")
        check(config if args.world_size is None else on_ranks(config, world), Scope.CONFIG)  # what no machine runs
        training = training_shape_of(config, args.optimizer, world)
        counts, shape = model_of(config)
        configured_sharding(config, world)  # the configured mesh must lay out on the ranks asked for
        budget = args.gpu_memory_gib * args.usable_fraction * GIB

        def at(kind: str, n: int) -> MemoryEstimate | None:
            try:
                run = training
                if kind == "configured":
                    sharding = configured_sharding(config, n)
                    run = replace(
                        training,
                        context_parallel=context_parallel_of(config, n)[0],  # cp: -1 grows with n
                        **dict(zip(("tensor_parallel", "sequence_parallel"), tensor_parallel_of(config, n))),
                        **pipeline_of(config, n),
                    )  # tp and pp: -1 too
                else:
                    sharding = canonical_sharding(kind, n, args.gpus_per_node)
                    # the data-parallel layouts: whole sequences and matrices on every rank, no stages
                    run = replace(
                        training, pipeline_parallel=1, tensor_parallel=1, sequence_parallel=False, context_parallel=1
                    )
            except ConfigError:  # the configured mesh cannot be laid out on n ranks
                return None
            return estimate_memory(counts, shape, run, sharding, n)

        rows = []
        for kind in ("configured", *SHARDINGS):
            here = at(kind, world)
            fewest = smallest_world_size(
                lambda n, kind=kind: (e := at(kind, n)) is not None and e.total <= budget, args.max_gpus
            )
            rows.append((kind, here, fewest, at(kind, fewest) if fewest else None))
        if args.measure:
            _check_measure_arguments(world, args.simulate_rank)
    except ConfigError as err:
        print(f"lit-ablate estimate: error: {err}", file=sys.stderr)
        return 2
    summary = _estimate_summary(config, counts, shape, training, world, rows, args)
    if args.measure:
        with tempfile.TemporaryDirectory(prefix="lit-ablate-measure-") as folder:
            record, failure = simulated_record(args.config, overrides, config, world, args.simulate_rank, Path(folder))
        if record is None:
            print(f"lit-ablate estimate: the simulated rank failed:\n{failure}", file=sys.stderr)
            return 1
        summary["measured"] = measured_beside_estimate(config, record, world, args.simulate_rank)
    print(json.dumps(summary, indent=1) if args.json else _estimate_table(summary))
    return 0


def _check_estimate_arguments(args: Any) -> None:
    """Numbers ``estimate`` would otherwise turn into a table of nonsense (or silently replace:
    ``--world_size 0`` used to mean "the config's")."""
    from lit_ablate.errors import ConfigError

    for name in ("world_size", "gpus_per_node", "max_gpus"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name}", value, "use a positive number of GPUs")
    if not args.gpu_memory_gib > 0:
        raise ConfigError("--gpu_memory_gib", args.gpu_memory_gib, "give one GPU's memory in GiB, e.g. 80")
    if not 0 < args.usable_fraction <= 1:
        raise ConfigError("--usable_fraction", args.usable_fraction, "give a share in (0, 1], e.g. 0.9")


MEASURE_STEPS = 3
"""Steps of ``--measure``'s simulated run: the first primes the tensor tracker, the second is tracked (its
categories are measured), the third is timed without the tracker."""


def _check_measure_arguments(world: int, rank: int) -> None:
    from lit_ablate.errors import ConfigError

    if world < 2:
        raise ConfigError("--world_size", world, "--measure runs one rank of several: give --world_size 2 or more")
    if not 0 <= rank < world:
        raise ConfigError("--simulate_rank", rank, f"give a rank from 0 to {world - 1}")


def simulated_record(
    config_path: str, overrides: list[str], config: RunConfig, world: int, rank: int, folder: Path
) -> tuple[dict[str, Any] | None, str | None]:
    """Run ``lit-ablate fit`` on the config as rank ``rank`` of ``world`` simulated ranks, in a process of its
    own (its fake process group and its memory are its own), for ``MEASURE_STEPS`` steps with the tensor
    tracker on the second (a ``MemoryMonitor`` is added when the config has none); ``(its run record,
    None)``, or ``(None, its stderr's tail)`` when it failed."""
    from lit_ablate.record import read_record
    from lit_ablate.simulated_rank import SIMULATE_KEY, SIMULATE_RANK_KEY

    record_path = folder / "run.json"
    tracked = any(path.endswith("MemoryMonitor") for path in config.trainer.callbacks)
    command = [
        sys.executable,
        "-m",
        "lit_ablate.cli",
        "fit",
        "--config",
        config_path,
        *overrides,
        f"--{SIMULATE_KEY}",
        str(world),
        f"--{SIMULATE_RANK_KEY}",
        str(rank),
        "--trainer.max_steps",
        str(MEASURE_STEPS),
        "--recorder.warmup_steps",
        str(MEASURE_STEPS - 1),
        "--recorder.path",
        str(record_path),
        "--trainer.default_root_dir",
        str(folder),
        "--trainer.logger",
        "false",
        *([] if tracked else ["--trainer.callbacks+=lit_ablate.callbacks.MemoryMonitor"]),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not record_path.is_file():
        return None, "\n".join(done.stderr.strip().splitlines()[-20:])
    return read_record(record_path), None


def measured_beside_estimate(config: RunConfig, record: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    """The simulated rank's tracked categories beside its own estimate (``estimate_for_config``: under
    pipeline parallelism its stage's), each judged by ``compare_with_measured``, and its step time and MFU
    (compute alone: the fake collectives move no data)."""
    from lit_ablate.estimate.agreement import AGREEMENT_FACTORS, compare_with_measured
    from lit_ablate.estimate.from_config import estimate_for_config

    summary = record["summary"]
    breakdown = summary.get("tensor_breakdown")
    median = lambda key: (summary.get(key) or {}).get("median")  # noqa: E731
    out = {
        "world_size": world,
        "rank": rank,
        "device": record["environment"].get("device_name"),
        "step_time_s": median("step_time_s"),
        "mfu": median("mfu"),
        "mfu_measured": median("mfu_measured"),
        "peak_tensor_bytes": summary.get("peak_tensor_bytes"),
        "factors": AGREEMENT_FACTORS,
        "categories": None,
    }
    if breakdown:
        out["categories"] = compare_with_measured(estimate_for_config(config, world, rank), breakdown)
    return out


MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "transient", "reference", "total")
"""The per-rank byte counts of one sharding, in the table's column order."""


def _estimate_summary(config, counts, shape, training, world, rows, args) -> dict[str, Any]:  # estimate_main's locals
    """Everything ``estimate`` reports, in exact numbers: what ``--json`` prints and the table renders."""
    strategy = config.trainer.strategy.short_name
    return {
        "model": {
            "parameters": counts.total,
            "active_parameters": counts.active,
            "trainable_parameters": counts.trainable,
            "quantized_parameters": counts.quantized,
            "layers": shape.layers,
            "hidden": shape.hidden,
            "vocab": shape.vocab,
        },
        "run": asdict(training),
        "world_size": world,
        "strategy": strategy,
        "gpu_memory_gib": args.gpu_memory_gib,
        "usable_fraction": args.usable_fraction,
        "gpus_per_node": args.gpus_per_node,
        "max_gpus": args.max_gpus,
        "shardings": [
            {
                "sharding": kind,
                "bytes_per_rank": {k: getattr(e, k) for k in MEMORY_KINDS} if e else None,
                "gpus_needed": fewest,
                "total_bytes_per_rank_at_gpus_needed": there.total if there else None,
            }
            for kind, e, fewest, there in rows
        ],
    }


def _estimate_table(summary: dict[str, Any]) -> str:
    model, training, shardings = summary["model"], summary["run"], summary["shardings"]
    largest = max((s["bytes_per_rank"]["total"] for s in shardings if s["bytes_per_rank"]), default=0)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    lines = [
        f"Model: {_count(model['parameters'])} parameters ({model['parameters']:,}), "
        f"{_count(model['active_parameters'])} active ({model['active_parameters']:,}), "
        f"{_count(model['trainable_parameters'])} trainable, {_count(model['quantized_parameters'])} quantised, "
        f"{model['layers']} layers, "
        f"hidden {model['hidden']}, vocab {model['vocab']}.",
        f"Run: micro-batch {training['micro_batch']} x {training['seq_len']} tokens per rank, "
        f"parameters {training['param_bytes']} B, activations {training['activation_bytes']} B, "
        f"optimizer {training['optimizer']}, checkpointing {training['checkpointing']}, "
        f"loss {training['loss']}, attention {training['attention']}."
        + (
            f" Pipeline: {training['pipeline_parallel']} ranks x {training['pipeline_stages_per_rank']} stage(s), "
            f"{training['pipeline_schedule']}, {training['microbatches']} micro-batches per step, each stage over "
            f"tp {training['tensor_parallel']} and cp {training['context_parallel']} (and the strategy's FSDP and "
            "expert ranks); the configured row is the largest rank's."
            if training["pipeline_parallel"] > 1
            else ""
        ),
        "",
        f"Per rank at {summary['world_size']} rank(s), {unit}; last column: smallest number of "
        f"{summary['gpu_memory_gib']:g} GiB GPUs that fit ({summary['usable_fraction']:.0%} usable, HSDP shards "
        f"within {summary['gpus_per_node']}), with the total per rank at that number.",
        "",
        "| sharding | " + " | ".join(MEMORY_KINDS) + f" | GPUs needed (total per rank, {unit}) |",
        "|---" * (len(MEMORY_KINDS) + 2) + "|",
    ]
    for row in shardings:
        name = f"configured ({summary['strategy']})" if row["sharding"] == "configured" else row["sharding"]
        memory = row["bytes_per_rank"]
        cells = [_memory_cell(memory[k], scale) for k in MEMORY_KINDS] if memory else ["—"] * len(MEMORY_KINDS)
        need = (
            f"{row['gpus_needed']} ({_memory_cell(row['total_bytes_per_rank_at_gpus_needed'], scale)})"
            if row["gpus_needed"]
            else f"none up to {summary['max_gpus']}"
        )
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {need} |")
    lines += [
        "",
        "Activations are per rank and not divided by data parallelism: lower the micro-batch or "
        "checkpoint activations when they dominate. 'none': replicated state (or HSDP's node-sized "
        "shards) plus activations exceed a GPU at any count. A row's total at the GPUs it needs differs "
        f"from its total at {summary['world_size']} rank(s): sharded state divides by the number of ranks, and "
        "one rank of a data-parallel layout (ddp, zero1, zero2) all-reduces nothing, so it keeps no DDP "
        "gradient buckets (unless the config wraps it in DDP); FSDP2 gathers each layer even on one rank.",
    ]
    if "measured" in summary:
        lines += ["", *_measured_table(summary["measured"], unit, scale)]
    return "\n".join(lines)


def _measured_table(measured: dict[str, Any], unit: str, scale: int) -> list[str]:
    """``--measure``'s rows: each category's estimate and measurement on the simulated rank, their ratio and
    whether they agree by the study reports' rule."""
    head = (
        f"Rank {measured['rank']} of {measured['world_size']}, simulated (one process, fake process group: no "
        f"communication, no numerics; docs/simulation.md) on {measured['device']}, {unit}"
    )
    if measured["step_time_s"] is not None:
        mfu = measured["mfu"] if measured["mfu"] is not None else measured["mfu_measured"]
        head += f"; step compute {measured['step_time_s']:.3g} s" + (f", MFU {mfu:.1%}" if mfu is not None else "")
    categories = measured["categories"]
    if categories is None:
        return [head + ".", "", "No tensor categories were tracked (its MemoryMonitor tracked no step)."]
    lines = [
        head + ".",
        "",
        "| category | estimated | measured | estimate / measured | agrees (within) |",
        "|---|---|---|---|---|",
    ]
    for category, row in categories.items():
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "—"
        verdict = ("yes" if row["agrees"] else "NO") + f" (×{measured['factors'][category]:g})"
        lines.append(
            f"| {category} | {_memory_cell(row['estimated'], scale)} | {_memory_cell(row['measured'], scale)} "
            f"| {ratio} | {verdict} |"
        )
    return lines


def _memory_cell(num_bytes: int, scale: int) -> str:
    """A table cell: bytes in the table's unit (``scale`` bytes), 1 decimal, 2 significant digits below 0.1."""
    return f"{num_bytes / scale:.1f}" if num_bytes >= 0.1 * scale else f"{num_bytes / scale:.2g}"


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)
