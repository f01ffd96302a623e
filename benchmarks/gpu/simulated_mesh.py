"""Every mesh dimension's code path on one device: rank 0 of an 8-rank mesh, simulated for two steps.

A GPU machine lent to the lane has one GPU, so no strategy's multi-rank CUDA path runs there for real.
``lit-ablate fit --simulate 8`` (docs/simulation.md) runs one rank of each layout below in this one
process over torch's fake process group: dp_shard (FSDP2 x 8), dp_replicate (HSDP 2 x 4), tp (2 x FSDP 4),
cp (ring, 2 x FSDP 4), ep (2 x FSDP 4, an MoE) and pp (2 stages x FSDP 4), each for two steps (the second
with the tensor tracker), so a dtype, device-placement or stream bug in a dimension's CUDA branch fails
its layout, and only its layout. The collectives move no data: numerics and communication time are not
checked here (the CPU equivalence tests check numerics).

Prints per layout ``RESULT sim_<dim>=ok`` (or ``failed``, with the error on the line before), its peak
tensor memory and whether that rank's categories agree with ``lit-ablate estimate``'s (the study reports'
rule), and ``RESULT sim_dimensions_ok=N`` of 6.

    python benchmarks/gpu/simulated_mesh.py [--device cuda|cpu] [--precision bf16-true] [--only tp,ep]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.yaml"
WORLD = 8
MOE = ["--model.init_args.model.preset", "tiny-qwen3-moe", "--model.init_args.model.moe", '{"experts": "grouped"}']
LAYOUTS: dict[str, tuple[dict, list[str]]] = {  # dimension: (strategy, extra fit arguments)
    "dp_shard": ({"class_path": "lit_ablate.strategies.FSDP2Strategy", "init_args": {"dp_shard": 8}}, []),
    "dp_replicate": (
        {"class_path": "lit_ablate.strategies.HSDPStrategy", "init_args": {"dp_replicate": 2, "dp_shard": 4}},
        [],
    ),
    "tp": ({"class_path": "lit_ablate.strategies.TensorParallelStrategy", "init_args": {"tp": 2, "dp_shard": 4}}, []),
    "cp": ({"class_path": "lit_ablate.strategies.ContextParallelStrategy", "init_args": {"cp": 2, "dp_shard": 4}}, []),
    "ep": ({"class_path": "lit_ablate.strategies.ExpertParallelStrategy", "init_args": {"ep": 2, "dp_shard": 4}}, MOE),
    "pp": (
        {
            "class_path": "lit_ablate.strategies.PipelineParallelStrategy",
            "init_args": {"pp": 2, "dp_shard": 4, "microbatches": 2},
        },
        [],
    ),
}


def fit_arguments(dimension: str, device: str, precision: str, folder: Path) -> list[str]:
    """``lit-ablate fit`` arguments of one layout: the quickstart's tiny model, rank 0 of ``WORLD``, 2 steps."""
    strategy, extra = LAYOUTS[dimension]
    dtype = {"bf16-true": "bfloat16", "16-true": "float16"}.get(precision, "float32")
    return [
        "fit",
        "--config",
        str(CONFIG),
        "--simulate",
        str(WORLD),
        "--trainer.accelerator",
        device,
        "--trainer.precision",
        precision,
        "--model.init_args.model.dtype",
        dtype,
        "--trainer.strategy",
        json.dumps(strategy),
        *extra,
        "--trainer.max_steps",
        "2",
        "--recorder.warmup_steps",
        "2",
        "--recorder.path",
        str(folder / "run.json"),
        "--trainer.default_root_dir",
        str(folder),
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--data.init_args.batch_size",
        "4",
        "--data.init_args.seq_len",
        "64",
        "--data.init_args.val_examples",
        "0",
    ]


def simulate(dimension: str, device: str, precision: str) -> dict:
    """One layout in this process; its outcome, whatever happens (the fake process group is left again)."""
    import torch.distributed as dist
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from lit_ablate.fit_cli import LitAblateCLI
    from lit_ablate.record import read_record

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"simulated-{dimension}-") as folder:
        try:
            LitAblateCLI(args=fit_arguments(dimension, device, precision, Path(folder)))
            record = read_record(Path(folder) / "run.json")
        except Exception as err:  # one layout's failure is its result, the others still run
            traceback.print_exc()
            return {"status": "failed", "error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            rank_zero_only.rank = 0
    return {"status": "ok", "seconds": time.perf_counter() - started, **measured(record)}


def measured(record: dict) -> dict:
    """The rank's peak tensor memory, how it was measured, and its categories against the estimate."""
    from lit_ablate.estimate.agreement import compare_with_measured
    from lit_ablate.estimate.from_config import estimate_for_config

    summary = record["summary"]
    out = {
        "peak_mib": (summary.get("peak_tensor_bytes") or 0) / 2**20,
        "tensor_method": summary.get("tensor_method"),
        "estimate": "not tracked",
    }
    breakdown = summary.get("tensor_breakdown")
    if breakdown:
        comparison = compare_with_measured(estimate_for_config(record["config"], WORLD, 0), breakdown)
        off = [f"{c} x{r['ratio']:.2f}" for c, r in comparison.items() if not r["agrees"] and r["ratio"]]
        out["estimate"] = "; ".join(off) if off else "agrees"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--device", choices=("cuda", "cpu", "auto"), default="auto", help="auto: cuda when present")
    parser.add_argument("--precision", default=None, help="default: bf16-true on cuda, 32-true on cpu")
    parser.add_argument("--only", default=None, help=f"comma-separated dimensions of {list(LAYOUTS)}")
    args = parser.parse_args(argv)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    accelerator = "gpu" if device == "cuda" else "cpu"
    precision = args.precision or ("bf16-true" if device == "cuda" else "32-true")
    dimensions = args.only.split(",") if args.only else list(LAYOUTS)
    unknown = sorted(set(dimensions) - set(LAYOUTS))
    if unknown:
        parser.error(f"--only: {unknown} are not dimensions; choose among {list(LAYOUTS)}")
    outcomes = {}
    for dimension in dimensions:
        outcome = outcomes[dimension] = simulate(dimension, accelerator, precision)
        if outcome["status"] != "ok":
            print(f"{dimension}: {outcome['error']}", flush=True)
            print(f"RESULT sim_{dimension}=failed", flush=True)
            continue
        print(f"RESULT sim_{dimension}=ok", flush=True)
        print(f"RESULT sim_{dimension}_seconds={outcome['seconds']:.1f}")
        print(f"RESULT sim_{dimension}_peak_mib={outcome['peak_mib']:.1f}")
        print(f"RESULT sim_{dimension}_estimate={outcome['estimate']}", flush=True)
    print(f"RESULT sim_device={torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} ({precision})")
    print(f"RESULT sim_dimensions_ok={sum(o['status'] == 'ok' for o in outcomes.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
