"""``lit-ablate peak``: this device's spec peak and measured matmul ceiling, the denominators of MFU."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch

from lit_ablate.estimate.matmul_ceiling import DTYPES, cache_path, device_name, measured_ceiling


def peak_main(argv: list[str]) -> int:
    """``lit-ablate peak [--device cuda:0] [--dtype bfloat16] [--threads N] [--remeasure] [--json]``.

    Prints the device's spec-sheet peak (when the table knows it) and its measured matmul ceiling:
    the two denominators of ``MFUMonitor``'s ``mfu`` and ``mfu_measured``.
    """
    from lit_ablate.errors import ConfigError
    from lit_ablate.estimate.peaks import PEAK_DTYPE, peak_tflops_of

    parser = argparse.ArgumentParser(
        prog="lit-ablate peak",
        allow_abbrev=False,
        description="This device's spec peak and measured matmul ceiling: MFUMonitor's two denominators.",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (default: cuda when there is one)",
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="matmul dtype (default: bfloat16 on a GPU, float32 on CPU)"
    )
    parser.add_argument("--threads", type=int, help="intra-op threads on CPU (default: torch's, as a run uses)")
    parser.add_argument(
        "--remeasure",
        action="store_true",
        help="measure again; the cache keeps the higher of the two, and never one measured under load",
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ConfigError("--device", args.device, "use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        raise ConfigError("--device", args.device, "use cpu, or cuda on a machine with a CUDA GPU")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError("--threads", args.threads, "use a positive number of threads")
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    name = device_name(device)
    spec = peak_tflops_of(name) if device.type == "cuda" else None
    ceiling = measured_ceiling(device, dtype, remeasure=args.remeasure)
    if args.json:
        print(
            json.dumps(
                {
                    "spec_peak_tflops": spec,
                    "spec_peak_dtype": PEAK_DTYPE,
                    "measured": asdict(ceiling),
                    "cache_file": str(cache_path(device, dtype)),
                },
                indent=1,
            )
        )
        return 0
    print(f"Device: {name} ({device.type})")
    print(
        f"Spec peak ({PEAK_DTYPE}, dense): "
        + (f"{spec:g} TFLOP/s" if spec else "unknown (not in the peak table; MFUMonitor's peak_tflops sets one)")
    )
    print(f"Measured ceiling: {ceiling.tflops:.4g} TFLOP/s ({ceiling.describe()})")
    if ceiling.doubt():
        print(f"Not cached: {ceiling.doubt()}; measure it again on an idle device (--remeasure)")
    if spec:
        print(f"Measured / spec: {ceiling.tflops / spec:.2f}")
    if not ceiling.doubt():
        print(
            f"Cached in {cache_path(device, dtype)} (--remeasure replaces it with a higher measurement; "
            "delete it to start over)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(peak_main(sys.argv[1:]))
