"""fp8 training (torchao float8 via ``model.fp8``): numerics on any device, speed and memory on a GPU.

Run by hand (never in CI):  OMP_NUM_THREADS=1 python benchmarks/fp8.py [--steps 20] [--seq-len 2048] [--no-compile]

1. Numerics (every device): one Qwen3-0.6B-shaped MLP projection (1024 -> 3072, ``--tokens`` rows
   of activations with a few outlier channels, as real hidden states have) in fp32, in bf16 and
   through each fp8 recipe (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``): the relative
   error (Frobenius norm of the difference over the fp32 norm) of the output, the input gradient
   and the weight gradient. Where fp8 kernels cannot run it is torchao's emulation, which rounds
   exactly as the kernels do and multiplies in fp32.
2. Speed and memory (a CUDA GPU of compute capability 8.9+ only; elsewhere one ``SKIP`` line with
   the reason): training steps (forward, backward, AdamW) of a Qwen3-0.6B-shaped model (28 layers,
   hidden 1024, vocab 151936) in bf16 against the same model with fp8 linear layers, micro-batch
   1 x ``--seq-len`` tokens, each decoder layer compiled (fp8 casts fuse only under
   ``torch.compile``); median step time after warm-up and peak allocated memory.

Ends with ``RESULT`` lines: ``fp8_<recipe>_<tensor>_rel_error`` and ``bf16_<tensor>_rel_error``;
on a GPU also ``fp8_<recipe>_speedup`` (bf16 step time / fp8 step time) and
``fp8_<recipe>_memory_ratio`` (fp8 peak / bf16 peak).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.fp8.conversion import RECIPES, Fp8Options, convert_fp8, fp8_kernels_unavailable

QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "tie_word_embeddings": True, "max_position_embeddings": 40960}  # fmt: skip


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


def step_time_and_memory(recipe: str | None, seq_len: int, steps: int, compile_layers: bool) -> tuple[float, int]:
    """Median step seconds after 3 warm-up steps, and peak allocated bytes, of the 0.6B shape in bf16."""
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    factory = ModelFactory(config=QWEN3_0_6B, dtype="bfloat16", fp8=Fp8Options(recipe=recipe) if recipe else None)
    with torch.device("cuda"):
        model = factory.build(device=torch.device("cuda"))
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, QWEN3_0_6B["vocab_size"], (1, seq_len), device="cuda")
    times = []
    for _ in range(steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    return statistics.median(times[3:]), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (after 3 warm-up steps)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per step (micro-batch 1)")
    parser.add_argument("--tokens", type=int, default=2048, help="activation rows of the numerics layer")
    parser.add_argument("--no-compile", action="store_true", help="eager decoder layers (fp8 casts then do not fuse)")
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    unavailable = fp8_kernels_unavailable(device)

    numerics = layer_numerics(device, args.tokens)
    kind = "emulated (fp32 matmuls of fp8-rounded operands)" if unavailable else "real fp8 kernels"
    print(f"Numerics: Qwen3-0.6B MLP projection 1024 -> 3072, {args.tokens} tokens, relative error vs fp32; fp8 {kind}")
    print("| precision | output | grad input | grad weight |\n|---|---|---|---|")
    for name, errors in numerics.items():
        print(f"| {name} | " + " | ".join(f"{errors[k]:.2e}" for k in ("output", "grad_input", "grad_weight")) + " |")

    speed: dict[str, tuple[float, int]] = {}
    if unavailable:
        print(f"SKIP fp8 step time and memory: {unavailable}; a CPU runs fp8 only emulated, with no speed or memory gain")
    else:
        for recipe in (None, *RECIPES):
            speed[recipe or "bf16"] = step_time_and_memory(recipe, args.seq_len, args.steps, not args.no_compile)
        print(f"\nQwen3-0.6B shape, 1 x {args.seq_len} tokens, {torch.cuda.get_device_name(device)}:")
        print("| variant | step (s) | peak allocated (GiB) |\n|---|---|---|")
        for name, (seconds, peak) in speed.items():
            print(f"| {name} | {seconds:.4f} | {peak / 2**30:.2f} |")

    for name, errors in numerics.items():
        for tensor, value in errors.items():
            print(f"RESULT {name}_{tensor}_rel_error={value:.4e}")
    for recipe in RECIPES if speed else ():
        print(f"RESULT fp8_{recipe}_speedup={speed['bf16'][0] / speed[recipe][0]:.3f}")
        print(f"RESULT fp8_{recipe}_memory_ratio={speed[recipe][1] / speed['bf16'][1]:.3f}")


if __name__ == "__main__":
    main()
