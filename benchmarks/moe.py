"""Time of one MoE layer's forward + backward, per experts implementation, side by side.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    python benchmarks/moe.py [--dtype bfloat16] [--repeats N] [--device cuda]

One layer = router + top-k routing + experts + combine, as ``MoEBlock`` runs it in training
(auxiliary losses included), on random hidden states; the gradient flows to the input, the
router and every expert. Rows:

- ``loop``: lit-ablate's reference, one matmul per expert and projection;
- ``grouped``: lit-ablate's ``torch._grouped_mm`` path (or its padded-bmm fallback, flagged);
- ``hf-eager`` / ``hf-grouped_mm``: transformers' own Qwen3-MoE block with its ``eager``
  (per-expert masks) and ``grouped_mm`` experts implementations, for reference.

Shapes: ``tiny`` (the ``tiny-qwen3-moe`` preset: 8 experts, top-2, hidden 128) and ``30b-a3b``,
Qwen3-30B-A3B's routing (128 experts, top-8) with its hidden and expert sizes scaled by 1/4 (2048
-> 512, 768 -> 192) to fit a CPU; ``--shapes 30b-a3b-layer`` is the real layer (hidden 2048, expert
width 768, 8,192 tokens: a GPU's, run by the GPU lane in bf16). Every row is checked against
``loop`` before it is timed.
Time: on CPU, this process's CPU time (other jobs stretch wall time unevenly on a shared machine);
on CUDA, wall time after synchronising. Repeats are interleaved across rows, medians reported.
The last line is ``RESULT grouped_speedup=`` (loop time / grouped time) at the last shape measured
(``30b-a3b`` by default).
Default: fp32, 2048 tokens (30b-a3b) and 512 tokens (tiny), 3 repeats: about 2 minutes on an
idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lit_ablate.models.moe.blocks import MoEOptions, apply_moe, experts_fallbacks

SHAPES: dict[str, dict[str, int]] = {  # name -> hidden, expert intermediate, experts, top-k, tokens
    "tiny": {"hidden": 128, "intermediate": 96, "experts": 8, "top_k": 2, "tokens": 512},
    "30b-a3b": {"hidden": 512, "intermediate": 192, "experts": 128, "top_k": 8, "tokens": 2048},
    "30b-a3b-layer": {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "tokens": 8192},
}
DEFAULT_SHAPES = ("tiny", "30b-a3b")
ROWS = ("loop", "grouped", "hf-eager", "hf-grouped_mm")


@dataclass
class Timing:
    shape: str
    row: str
    seconds: list[float]
    tokens: int
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def build_rows(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> dict[str, nn.Module]:
    """The same layer (same weights) under each implementation."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=shape["hidden"],
        moe_intermediate_size=shape["intermediate"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"],
        norm_topk_prob=True,
        experts_implementation="eager",
    )
    hf = Qwen3MoeSparseMoeBlock(config)
    for p in hf.parameters():
        nn.init.normal_(p, std=0.02)
    hf = hf.to(device, dtype).train()
    hf_grouped = copy.deepcopy(hf)
    hf_grouped.experts.config._experts_implementation = "grouped_mm"
    rows: dict[str, nn.Module] = {"hf-eager": hf, "hf-grouped_mm": hf_grouped}
    for experts in ("loop", "grouped"):
        container = nn.Sequential(copy.deepcopy(hf))
        apply_moe(container, MoEOptions(experts=experts, load_balance_weight=0.01))
        rows[experts] = container
    return rows


def forward_backward(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    out = layer(x)
    out.backward(grad_out)
    layer.zero_grad(set_to_none=True)
    return out.detach()


def timed(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    start = time.process_time()
    run()
    return time.process_time() - start


def measure_shape(
    name: str, dtype: torch.dtype, device: torch.device, repeats: int, tokens: int | None
) -> list[Timing]:
    shape = {**SHAPES[name], **({"tokens": tokens} if tokens else {})}
    rows = build_rows(shape, dtype, device)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, shape["tokens"], shape["hidden"], generator=generator).to(device, dtype)
    grad_out = torch.randn(1, shape["tokens"], shape["hidden"], generator=generator).to(device, dtype)
    reference = forward_backward(rows["loop"], x, grad_out)
    tolerance = {"atol": 1e-4, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for row, layer in rows.items():  # also the warm-up
        torch.testing.assert_close(forward_backward(layer, x, grad_out), reference, **tolerance, msg=row)
    timings = {row: Timing(name, row, [], shape["tokens"]) for row in rows}
    for _ in range(repeats):
        for row, layer in rows.items():
            timings[row].seconds.append(timed(lambda layer=layer: forward_backward(layer, x, grad_out), device))
    fallback = experts_fallbacks(rows["grouped"])
    if fallback:
        timings["grouped"].note = f"padded bmm ({fallback[0]})"
    return [timings[row] for row in ROWS]


def markdown_table(timings: list[Timing], device: torch.device) -> str:
    clock = "wall" if device.type == "cuda" else "cpu"
    lines = [
        f"| shape | experts, top-k | tokens | row | {clock} ms (median) | speedup vs loop | note |",
        "|---|---|---|---|---|---|---|",
    ]
    loop = {t.shape: t.median for t in timings if t.row == "loop"}
    for t in timings:
        s = SHAPES[t.shape]
        lines.append(
            f"| {t.shape} | {s['experts']}, {s['top_k']} | {t.tokens} | {t.row} | {1e3 * t.median:.1f} | "
            f"{loop[t.shape] / t.median:.2f} | {t.note} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per layer call (default: per shape)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=list(DEFAULT_SHAPES),
        choices=list(SHAPES),
        help="shapes to measure; the RESULT lines' headline is the last",
    )
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    timings = [t for name in args.shapes for t in measure_shape(name, dtype, device, args.repeats, args.tokens)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"MoE layer forward + backward, {args.dtype}, {name}, torch {torch.__version__}, {args.repeats} repeats\n")
    print(markdown_table(timings, device))
    print()
    by_row = {(t.shape, t.row): t.median for t in timings}
    headline = args.shapes[-1]
    if "tiny" in args.shapes and headline != "tiny":
        print(f"RESULT grouped_speedup_tiny={by_row['tiny', 'loop'] / by_row['tiny', 'grouped']:.2f}")
    grouped_note = next(t.note for t in timings if (t.shape, t.row) == (headline, "grouped"))
    print(f"RESULT grouped_fallback={grouped_note or 'none'}")
    print(f"RESULT grouped_ms={1e3 * by_row[headline, 'grouped']:.2f}")
    print(f"RESULT loop_ms={1e3 * by_row[headline, 'loop']:.2f}")
    print(f"RESULT hf_eager_ms={1e3 * by_row[headline, 'hf-eager']:.2f}")
    print(
        f"RESULT grouped_speedup_vs_hf_grouped_mm={by_row[headline, 'hf-grouped_mm'] / by_row[headline, 'grouped']:.2f}"
    )
    print(f"RESULT grouped_speedup_vs_hf_eager={by_row[headline, 'hf-eager'] / by_row[headline, 'grouped']:.2f}")
    print(f"RESULT grouped_speedup={by_row[headline, 'loop'] / by_row[headline, 'grouped']:.2f}")


if __name__ == "__main__":
    main()
