"""Context-parallel attention (ring, all-gather) against one-process SDPA: time and memory per rank.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    python benchmarks/ring_attention.py [--lengths 2048 4096 8192] [--cp 2 4] [--repeats 3]
    python benchmarks/ring_attention.py --device cuda --dtype bfloat16 --lengths 8192 16384 32768 --cp 2 4 \
        --block-kernels sdpa flash_attn flex

One causal attention call of a Llama-like shape (batch 1, 8 query heads, 2 key/value heads (GQA),
head dim 64, fp32): forward and backward of a random output gradient, over ``L`` tokens. Rows:

- ``sdpa``: one process, torch's SDPA on the whole sequence (the reference);
- ``ring cp=N`` / ``allgather cp=N``: N gloo ranks (processes), zigzag layout, each holding L/N
  tokens, through the attention backend exactly as transformers calls it in training (segment
  exchange and chunk masks included).

Columns: per rank, the CPU time of one call (median over repeats, the busiest rank) and, beside
it, its share of the one-process time (ideal: 1/N); the wall time of the slowest rank (what a
training step waits for); the peak of tensor memory during one call (MemTracker, measured in
an extra untimed call) and its share of the one-process peak. Every CP row is checked against
SDPA at the first length before anything is timed (max |difference| of output and gradients).
Every process uses one thread. CPU time is the honest measure on a shared 2-core machine: 4 ranks
on 2 cores wait for each other, which stretches wall time but not the work each does; on a
machine with a core per rank the wall time approaches the CPU time.

``--device cuda``: one GPU per rank (NCCL), the one-process row on GPU 0 (torch's SDPA, which
picks flash attention for half precision); the time columns are then GPU wall time (synchronised,
not CPU time) and memory is ``torch.cuda.max_memory_allocated`` during the call.
``--block-kernels``: the ``cp_block_kernel`` of each CP row (``sdpa`` by default; ``flash_attn``
and ``flex`` on CUDA make the seed's FA2 / flex rows); a kernel that cannot run here prints a skip
line with its reason.

The last lines are ``RESULT <impl>_cp<N>_time_share_L<L>=`` and ``..._memory_share_L<L>=`` at the
longest length (``<impl>_<kernel>_cp<N>...`` for a kernel other than sdpa): a rank's CPU time and
peak memory over the one-process call's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from lit_ablate.errors import ConfigError
from lit_ablate.models.attention.block_kernels import BLOCK_KERNELS, block_kernel
from lit_ablate.models.attention.context_parallel import (
    CONTEXT_PARALLEL_ATTRIBUTE,
    CONTEXT_PARALLEL_BACKENDS,
    ContextParallelGroup,
)
from lit_ablate.models.attention.sequence_layout import SequenceLayout

BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 8, 2, 64


def whole_inputs(length: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(length)
    x = {
        "q": torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen),
        "k": torch.randn(BATCH, KV_HEADS, length, HEAD_DIM, generator=gen),
        "v": torch.randn(BATCH, KV_HEADS, length, HEAD_DIM, generator=gen),
        "grad": torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen),
    }
    return {name: t.to(device, dtype) for name, t in x.items()}


def sdpa_call(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
    if q.is_cuda:  # not every CUDA SDPA kernel takes GQA: the one-process row expands K/V itself
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not q.is_cuda)
    out.backward(x["grad"])
    return out.detach(), q.grad, k.grad, v.grad


def peak_bytes(call, device: str = "cpu") -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    tracker = MemTracker()
    with tracker:
        call()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


def measure(call, repeats: int, barrier=None, device: str = "cpu") -> tuple[float, float]:
    """Median (work seconds, wall seconds) of ``call`` over ``repeats``, after one warm-up call.
    Work is CPU time on CPU and the synchronised wall time on a GPU."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    call()
    work, wall = [], []
    for _ in range(repeats):
        if barrier:
            barrier()
        sync()
        c0, w0 = time.process_time(), time.perf_counter()
        call()
        sync()
        wall.append(time.perf_counter() - w0)
        work.append(wall[-1] if device == "cuda" else time.process_time() - c0)
    return statistics.median(work), statistics.median(wall)


def _rank(
    rank: int,
    world: int,
    impl: str,
    kernel: str,
    lengths: list[int],
    repeats: int,
    port: int,
    out_dir: str,
    device: str,
    dtype: str,
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    layout = SequenceLayout("zigzag", world)
    module = nn.Module()
    group = ContextParallelGroup(dist.group.WORLD, layout, rank, block_kernel(kernel, torch.device(device)))
    setattr(module, CONTEXT_PARALLEL_ATTRIBUTE, group)
    backend = CONTEXT_PARALLEL_BACKENDS[impl]
    results = {}
    for index, length in enumerate(lengths):
        x = {n: layout.shard(t, rank, dim=2) for n, t in whole_inputs(length, device, getattr(torch, dtype)).items()}
        positions = layout.shard(torch.arange(length, device=device)[None], rank)

        def call(x=x, positions=positions):
            q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
            out, _ = backend(module, q, k, v, None, position_ids=positions)
            out.transpose(1, 2).backward(x["grad"])
            return out.transpose(1, 2).detach(), q.grad, k.grad, v.grad

        if index == 0:  # correct before timed: against SDPA on the whole sequence
            mine = call()
            whole = sdpa_call(whole_inputs(length, device, getattr(torch, dtype)))
            error = max((m - layout.shard(w, rank, dim=2)).abs().max().item() for m, w in zip(mine, whole))
        else:
            error = None
        cpu, wall = measure(call, repeats, barrier=dist.barrier, device=device)
        dist.barrier()
        results[length] = {"cpu_s": cpu, "wall_s": wall, "peak_bytes": peak_bytes(call, device), "max_error": error}
    Path(out_dir, f"{impl}-{kernel}-{world}-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--impls", nargs="+", default=sorted(CONTEXT_PARALLEL_BACKENDS))
    parser.add_argument("--block-kernels", nargs="+", default=["sdpa"], choices=list(BLOCK_KERNELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < max(args.cp):
        raise SystemExit(
            f"--device cuda needs a GPU per rank: {torch.cuda.device_count()} GPUs for cp up to {max(args.cp)}"
        )
    for n in args.cp:
        if any(length % (2 * n) for length in args.lengths):
            raise SystemExit(f"--lengths must be multiples of 2 x cp = {2 * n} (zigzag)")
    kernels = []
    for kernel in args.block_kernels:
        try:
            block_kernel(kernel, torch.device(args.device))
            kernels.append(kernel)
        except ConfigError as err:
            print(f"skipped: cp_block_kernel {kernel}: {err}")
    torch.set_num_threads(1)
    reference = {}
    for length in args.lengths:
        x = whole_inputs(length, args.device, getattr(torch, args.dtype))
        cpu, wall = measure(lambda x=x: sdpa_call(x), args.repeats, device=args.device)
        reference[length] = {
            "cpu_s": cpu,
            "wall_s": wall,
            "peak_bytes": peak_bytes(lambda x=x: sdpa_call(x), args.device),
        }
    del x  # the one-process tensors leave GPU 0 before rank 0 starts there
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for impl in args.impls:
            for kernel in kernels:
                for world in args.cp:
                    mp.start_processes(
                        _rank,
                        args=(
                            world,
                            impl,
                            kernel,
                            args.lengths,
                            args.repeats,
                            free_port(),
                            out_dir,
                            args.device,
                            args.dtype,
                        ),
                        nprocs=world,
                        start_method="spawn",
                    )
                    ranks = [
                        json.loads(Path(out_dir, f"{impl}-{kernel}-{world}-{r}.json").read_text()) for r in range(world)
                    ]
                    rows.append((impl if kernel == "sdpa" else f"{impl}_{kernel}", world, ranks))
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"1 thread per process, {os.cpu_count()} CPUs"
    print(
        f"torch {torch.__version__}, {where}; batch {BATCH}, {HEADS} heads ({KV_HEADS} kv), head dim {HEAD_DIM}, "
        f"{args.dtype}, causal, forward + backward; medians of {args.repeats}\n"
    )
    work = "GPU s" if args.device == "cuda" else "CPU s"
    print(
        f"| length | row | {work} / rank (busiest) | share of sdpa | wall s (slowest rank) | peak MiB / rank | "
        "share of sdpa | max abs error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        ref = reference[length]
        print(
            f"| {length} | sdpa | {ref['cpu_s']:.3f} | 1 | {ref['wall_s']:.3f} | "
            f"{ref['peak_bytes'] / 2**20:.1f} | 1 | |"
        )
        for impl, world, ranks in rows:
            per = [r[str(length)] for r in ranks]
            cpu, wall, peak = (
                max(p["cpu_s"] for p in per),
                max(p["wall_s"] for p in per),
                max(p["peak_bytes"] for p in per),
            )
            errors = [p["max_error"] for p in per if p["max_error"] is not None]
            error = f"{max(errors):.1e}" if errors else ""
            print(
                f"| {length} | {impl} cp={world} | {cpu:.3f} | {cpu / ref['cpu_s']:.2f} | {wall:.3f} | "
                f"{peak / 2**20:.1f} | {peak / ref['peak_bytes']:.2f} | {error} |"
            )
    longest = args.lengths[-1]
    print()
    for impl, world, ranks in rows:
        per = [r[str(longest)] for r in ranks]
        ref = reference[longest]
        print(f"RESULT {impl}_cp{world}_time_share_L{longest}={max(p['cpu_s'] for p in per) / ref['cpu_s']:.3f}")
        print(
            f"RESULT {impl}_cp{world}_memory_share_L{longest}="
            f"{max(p['peak_bytes'] for p in per) / ref['peak_bytes']:.3f}"
        )


if __name__ == "__main__":
    main()
