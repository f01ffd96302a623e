"""MFU on CPU against the measured matmul ceiling: `lit-ablate fit` beside a hand-written loop.

A dense Llama-shaped model large enough to be matmul-bound on a CPU (35.7M parameters: 8 layers,
hidden 512, 8 heads, MLP 1536, vocabulary 8192, untied head) trains on 4 x 512 tokens per step in
fp32 with AdamW and clipping at 1.0, twice:

- by `lit-ablate fit` (in this process, through `LitAblateCLI`): a CausalLM on the synthetic
  corpus, `ThroughputMonitor` and `MFUMonitor`, the run record; its `mfu_measured` is the run
  record's median after the warm-up steps;
- by a plain transformers loop: `LlamaForCausalLM(input_ids, labels=...)`, backward, clip, AdamW,
  on random tokens; its step time is the wall time of the whole step, median after warm-up.

Both count the same model FLOPs (``lit_ablate.estimate.flops_per_token``: 6 N_matmul + 12 L H d S
per token; every position is a real token here) and divide by the same ceiling: the fp32 matmul
ceiling measured at the start of this run, with the threads both loops use (``--threads``,
default torch's), in a fresh cache directory so the ceiling is taken under the same machine load
as the runs: the run record's ``mfu_measured`` divides by it. The ceiling is measured again after
every run, and the RESULT lines divide by the best of all these ceilings (on a machine shared with
other jobs the load changes within minutes: the best moment is the closest to the real ceiling;
the table shows both, and each run against the better of the two ceilings measured just
before and after it). Runs alternate (hand, lit, hand, lit, ...) and each side's best run counts:
load from other jobs only ever adds time.

    python benchmarks/mfu.py [--steps 8] [--warmup 3] [--repeats 1] [--threads N]

``--shape qwen3-0.6b`` is the seed study's dense headline on a GPU (the GPU lane runs it): a
Qwen3-0.6B-shaped model (random init: 28 layers, hidden 1024, vocabulary 151,936, tied embedding)
trains by `lit-ablate fit` on rows of ``--seq-len`` tokens (8,192) packed from synthetic documents
(FFD, one static shape so the compiled layers compile once), bf16 weights and matmuls
(``bf16-true``), each decoder layer compiled, the fastest packed-document attention that trains
here (``fa_varlen``, else ``flex`` with a document mask, else ``sdpa_packed``) and a
memory-efficient loss (``liger``'s fused linear cross-entropy where it runs, else ``chunked``).
MFU against the device's spec peak (``mfu``) and against its measured bf16 matmul ceiling
(``mfu_measured``), from the run record (``MFUMonitor``; per-document attention FLOPs). No hand
loop in this mode. ``--layers``/``--seq-len``/``--no-compile`` shrink it for a CPU check.

    python benchmarks/mfu.py --shape qwen3-0.6b [--seq-len 8192] [--steps 25] [--warmup 8] [--attention flex] [--loss liger]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import yaml
from model_shapes import model_config

MODEL = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": 512, "tie_word_embeddings": False}  # fmt: skip
BATCH, SEQ = 4, 512


def fit_config(steps: int, warmup: int, root: str) -> dict:
    return {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": steps,
                    "gradient_clip_val": 1.0, "limit_val_batches": 0, "log_every_n_steps": 5,
                    "enable_checkpointing": False, "default_root_dir": root,
                    "callbacks": [{"class_path": "lit_ablate.callbacks.ThroughputMonitor"},
                                  {"class_path": "lit_ablate.callbacks.MFUMonitor"}]},
        "model": {"class_path": "lit_ablate.modules.CausalLM",
                  "init_args": {"model": {"config": MODEL, "dtype": "float32", "attn_implementation": "sdpa"},
                                "loss": "torch", "learning_rate": 3e-4, "warmup_steps": 0}},
        "data": {"class_path": "lit_ablate.data.LMDataModule",
                 "init_args": {"source": {"class_path": "lit_ablate.data.SyntheticText",
                                          "init_args": {"num_documents": 2000, "seed": 0}},
                               "format": "pretrain", "tokenizer": "byte", "seq_len": SEQ, "batch_size": BATCH,
                               "val_examples": 0, "num_workers": 0}},
        "recorder": {"path": str(Path(root) / "run.json"), "warmup_steps": warmup},
    }  # fmt: skip


def packed_fit_config(model: dict, args: argparse.Namespace, root: str) -> dict:
    """The dense headline as a ``lit-ablate fit`` config (``--shape`` other than cpu-35m)."""
    documents = max(200, args.steps * args.seq_len // 150)  # ~450 tokens each: rows for every step
    return {
        "seed_everything": 0,
        "trainer": {"accelerator": "gpu" if args.device == "cuda" else "cpu", "devices": 1, "precision": "bf16-true",
                    "max_steps": args.steps, "gradient_clip_val": 1.0, "limit_val_batches": 0, "log_every_n_steps": 5,
                    "enable_checkpointing": False, "enable_progress_bar": False, "default_root_dir": root,
                    "callbacks": [{"class_path": "lit_ablate.callbacks.ThroughputMonitor"},
                                  {"class_path": "lit_ablate.callbacks.MFUMonitor"}]},
        "model": {"class_path": "lit_ablate.modules.CausalLM",
                  "init_args": {"model": {"config": model, "dtype": "bfloat16", "attn_implementation": args.attention},
                                "loss": args.loss, "learning_rate": 3e-4, "warmup_steps": 0,
                                "compile": not args.no_compile}},
        "data": {"class_path": "lit_ablate.data.LMDataModule",
                 "init_args": {"source": {"class_path": "lit_ablate.data.SyntheticText",
                                          "init_args": {"num_documents": documents, "seed": 0, "median_sentences": 12.0,
                                                        "length_sigma": 1.0, "max_sentences": 200}},
                               "format": "documents", "tokenizer": "byte", "seq_len": args.seq_len, "batch_size": 1,
                               "collator": {"class_path": "lit_ablate.data.PackingCollator",
                                            "init_args": {"strategy": "ffd", "max_tokens": args.seq_len,
                                                          "static_shape": True}},
                               "val_examples": 0, "num_workers": 0}},
        "recorder": {"path": str(Path(root) / "run.json"), "warmup_steps": args.warmup},
    }  # fmt: skip


def fastest_packed_attention() -> str:
    """The first packed-document backend that trains here: each one that cannot says why."""
    from lit_ablate.errors import ConfigError
    from lit_ablate.models.attention.backends import check_attention_backend

    for name in ("fa_varlen", "flex"):
        try:
            check_attention_backend(name, training=True)
            return name
        except ConfigError as err:
            print(f"note: {err}")
    return "sdpa_packed"


def memory_efficient_loss() -> str:
    """Liger's fused linear cross-entropy where it runs (a CUDA device, liger-kernel), else chunked."""
    from lit_ablate.errors import ConfigError
    from lit_ablate.models.losses.cross_entropy import check_loss_backend

    try:
        check_loss_backend("liger")
        return "liger"
    except ConfigError as err:
        print(f"note: {err}")
        return "chunked"


def packed_headline(args: argparse.Namespace) -> int:
    """``--shape qwen3-0.6b``: one ``lit-ablate fit`` of the packed, compiled bf16 model."""
    model = model_config(args.shape, args.layers)
    args.attention = args.attention or fastest_packed_attention()
    args.loss = args.loss or memory_efficient_loss()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as root:
        summary = _fit(packed_fit_config(model, args, root), root)
    median = lambda key: (summary.get(key) or {}).get("median")  # noqa: E731
    ceilings = summary.get("mfu_ceilings") or {}
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    print(f"\n{args.shape} ({model['num_hidden_layers']} layers), rows of {args.seq_len} packed tokens, bf16-true, "
          f"attention {args.attention}, loss {args.loss}, compile {not args.no_compile}, {args.device}: "
          f"median of steps {args.warmup + 1}-{args.steps}")
    results = {"dense_mfu": median("mfu"), "dense_mfu_measured": median("mfu_measured"),
               "dense_useful_tokens_per_s": median("useful_tokens_per_sec"), "dense_step_s": median("step_time_s"),
               "dense_spec_peak_tflops": (ceilings.get("mfu") or {}).get("tflops"),
               "dense_ceiling_tflops": (ceilings.get("mfu_measured") or {}).get("tflops"),
               "dense_peak_allocated_gib": peak_gib, "dense_final_loss": summary.get("final_loss"),
               "dense_attention": args.attention, "dense_loss": args.loss, "dense_compile": not args.no_compile,
               "dense_layers": model["num_hidden_layers"], "dense_seq_len": args.seq_len}  # fmt: skip
    if summary.get("mfu_peak"):
        print(f"mfu's peak: {summary['mfu_peak']}")
    for name, value in results.items():
        print(f"RESULT {name}={'n/a' if value is None else round(value, 4) if isinstance(value, float) else value}")
    return 0 if summary.get("status") == "ok" else 1


def lit_ablate_run(steps: int, warmup: int) -> dict:
    """``lit-ablate fit`` of the model; returns the run record's summary."""
    with tempfile.TemporaryDirectory() as root:
        return _fit(fit_config(steps, warmup, root), root)


def _fit(config: dict, root: str) -> dict:
    from lit_ablate.fit_cli import LitAblateCLI

    path = Path(root) / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args.*sys.argv.*")  # this script's own argv, not the fit's
        LitAblateCLI(args=["fit", "--config", str(path)])
    return json.loads((Path(root) / "run.json").read_text())["summary"]


def hand_loop_run(steps: int, warmup: int, flops_per_step: float, ceiling_tflops: float) -> dict:
    """The same model in a plain transformers loop: the median step time and its MFU vs the ceiling."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    step_time = statistics.median(times[warmup:])
    return {"step_time_s": step_time, "mfu_measured": flops_per_step / step_time / (ceiling_tflops * 1e12)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side (alternating); the best counts")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--shape", default="cpu-35m",
                        help="cpu-35m (the CPU comparison above) or a model shape: qwen3-0.6b (the GPU headline), "
                             "or a tiny preset for a quick check (benchmarks/model_shapes.py)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="--shape other than cpu-35m: default cuda if present")
    parser.add_argument("--layers", type=int, help="--shape: fewer decoder layers than the shape's (a CPU check)")
    parser.add_argument("--seq-len", type=int, default=8192, help="--shape: tokens per packed row (one row per step)")
    parser.add_argument("--attention", help="--shape: packed attention backend (default: the fastest that trains here)")
    parser.add_argument("--loss", help="--shape: loss backend (default: liger where it runs, else chunked)")
    parser.add_argument("--no-compile", action="store_true", help="--shape: eager decoder layers")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["LIT_ABLATE_CACHE_DIR"] = tempfile.mkdtemp(prefix="mfu-ceiling-")  # a ceiling of this run's load
    if args.shape != "cpu-35m":
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return packed_headline(args)

    from transformers import AutoConfig

    from lit_ablate.estimate.flops import count_parameters_of_config, flops_per_token
    from lit_ablate.estimate.matmul_ceiling import measure_matmul_ceiling, measured_ceiling

    hf_config = AutoConfig.for_model(**MODEL)
    counts = count_parameters_of_config(hf_config)
    flops_per_step = flops_per_token(counts, hf_config, SEQ) * BATCH * SEQ
    ceiling = measured_ceiling(torch.device("cpu"), torch.float32)
    print(f"model: {counts.total / 1e6:.1f}M parameters ({counts.matmul / 1e6:.1f}M in matmuls), "
          f"{flops_per_step / 1e12:.3f} TFLOP per step of {BATCH} x {SEQ} tokens; {torch.get_num_threads()} thread(s)")
    print(f"ceiling: {ceiling.tflops * 1e3:.1f} GFLOP/s ({ceiling.describe()})")

    hand, lit, ceilings = [], [], [ceiling.tflops]
    for _ in range(args.repeats):
        hand.append(hand_loop_run(args.steps, args.warmup, flops_per_step, ceiling.tflops))
        ceilings.append(measure_matmul_ceiling(torch.device("cpu"), torch.float32)[0])
        summary = lit_ablate_run(args.steps, args.warmup)
        assert summary["mfu_ceilings"]["mfu_measured"]["tflops"] == ceiling.tflops, "lit-ablate used another ceiling"
        lit.append({"step_time_s": summary["step_time_s"]["median"], "mfu_measured": summary["mfu_measured"]["median"]})
        ceilings.append(measure_matmul_ceiling(torch.device("cpu"), torch.float32)[0])
    best_ceiling = max(ceilings)  # the machine's best moment: what a quiet machine reaches
    for i, (h, lt) in enumerate(zip(hand, lit)):  # each run against the better of the two ceilings around it
        h["around"] = h["mfu_measured"] * ceiling.tflops / max(ceilings[2 * i : 2 * i + 2])
        lt["around"] = lt["mfu_measured"] * ceiling.tflops / max(ceilings[2 * i + 1 : 2 * i + 3])

    print(f"\nceilings measured before, between and after the runs (GFLOP/s): {', '.join(f'{c * 1e3:.1f}' for c in ceilings)}")
    print("\n| loop | step time (s), best run | GFLOP/s | MFU vs the cached ceiling (run record) "
          "| MFU vs the best ceiling | MFU vs the ceilings around it | runs (s) |\n|---|---|---|---|---|---|---|")
    for name, runs in (("hand-written transformers", hand), ("lit-ablate fit", lit)):
        best = min(runs, key=lambda r: r["step_time_s"])
        print(f"| {name} | {best['step_time_s']:.3f} | {flops_per_step / best['step_time_s'] / 1e9:.0f} | "
              f"{best['mfu_measured']:.3f} | {best['mfu_measured'] * ceiling.tflops / best_ceiling:.3f} | "
              f"{best['around']:.3f} | "
              f"{', '.join(format(r['step_time_s'], '.3f') for r in runs)} |")
    print(f"RESULT cpu_mfu_measured={max(r['mfu_measured'] for r in lit) * ceiling.tflops / best_ceiling:.3f}")
    print(f"RESULT hand_loop_mfu_measured={max(r['mfu_measured'] for r in hand) * ceiling.tflops / best_ceiling:.3f}")
    print(f"RESULT cpu_matmul_ceiling_gflops={best_ceiling * 1e3:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
