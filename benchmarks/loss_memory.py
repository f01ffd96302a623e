"""Peak memory and time of one forward+backward of the loss alone, per loss backend.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    python benchmarks/loss_memory.py [--full] [--dtype bfloat16]

Memory is the peak of tensor bytes allocated during forward+backward above what existed before
(the hidden states and LM-head weight are excluded; the gradients the loss produces are
included). CUDA: allocator statistics. CPU: ``torch.distributed._tools.mem_tracker.MemTracker``
(``torch.cuda.max_memory_allocated`` is 0 on CPU and ``tracemalloc`` cannot see tensor storage).
Time: wall clock, and on CPU also this process's CPU time, which the CPU time ratios use because
other jobs share the cores; the tracker's per-op cost is negligible against these matmuls.
Ratios compare backends measured side by side in this one run, repeats interleaved.

Rows: ``torch`` (reference), ``chunked`` (default options: gradients formed in the forward),
``chunked-recompute`` (``grad_in_forward: false``), ``liger`` and ``cce`` where they can run.
The default grid (hidden 1024, fp32, one repeat: V=32k x 4k tokens and the headline V=128k x
8k tokens) takes about 4 minutes on an idle 2-core CPU and needs ~13 GiB of RAM for the torch
reference. ``--full`` runs V in {32k, 128k} x tokens in {4k, 8k, 16k} x hidden in {1024, 4096}
(meant for a GPU: the torch reference at 16k x 128k needs ~24 GiB). ``--vocab``/``--tokens``
measure their own grid instead (the GPU lane: ``--vocab 151936 --tokens 16384 --dtype bfloat16``,
Qwen3's vocabulary). The last lines are, per backend at the headline point (V=128k, 8k tokens,
or the first ``--vocab`` x ``--tokens``; the first hidden size): ``RESULT <backend>_memory_ratio=``
and ``<backend>_time_ratio=`` against torch, ``<backend>_peak_mib=`` and ``<backend>_working_mib=``
(the peak minus the two gradients every backend returns, ``[V, H]`` and ``[N, H]``: the memory
the loss computation itself holds, which is what Cut Cross-Entropy's "24 GB -> 1 MB" counts).

Chunking sweeps (issue 38: Liger's own 64-token chunks re-read a 151,936 x 1,024 head 128 times per
8,192 tokens): ``--chunk-tokens 512 1024 4096`` measures ``chunked`` (and ``chunked-recompute``) at
each chunk size, ``--liger-chunk-tokens own 256 1024`` Liger at its own chunk and at each size,
``--liger-accum-dtype none float32`` each of those with the weight gradient summed in Liger's
default dtype and in fp32 (``loss_options`` ``chunk_tokens``/``accum_dtype``, docs/losses.md). A
swept row is named by its setting (``liger-chunk256-fp32acc``); the table's ``chunk`` column is the
tokens per chunk each row really used at its point, and a size Liger cannot make at a point is
skipped there with the reason. Per swept backend the last lines name the fastest setting at the
headline point: ``RESULT <backend>_best_chunk_tokens=`` (``own``: Liger's), ``_best_accum_dtype=``
(liger), ``_best_time_ratio=`` and ``_best_memory_ratio=`` against torch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import (
    ChunkedCrossEntropy,
    LigerFusedLinearCrossEntropy,
    LossBackend,
    check_loss_backend,
    liger_chunk,
    liger_chunk_budget,
    loss_backend,
)

K = 1024
HEADLINE = (128 * K, 8 * K)  # (vocab, tokens) of the RESULT lines
DEFAULT_POINTS = [(32 * K, 4 * K), HEADLINE]
FULL_POINTS = [(v, n) for v in (32 * K, 128 * K) for n in (4 * K, 8 * K, 16 * K)]
IGNORED_FRACTION = 0.1  # labels set to -100, as prompt/padding tokens would be
BENCHMARKED = {  # row name -> (registry name, options); chunking options come from the sweep arguments
    "torch": ("torch", {}),
    "chunked": ("chunked", {}),
    "chunked-recompute": ("chunked", {"grad_in_forward": False}),
    "liger": ("liger", {}),
    "cce": ("cce", {}),
}


@dataclass
class Measurement:
    vocab: int
    tokens: int
    hidden: int
    backend: str
    peak_bytes: int
    seconds: float  # wall-clock
    cpu_seconds: float  # this process's CPU time: robust to other jobs on a shared machine
    chunk: int | None  # tokens per chunk at this point (None: no token chunks)


def make_inputs(
    vocab: int, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=generator).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < IGNORED_FRACTION] = -100
    return h, w, labels.to(device)


def forward_backward(loss_fn: LossBackend, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> None:
    loss_fn(h, w, labels).backward()
    h.grad, w.grad = None, None


def measure_cuda(run: Callable[[], None], device: torch.device) -> tuple[int, float, float]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    run()
    torch.cuda.synchronize(device)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return torch.cuda.max_memory_allocated(device) - before, seconds, cpu_seconds


def measure_cpu(run: Callable[[], None], *inputs: torch.Tensor) -> tuple[int, float, float]:
    tracker = MemTracker()
    tracker.track_external(*inputs)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        start, cpu_start = time.perf_counter(), time.process_time()
        run()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - before, seconds, cpu_seconds


def measure_point(
    backends: dict[str, LossBackend],
    vocab: int,
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> list[Measurement]:
    """All backends on the same inputs, repeats interleaved so drifting machine load hits each alike."""
    h, w, labels = make_inputs(vocab, tokens, hidden, dtype, device)
    chunks = {}
    for name, loss_fn in list(backends.items()):
        try:
            chunks[name] = chunk_at(loss_fn, vocab, tokens, hidden)
        except ConfigError as error:
            print(f"skipping {name} at V={vocab} N={tokens} H={hidden}: {error}")
            backends = {n: f for n, f in backends.items() if n != name}
    samples: dict[str, list[tuple[int, float, float]]] = {name: [] for name in backends}
    for loss_fn in backends.values():
        for _ in range(warmup):
            forward_backward(loss_fn, h, w, labels)
    for _ in range(repeats):
        for name, loss_fn in backends.items():

            def run(loss_fn=loss_fn) -> None:
                forward_backward(loss_fn, h, w, labels)

            sample = measure_cuda(run, device) if device.type == "cuda" else measure_cpu(run, h, w, labels)
            samples[name].append(sample)
            print(
                f"measured {name} V={vocab} N={tokens} H={hidden}: {sample[0] / 2**20:.0f} MiB, "
                f"{sample[1]:.2f} s wall, {sample[2]:.2f} s cpu",
                flush=True,
            )
    return [
        Measurement(
            vocab,
            tokens,
            hidden,
            name,
            max(s[0] for s in runs),
            statistics.median(s[1] for s in runs),
            statistics.median(s[2] for s in runs),
            chunks[name],
        )
        for name, runs in samples.items()
    ]


def chunk_at(loss_fn: LossBackend, vocab: int, tokens: int, hidden: int) -> int | None:
    """Tokens per chunk ``loss_fn`` uses at this point; ``ConfigError`` for a Liger size it cannot make."""
    if isinstance(loss_fn, ChunkedCrossEntropy):
        return min(loss_fn.chunk_tokens, tokens)
    if isinstance(loss_fn, LigerFusedLinearCrossEntropy):
        budget = 1 if loss_fn.chunk_tokens is None else liger_chunk_budget(tokens, vocab, hidden, loss_fn.chunk_tokens)
        return liger_chunk(tokens, vocab, hidden, budget)
    return None


@dataclass(frozen=True)
class Row:
    """One measured backend setting: its name, registry name and options, and the sweep (family) it
    belongs to."""

    name: str
    backend: str
    options: dict
    family: str  # the BENCHMARKED row it varies
    swept: bool  # whether its family has several settings


def benchmark_rows(
    families: list[str],
    chunk_tokens: list[int],
    liger_chunk_tokens: list[int | None],
    liger_accum_dtypes: list[str | None],
) -> list[Row]:
    """Every setting to measure: each family once, ``chunked`` per chunk size, ``liger`` per chunk
    size and accumulation dtype. A setting is named by what it changes (``liger-chunk256-fp32acc``);
    the backend's default setting keeps the family's name (``liger``, ``chunked``)."""
    rows = []
    for family in families:
        name, options = BENCHMARKED[family]
        settings, default = [{}], {}
        if name == "chunked":
            settings, default = (
                [{"chunk_tokens": n} for n in chunk_tokens],
                {"chunk_tokens": ChunkedCrossEntropy.chunk_tokens},
            )
        elif name == "liger":
            settings = [
                {k: v for k, v in (("chunk_tokens", n), ("accum_dtype", a)) if v is not None}
                for n in liger_chunk_tokens
                for a in liger_accum_dtypes
            ]
        for setting in settings:
            label = family
            if len(settings) > 1 and setting != default:
                chunk, accum = setting.get("chunk_tokens"), setting.get("accum_dtype")
                label += f"-chunk{chunk}" if chunk is not None else ""
                label += f"-fp{accum.removeprefix('float')}acc" if accum else ""
            rows.append(Row(label, name, {**options, **setting}, family, len(settings) > 1))
    return rows


def available_backends(rows: list[Row]) -> dict[str, LossBackend]:
    """The requested settings that can run here; the others are reported and skipped."""
    backends = {}
    for row in rows:
        try:
            check_loss_backend(row.backend, **row.options)
        except ConfigError as error:
            print(f"skipping {row.name}: {error}")
            continue
        backends[row.name] = loss_backend(row.backend, **row.options)
    return backends


def best_settings(rows: list[Row], headline: dict[str, Measurement], device: torch.device) -> list[str]:
    """Per swept family measured at the headline point: RESULT lines naming its fastest setting (less
    memory breaks a tie) and that setting's time and memory against torch."""
    lines = []
    torch_run = headline.get("torch")
    for family in dict.fromkeys(row.family for row in rows if row.swept):
        measured = [(headline[row.name], row) for row in rows if row.family == family and row.name in headline]
        if not measured:
            continue
        run, row = min(measured, key=lambda pair: (timed_seconds(pair[0], device), pair[0].peak_bytes))
        key = family.replace("-", "_")
        chunk = row.options.get("chunk_tokens")
        lines.append(f"RESULT {key}_best_chunk_tokens={'own' if chunk is None else chunk}")
        if row.backend == "liger":
            lines.append(f"RESULT {key}_best_accum_dtype={row.options.get('accum_dtype') or 'none'}")
        if torch_run is not None:
            lines.append(
                f"RESULT {key}_best_time_ratio={timed_seconds(run, device) / timed_seconds(torch_run, device):.3f}"
            )
            lines.append(f"RESULT {key}_best_memory_ratio={run.peak_bytes / torch_run.peak_bytes:.4f}")
    return lines


def timed_seconds(m: Measurement, device: torch.device) -> float:
    """The time ratios use CPU time on CPU (other jobs share the cores) and wall time on CUDA."""
    return m.seconds if device.type == "cuda" else m.cpu_seconds


def markdown_table(rows: list[Measurement], dtype: torch.dtype, device: torch.device) -> str:
    reference = {(r.vocab, r.tokens, r.hidden): r for r in rows if r.backend == "torch"}
    lines = [
        "| device | dtype | vocab | tokens | hidden | backend | chunk | peak MiB | memory × torch "
        "| wall s | cpu s | time × torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = reference.get((r.vocab, r.tokens, r.hidden))
        mem_ratio = f"{r.peak_bytes / ref.peak_bytes:.3f}" if ref else "n/a"
        time_ratio = f"{timed_seconds(r, device) / timed_seconds(ref, device):.2f}" if ref else "n/a"
        lines.append(
            f"| {device.type} | {str(dtype).removeprefix('torch.')} | {r.vocab} | {r.tokens} | {r.hidden} "
            f"| {r.backend} | {r.chunk or '—'} | {r.peak_bytes / 2**20:.0f} | {mem_ratio} | {r.seconds:.2f} "
            f"| {r.cpu_seconds:.2f} | {time_ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the whole grid (GPU-sized)")
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=None, help="hidden sizes (default 1024; --full: 1024 4096)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backends", nargs="+", default=list(BENCHMARKED), choices=list(BENCHMARKED))
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        nargs="+",
        default=[1024],
        help="chunked backend's chunk_tokens (several: one row per size)",
    )
    parser.add_argument(
        "--liger-chunk-tokens",
        type=_chunk_setting,
        nargs="+",
        default=[None],
        help="liger's chunk_tokens: powers of two, or 'own' for Liger's own choice (default)",
    )
    parser.add_argument(
        "--liger-accum-dtype",
        type=_accum_setting,
        nargs="+",
        default=[None],
        help="liger's accum_dtype: 'none' (the weight's dtype, default) and/or float32",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per point (default: cpu 1, cuda 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, nargs="+", help="vocabulary sizes (with --tokens: this grid only)")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts (with --vocab: this grid only)")
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hidden_sizes = args.hidden or ([1024, 4096] if args.full else [1024])
    points = FULL_POINTS if args.full else DEFAULT_POINTS
    headline_point = HEADLINE
    if args.vocab or args.tokens:
        vocabs, token_counts = args.vocab or [HEADLINE[0]], args.tokens or [HEADLINE[1]]
        points = [(v, n) for v in vocabs for n in token_counts]
        headline_point = points[0]
    on_cuda = device.type == "cuda"
    repeats = args.repeats or (3 if on_cuda else 1)
    warmup = 1 if on_cuda else 0  # CUDA: Triton autotuning and cuBLAS handles; CPU: it would cost minutes
    rows = benchmark_rows(args.backends, args.chunk_tokens, args.liger_chunk_tokens, args.liger_accum_dtype)
    backends = available_backends(rows)
    for loss_fn in backends.values():  # thread pools, allocator, kernel compilation
        try:
            chunk_at(loss_fn, 1024, 256, 64)
        except ConfigError:  # a Liger size this tiny shape cannot make: judged at each point
            continue
        forward_backward(loss_fn, *make_inputs(1024, 256, 64, dtype, device))

    measured = [
        m
        for hidden in hidden_sizes
        for vocab, tokens in points
        for m in measure_point(backends, vocab, tokens, hidden, dtype, device, warmup, repeats)
    ]
    print()
    print(f"{device.type}, {torch.get_num_threads()} threads, torch {torch.__version__}, repeats={repeats}")
    print(markdown_table(measured, dtype, device))
    headline = {m.backend: m for m in measured if (m.vocab, m.tokens) == headline_point and m.hidden == hidden_sizes[0]}
    for name, run in headline.items():
        gradients = (run.vocab + run.tokens) * run.hidden * dtype.itemsize  # d weight [V, H] and d hidden [N, H]
        print(f"RESULT {name}_peak_mib={run.peak_bytes / 2**20:.1f}")
        print(f"RESULT {name}_working_mib={(run.peak_bytes - gradients) / 2**20:.1f}")
        if name != "torch" and "torch" in headline:
            torch_run = headline["torch"]
            print(f"RESULT {name}_memory_ratio={run.peak_bytes / torch_run.peak_bytes:.4f}")
            print(f"RESULT {name}_time_ratio={timed_seconds(run, device) / timed_seconds(torch_run, device):.3f}")
    for line in best_settings(rows, headline, device):
        print(line)


def _chunk_setting(value: str) -> int | None:
    return None if value == "own" else int(value)


def _accum_setting(value: str) -> str | None:
    return None if value == "none" else value


if __name__ == "__main__":
    main()
