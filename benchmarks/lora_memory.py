"""Per-rank training memory of full fine-tuning vs LoRA vs QLoRA: the estimate for a Qwen3-0.6B shape,
checked against measured tiny runs.

Run by hand (CI runs it only at a smoke size, tests/test_benchmarks.py):
    OMP_NUM_THREADS=1 python benchmarks/lora_memory.py [--seq-len 2048]

1. Measured: three short fits of ``configs/sft_lora_tiny.yaml`` (full fine-tuning, LoRA r=16 on every
   linear layer, QLoRA: the same over an NF4 base), each through ``lit-ablate fit``'s entry point in
   this process (``lit_ablate.cli.main``: the bytes counted are tracked tensors, not the process's
   memory, so a process of its own would only add its start-up, ~8 s per fit); the run record's
   tensor breakdown (``MemoryMonitor``: tracked tensor bytes by category at the step's peak) gives
   parameters, gradients and optimizer states, beside ``lit_ablate.estimate`` for the same config.
   Activations are left out of the check: on a 1M-parameter model they are mostly the fixed costs
   of the loss and attention kernels, which the estimate models for large shapes.
2. Estimated: the same three setups on a Qwen3-0.6B shape (28 layers, hidden 1024, vocab 151936, tied
   embeddings) in bf16, one rank, micro-batch 1 x ``--seq-len`` tokens, AdamW (states in bf16 as
   torch keeps them for bf16 parameters).

Prints a table per part and ``RESULT`` lines: the 0.6B totals' ratios to full fine-tuning, and each
tiny run's estimated/measured ratio of parameters + gradients + optimizer states (1.0 = exact).
About 30 s on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

from lit_ablate.cli import main as lit_ablate_main
from lit_ablate.estimate.from_config import estimate_for_config, model_of
from lit_ablate.estimate.memory import estimate_memory
from lit_ablate.estimate.shapes import GIB, TrainingShape
from lit_ablate.fit_cli import resolve_fit_config
from lit_ablate.strategies.state_sharding import REPLICATED

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "sft_lora_tiny.yaml"
SETUPS: dict[str, str] = {
    "full": "model: {init_args: {model: {adapter: null}, learning_rate: 3.0e-3}}",
    "lora": "{}",
    "qlora": "model: {init_args: {model: {quantization: {bits: 4, quant_type: nf4, double_quant: true}}}}",
}
"""Each setup's YAML, given as a second --config over the shipped one."""
QWEN3_06B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}
STATE = ("params", "grads", "optimizer")


def measured_tiny(setup: str, override: str, steps: int, workdir: Path) -> tuple[dict, dict]:
    """(measured bytes by category at the peak, estimated bytes) of a short fit of ``setup``."""
    run = workdir / setup
    run.mkdir(parents=True)
    (run / "setup.yaml").write_text(override)
    argv = [
        "--config",
        str(CONFIG),
        "--config",
        str(run / "setup.yaml"),
        "--trainer.max_steps",
        str(steps),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.callbacks",
        json.dumps([{"class_path": "lit_ablate.callbacks.MemoryMonitor"}]),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        str(run),
        "--recorder.path",
        str(run / "run.json"),
    ]
    with contextlib.redirect_stdout(io.StringIO()):  # the fit's own lines; the tables are this script's output
        lit_ablate_main(["fit", *argv])
    record = json.loads((run / "run.json").read_text())
    estimate = estimate_for_config(resolve_fit_config(argv))
    measured = dict(record["summary"]["tensor_breakdown"]["at_peak"])
    measured["params"] += measured.pop("frozen_params", 0)  # the estimate's params: trainable and frozen (the base)
    return measured, {k: getattr(estimate, k) for k in (*STATE, "activations")}


def qwen3_estimates(seq_len: int) -> dict[str, dict[str, int]]:
    shape = TrainingShape(micro_batch=1, seq_len=seq_len, param_bytes=2, activation_bytes=2)
    out = {}
    for setup, model in (
        ("full", {}),
        ("lora", {"adapter": {"r": 16}}),
        ("qlora", {"adapter": {"r": 16}, "quantization": {"bits": 4}}),
    ):
        config = {"model": {"init_args": {"model": {"config": QWEN3_06B, "dtype": "bfloat16", **model}}}}
        counts, model_shape = model_of(config)
        estimate = estimate_memory(counts, model_shape, shape, REPLICATED, 1)
        out[setup] = {
            **{k: getattr(estimate, k) for k in (*STATE, "activations")},
            "total": estimate.total,
            "trainable": counts.trainable,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence for the 0.6B estimate")
    parser.add_argument("--steps", type=int, default=6, help="steps of each measured tiny run")
    args = parser.parse_args()

    print("Tiny runs (configs/sft_lora_tiny.yaml), bytes at the step's peak: measured (tracked tensors) / estimated")
    print("| setup | params | grads | optimizer | state est/meas |")
    print("|---|---|---|---|---|")
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="lora-memory-") as tmp:
        for setup, override in SETUPS.items():
            measured, estimated = measured_tiny(setup, override, args.steps, Path(tmp))
            ratios[setup] = sum(estimated[k] for k in STATE) / sum(measured[k] for k in STATE)
            cells = " | ".join(f"{measured[k]:,} / {estimated[k]:,}" for k in STATE)
            print(f"| {setup} | {cells} | {ratios[setup]:.3f} |")

    qwen = qwen3_estimates(args.seq_len)
    print(f"\nQwen3-0.6B shape, bf16, 1 rank, 1 x {args.seq_len} tokens, AdamW (estimate), GiB")
    print("| setup | trainable | params | grads | optimizer | activations | total |")
    print("|---|---|---|---|---|---|---|")
    for setup, row in qwen.items():
        gib = " | ".join(f"{row[k] / GIB:.3f}" for k in (*STATE, "activations", "total"))
        print(f"| {setup} | {row['trainable']:,} | {gib} |")
    for setup in ("lora", "qlora"):
        print(f"RESULT qwen3_0.6b_{setup}_vs_full_memory_ratio={qwen[setup]['total'] / qwen['full']['total']:.3f}")
        print(
            f"RESULT qwen3_0.6b_{setup}_vs_full_state_ratio="
            f"{sum(qwen[setup][k] for k in STATE) / sum(qwen['full'][k] for k in STATE):.3f}"
        )
    for setup, ratio in ratios.items():
        print(f"RESULT tiny_{setup}_state_estimate_over_measured={ratio:.3f}")


if __name__ == "__main__":
    main()
