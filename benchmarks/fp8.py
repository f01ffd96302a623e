"""fp8 training (torchao float8 via ``model.fp8``): numerics on any device, speed and memory on a GPU.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    OMP_NUM_THREADS=1 python benchmarks/fp8.py [--steps 20] [--seq-len 2048] [--no-compile]
The GPU lane:
    python benchmarks/fp8.py --shape qwen3-8b --layers 4 --seq-len 8192 --steps 8 --recipes tensorwise rowwise

1. Numerics (every device): one Qwen3-0.6B-shaped MLP projection (1024 -> 3072, ``--tokens`` rows
   of activations with a few outlier channels, as real hidden states have) in fp32, in bf16 and
   through each fp8 recipe (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``): the relative
   error (Frobenius norm of the difference over the fp32 norm) of the output, the input gradient
   and the weight gradient. Where fp8 kernels cannot run it is torchao's emulation, which rounds
   exactly as the kernels do and multiplies in fp32.
2. Speed and memory (a CUDA GPU of compute capability 8.9+ only; elsewhere one ``SKIP`` line with
   the reason): training steps (forward, backward, AdamW) of a ``--shape`` model (default
   Qwen3-0.6B: 28 layers, hidden 1024, vocab 151936; ``qwen3-8b``: hidden 4096, where fp8 can pay
   for its casts, ``--layers`` of its 36) in bf16 against the same model with fp8 linear layers
   (``--recipes``), micro-batch 1 x ``--seq-len`` tokens, each decoder layer compiled (fp8 casts
   fuse only under ``torch.compile``); median step time after warm-up and peak allocated memory.
   One more step runs under the profiler and counts torch's fp8 matmuls (``_scaled_mm``): the
   record that real kernels ran, not the emulation. ``--timing-on-cpu`` runs this part on a CPU
   too (emulated: it checks the code path, its numbers mean nothing).

Ends with ``RESULT`` lines: ``fp8_<recipe>_<tensor>_rel_error`` and ``bf16_<tensor>_rel_error``;
on a GPU also ``fp8_<recipe>_speedup`` (bf16 step time / fp8 step time),
``fp8_<recipe>_memory_ratio`` (fp8 peak / bf16 peak), ``fp8_<recipe>_scaled_mm_per_step`` and
``fp8_kernels`` (``real`` when every fp8 variant ran ``_scaled_mm``, else ``emulated``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from model_shapes import model_config, shape_names
from torch import nn

from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.fp8.conversion import RECIPES, Fp8Options, convert_fp8, fp8_kernels_unavailable

FP8_KERNEL_TAGS = ("e4m3", "e5m2", "fp8", "f8f8", "float8")
"""Parts of GPU kernel names that mark fp8 matmuls (cuBLAS/CUTLASS), counted beside ``_scaled_mm``
calls in case inductor runs its own scaled-matmul template instead of calling the op."""


def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x.float() - reference).norm() / reference.norm()).item()


def layer_numerics(device: torch.device, tokens: int) -> dict[str, dict[str, float]]:
    """Relative errors of output, input gradient and weight gradient against fp32, per precision."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 1024, generator=gen)
    x[:, :8] *= 20  # a few outlier channels: what makes one scale per tensor lose precision
    weight = torch.randn(3072, 1024, generator=gen) * 0.02
    grad_out = torch.randn(tokens, 3072, generator=gen) * 1e-3

    def run(dtype: torch.dtype, recipe: str | None) -> tuple[torch.Tensor, ...]:
        layer = nn.Sequential(nn.Linear(1024, 3072, bias=False)).to(device)
        layer[0].weight.data.copy_(weight)
        layer = layer.to(dtype)
        if recipe is not None:
            convert_fp8(layer, Fp8Options(recipe=recipe, skip=[]), emulate=fp8_kernels_unavailable(device) is not None)
        xi = x.to(device, dtype).detach().requires_grad_()
        out = layer(xi)
        out.backward(grad_out.to(device, out.dtype))
        return out.detach().float().cpu(), xi.grad.float().cpu(), layer[0].weight.grad.float().cpu()

    reference = run(torch.float32, None)
    names = ("output", "grad_input", "grad_weight")
    rows = {"bf16": dict(zip(names, map(relative, run(torch.bfloat16, None), reference)))}
    for recipe in RECIPES:  # fp8 operands from bf16 weights and activations, as in a bf16 run
        rows[f"fp8_{recipe}"] = dict(zip(names, map(relative, run(torch.bfloat16, recipe), reference)))
    return rows


def step_time_and_memory(
    config: dict, recipe: str | None, seq_len: int, steps: int, compile_layers: bool, device: torch.device
) -> tuple[float, int | None, int]:
    """Median step seconds after 3 warm-up steps, peak allocated bytes (CUDA only) and the fp8
    matmuls of one more, profiled, step (``_scaled_mm`` calls, or fp8 GPU kernels if more); bf16 weights."""
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    torch.manual_seed(0)
    torch._dynamo.reset()  # the previous variant's compiled layers must not keep its model alive
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    factory = ModelFactory(config=config, dtype="bfloat16", fp8=Fp8Options(recipe=recipe) if recipe else None)
    with device:
        model = factory.build(device=device)
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_cuda)
    ids = torch.randint(0, config["vocab_size"], (1, seq_len), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for _ in range(steps + 3):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if on_cuda else None
    activities = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])]
    with torch.profiler.profile(activities=activities) as profile:
        step()
        sync()
    events = profile.key_averages()
    scaled_mm = sum(event.count for event in events if event.key.endswith("_scaled_mm"))
    fp8_kernels = sum(
        event.count
        for event in events
        if event.device_type == torch.autograd.DeviceType.CUDA
        and any(tag in event.key.lower() for tag in FP8_KERNEL_TAGS)
    )
    return statistics.median(times[3:]), peak, max(scaled_mm, fp8_kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (after 3 warm-up steps)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per step (micro-batch 1)")
    parser.add_argument("--tokens", type=int, default=2048, help="activation rows of the numerics layer")
    parser.add_argument("--no-compile", action="store_true", help="eager decoder layers (fp8 casts then do not fuse)")
    parser.add_argument("--shape", default="qwen3-0.6b", choices=shape_names(), help="the timed model's shape")
    parser.add_argument("--layers", type=int, help="decoder layers of the timed model (default: the shape's)")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES), help="fp8 variants timed")
    parser.add_argument(
        "--timing-on-cpu",
        action="store_true",
        help="time on a CPU too (emulated fp8: checks the code path; the numbers mean nothing)",
    )
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    unavailable = fp8_kernels_unavailable(device)
    config = model_config(args.shape, args.layers)

    numerics = layer_numerics(device, args.tokens)
    kind = "emulated (fp32 matmuls of fp8-rounded operands)" if unavailable else "real fp8 kernels"
    print(f"Numerics: Qwen3-0.6B MLP projection 1024 -> 3072, {args.tokens} tokens, relative error vs fp32; fp8 {kind}")
    print("| precision | output | grad input | grad weight |\n|---|---|---|---|")
    for name, errors in numerics.items():
        print(f"| {name} | " + " | ".join(f"{errors[k]:.2e}" for k in ("output", "grad_input", "grad_weight")) + " |")

    speed: dict[str, tuple[float, int | None, int]] = {}
    if unavailable and not args.timing_on_cpu:
        print(
            f"SKIP fp8 step time and memory: {unavailable}; a CPU runs fp8 only emulated, with no speed or memory gain"
        )
    else:
        for recipe in (None, *args.recipes):
            name = recipe or "bf16"
            speed[name] = step_time_and_memory(config, recipe, args.seq_len, args.steps, not args.no_compile, device)
            key = f"fp8_{recipe}" if recipe else "bf16"  # printed now: kept if a later variant runs out of time
            print(f"RESULT {key}_step_s={speed[name][0]:.4f}", flush=True)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU (emulated: {unavailable})"
        print(f"\n{args.shape} shape, {config['num_hidden_layers']} layers, 1 x {args.seq_len} tokens, {where}:")
        print("| variant | step (s) | tokens/s | peak allocated (GiB) | _scaled_mm per step |\n|---|---|---|---|---|")
        for name, (seconds, peak, scaled_mm) in speed.items():
            memory = f"{peak / 2**30:.2f}" if peak is not None else "n/a"
            print(f"| {name} | {seconds:.4f} | {args.seq_len / seconds:,.0f} | {memory} | {scaled_mm} |")

    for name, errors in numerics.items():
        for tensor, value in errors.items():
            print(f"RESULT {name}_{tensor}_rel_error={value:.4e}")
    if speed:
        print(f"RESULT bf16_tokens_per_s={args.seq_len / speed['bf16'][0]:.0f}")
    for recipe in args.recipes if speed else ():
        seconds, peak, scaled_mm = speed[recipe]
        print(f"RESULT fp8_{recipe}_speedup={speed['bf16'][0] / seconds:.3f}")
        print(f"RESULT fp8_{recipe}_tokens_per_s={args.seq_len / seconds:.0f}")
        if peak is not None:
            print(f"RESULT fp8_{recipe}_memory_ratio={peak / speed['bf16'][1]:.3f}")
        print(f"RESULT fp8_{recipe}_scaled_mm_per_step={scaled_mm}")
    if speed:
        print(f"RESULT fp8_kernels={'real' if all(speed[r][2] > 0 for r in args.recipes) else 'emulated'}")


if __name__ == "__main__":
    main()
