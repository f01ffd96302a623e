"""Peak memory of DPO's log-prob + loss computation: ``torch`` against ``chunked`` log-probs and ``liger``.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    python benchmarks/dpo_memory.py [--tokens 1024] [--chunk-tokens 128] [--backends ...]
On a GPU (the GPU lane):
    python benchmarks/dpo_memory.py --tokens 15360 --chunk-tokens 1024  (--device cuda)

At the LM-head sizes of the seed study (Qwen3-32B: hidden 5120, vocabulary 151,936, fp32), one
forward + backward of: per-token label log-probs from the final hidden states and the LM-head
weight, per-sequence sums, the sigmoid DPO loss over the pairs (reference log-probs given), and
its gradients with respect to the hidden states and the weight. The seed study used 10k chosen +
5k rejected tokens; this machine (2 cores, ~20 GiB free) runs ``--tokens`` split the same way
(2/3 chosen, 1/3 rejected, over 4 pairs, a fifth of each sequence a masked prompt): 1,024 by
default, where the torch reference needs ~8 GiB and ~2 minutes. On a GPU use the seed's 15k tokens.

``liger`` (``lit_ablate.models.losses.liger_dpo``: Liger-Kernel's fused linear DPO, plain torch, so it
runs on CPU too; skipped when liger-kernel is not installed) takes the same sequences padded to
the longest (``[2 x pairs, longest, hidden]``: its only layout) and no reference (it cannot take
precomputed log-probs; a frozen reference adds its hidden states and a no-grad chunk), one pair
per chunk (``chunk_pairs: 1``, its default): its peak is one chunk's full-vocabulary logits, their
log-softmax and gradient, beside the gradients it forms in the forward.

Memory (CPU: ``torch.distributed._tools.mem_tracker.MemTracker``, tensor bytes; CUDA: allocator
peak) is the peak allocated during forward + backward above the inputs (hidden states, weight,
labels). Two numbers per backend:

- ``peak``: everything, including the gradients the computation produces (``d weight`` is
  vocabulary x hidden fp32 = 3.1 GB here, the same for every backend);
- ``working``: ``peak`` minus those two gradients, i.e. what the log-prob computation itself
  holds at that moment (chunked: one chunk of logits and the log-sum-exp; torch: its peak comes
  in the backward once ``d weight`` exists, beside one ``[tokens, vocab]`` fp32 gradient of the
  logits; its forward held two such buffers, logits and log-softmax, before any gradient existed,
  so this is the conservative comparison). The gradients are the parameter/activation gradients
  any training step holds, so ``working`` is what a backend choice changes:
  ``RESULT dpo_chunked_memory_ratio`` is its ratio (goal <= 0.15); ``RESULT
  dpo_chunked_peak_ratio`` is the ratio of ``peak``.

Measured on the 2-core CPU (1,024 tokens asked: 1,020 in 4 pairs; chunk_tokens 128, chunk_pairs 1)::

    | backend | peak above inputs (GiB) | working: peak - gradients (GiB) | wall (s) | cpu (s) |
    | torch   | 3.495 | 0.577 | 30.3 | 56.4 |
    | chunked | 2.990 | 0.072 | 74.1 | 95.4 |
    | liger   | 6.406 | 3.482 | 42.9 | 81.7 |
    RESULT dpo_chunked_memory_ratio=0.126
    RESULT dpo_chunked_peak_ratio=0.856
    RESULT dpo_liger_memory_ratio=6.031
    RESULT dpo_chunked_vs_liger_memory_ratio=0.021

Liger's working memory is a second ``[vocab, hidden]`` weight gradient (``torch.func`` returns each
chunk's beside Liger's accumulator) plus one chunk's full-vocabulary logits.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lit_ablate.models.losses.liger_dpo import LigerDPOLoss
from lit_ablate.models.losses.logprobs import logprob_backend
from lit_ablate.modules.preference_loss import PreferenceLoss

HIDDEN, VOCAB = 5120, 151_936  # the defaults of --hidden and --vocab
PAIRS = 4
PROMPT_SHARE = 0.2


def make_inputs(
    tokens: int, hidden: int = HIDDEN, vocab: int = VOCAB, device: str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Hidden states, weight, shifted labels and the sequence index of each token (4 pairs,
    chosen sequences twice the length of rejected ones, a prompt share of each masked)."""
    generator = torch.Generator().manual_seed(seed)
    chosen, rejected = [tokens * 2 // 3 // PAIRS] * PAIRS, [tokens // 3 // PAIRS] * PAIRS
    lengths = chosen + rejected
    sequence_ids = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
    labels = torch.randint(0, vocab, (len(sequence_ids),), generator=generator)
    start = 0
    for n in lengths:
        labels[start : start + int(n * PROMPT_SHARE)] = -100
        start += n
    tensors = {
        "hidden": torch.randn(len(labels), hidden, generator=generator),
        "weight": torch.randn(vocab, hidden, generator=generator) * 0.02,
        "labels": labels,
        "sequence_ids": sequence_ids,
        "reference": -torch.rand(2 * PAIRS, generator=generator) * 10,
    }
    tensors = {name: t.to(device) for name, t in tensors.items()}
    tensors["hidden"].requires_grad_()
    tensors["weight"].requires_grad_()
    return tensors


def logprob_and_loss(backend, inputs: dict[str, torch.Tensor]) -> None:
    per_token = backend(inputs["hidden"], inputs["weight"], inputs["labels"])
    logps = per_token.new_zeros(2 * PAIRS).index_add(0, inputs["sequence_ids"], per_token)
    counts = torch.bincount(inputs["sequence_ids"][inputs["labels"] != -100], minlength=2 * PAIRS)
    ref = inputs["reference"]
    result = PreferenceLoss("sigmoid", beta=0.1)(
        logps[:PAIRS], logps[PAIRS:], ref[:PAIRS], ref[PAIRS:], counts[:PAIRS], counts[PAIRS:]
    )
    result.losses.mean().backward()


def padded(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same sequences as ``[2 x pairs, longest]`` rows (Liger's layout), padding labelled -100."""
    sequences = inputs["sequence_ids"]
    lengths = torch.bincount(sequences, minlength=2 * PAIRS)
    longest = int(lengths.max())
    position = (
        torch.arange(len(sequences), device=sequences.device) - torch.cumsum(lengths, 0)[sequences] + lengths[sequences]
    )
    hidden = inputs["hidden"].new_zeros(2 * PAIRS, longest, inputs["hidden"].shape[-1])
    hidden[sequences, position] = inputs["hidden"].detach()
    labels = torch.full((2 * PAIRS, longest), -100, device=sequences.device)
    labels[sequences, position] = inputs["labels"]
    return {"hidden": hidden.requires_grad_(), "weight": inputs["weight"], "labels": labels}


def liger_loss(options: dict, inputs: dict[str, torch.Tensor]) -> None:
    step = LigerDPOLoss(beta=0.1, loss_type="sigmoid", **options)(
        inputs["hidden"], inputs["weight"], inputs["labels"], None, None
    )
    (step.loss_sum / PAIRS).backward()


def measure(name: str, options: dict, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
    if name == "liger":
        inputs = padded(inputs)
        run = lambda: liger_loss(options, inputs)  # noqa: E731
    else:
        backend = logprob_backend(name, **options)
        run = lambda: logprob_and_loss(backend, inputs)  # noqa: E731
    inputs["hidden"].grad = inputs["weight"].grad = None
    if inputs["hidden"].device.type == "cuda":
        return _measure_cuda(run, inputs)
    cpu = torch.device("cpu")
    tracker = MemTracker()
    tracker.track_external(inputs["hidden"], inputs["weight"], inputs["labels"])
    with tracker:
        before = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        start, cpu_start = time.perf_counter(), time.process_time()
        run()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = tracker.get_tracker_snapshot("peak")[cpu]["Total"] - before
    gradients = sum(t.grad.numel() * t.grad.element_size() for t in (inputs["hidden"], inputs["weight"]))
    return {"peak": peak, "working": peak - gradients, "seconds": seconds, "cpu_seconds": cpu_seconds}


def _measure_cuda(run, inputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """The allocator's peak above what existed before (the inputs), as the CPU branch counts it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start, cpu_start = time.perf_counter(), time.process_time()
    run()
    torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = torch.cuda.max_memory_allocated() - before
    gradients = sum(t.grad.numel() * t.grad.element_size() for t in (inputs["hidden"], inputs["weight"]))
    return {"peak": peak, "working": peak - gradients, "seconds": seconds, "cpu_seconds": cpu_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of all sequences together")
    parser.add_argument("--chunk-tokens", type=int, default=128, help="chunked: tokens per chunk")
    parser.add_argument("--chunk-vocab", type=int, default=None, help="chunked: vocabulary columns per chunk")
    parser.add_argument("--chunk-pairs", type=int, default=1, help="liger: pairs per chunk")
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["torch", "chunked", "liger"],
        choices=["torch", "chunked", "liger"],
        help="rows to measure (liger: when installed)",
    )
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="LM-head width (default: Qwen3-32B's)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary (default: Qwen3's)")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: the allocator's peak (the GPU lane runs --tokens 15360, the seed's size)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    inputs = make_inputs(args.tokens, args.hidden, args.vocab, args.device)
    options = {
        "torch": {},
        "chunked": {"chunk_tokens": args.chunk_tokens, "chunk_vocab": args.chunk_vocab},
        "liger": {"chunk_pairs": args.chunk_pairs},
    }
    liger_missing = importlib.util.find_spec("liger_kernel") is None
    rows = {
        name: measure(name, options[name], inputs) for name in args.backends if not (name == "liger" and liger_missing)
    }
    gib = 2**30
    print(
        f"DPO log-prob + loss, hidden {args.hidden}, vocabulary {args.vocab}, fp32, {len(inputs['labels'])} tokens "
        f"({PAIRS} pairs), chunk_tokens {args.chunk_tokens}, chunk_vocab {args.chunk_vocab}\n"
    )
    print("| backend | peak above inputs (GiB) | working: peak - gradients (GiB) | wall (s) | cpu (s) |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['peak'] / gib:.3f} | {row['working'] / gib:.3f} | {row['seconds']:.1f} | "
            f"{row['cpu_seconds']:.1f} |"
        )
    if {"torch", "chunked"} <= set(rows):
        print(f"\nRESULT dpo_chunked_memory_ratio={rows['chunked']['working'] / rows['torch']['working']:.3f}")
        print(f"RESULT dpo_chunked_peak_ratio={rows['chunked']['peak'] / rows['torch']['peak']:.3f}")
    if {"torch", "chunked", "liger"} <= set(rows):
        print(f"RESULT dpo_liger_memory_ratio={rows['liger']['working'] / rows['torch']['working']:.3f}")
        print(f"RESULT dpo_chunked_vs_liger_memory_ratio={rows['chunked']['working'] / rows['liger']['working']:.3f}")


if __name__ == "__main__":
    main()
