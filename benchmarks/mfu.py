"""Tokens/s and MFU of `lit-ablate fit` beside a hand-written PyTorch loop on the same model, rows and kernels.

Both sides are built from ONE fit config: the same module (model, attention backend, loss backend,
compiled decoder layers, AdamW with lit-ablate's decay groups and schedule, clipping at 1.0) and
the same data module, so they read the same rows in the same order. The hand loop is a plain
PyTorch loop over that ``nn.Module``: it fetches an optimizer step's micro-batches, divides each
micro-batch's token-loss sum by the step's useful tokens (the objective `lit-ablate fit` trains),
backward, clip, AdamW, schedule; no Lightning, no callbacks. So ``lit ÷ hand`` is what the
framework costs (its loop, hooks, step objective and measurement), measured side by side in one
process. The per-step loss curves of the two sides are compared too: the same work gives the same
losses (exactly on CPU in fp32; within bf16 rounding on a GPU).

The two sides and the matmul ceiling run in lockstep (``benchmarks/lockstep.py``): each in a thread,
one optimizer step (or one ceiling sweep) at a time, in turn. So step k of each side runs within
seconds of the other's, and next to a ceiling measured between them: on a shared VM the same loop's
step moved by 30 % between runs a minute apart, and the ceiling by 22 % within one run, which a
ratio of runs made one after the other (or of a step median over a ceiling measured minutes before)
cannot tell from the framework's cost. ``lit ÷ hand`` is the median of the paired steps' useful
tokens/s ratios, with the sign test's 99 % interval (as a study's speed verdict); each step's MFU
divides its FLOPs by the best ceiling of the three sweeps nearest it (its turn's cycle and the two
beside), the medians over the steps after ``--warmup`` are the figures. ``--repeats`` runs more
rounds, the turn order reversed every other round. Each side's step clock is paused while the
others take their turns.

Both sides are timed the same way: a step runs from the end of the previous optimizer step to the
end of this one (data included); medians over the steps after ``--warmup``. `lit-ablate fit`'s
times, tokens and losses are its run record's (``ThroughputMonitor``), its FLOPs its step clock's
sums (what ``MFUMonitor`` divides); the hand loop times its steps
and reads its loss sums with the same step clock (``lit_ablate.callbacks.step_clock``: CUDA events on
a GPU, each step read at the next step's end, never waiting for the device; the wall clock on a CPU),
and counts FLOPs with the same ``batch_model_flops`` (per-document causal attention, the LM head
counted).

MFU is printed two ways, labelled: ours (``mfu``: FLOPs as above over the device's spec peak;
``mfu_measured``: over the bf16/fp32 matmul ceiling measured beside each step, as above) and the
seed study's formula (``mfu_seed_formula``:
``(6 (N - N_emb) + 12 L H d seq) / peak`` per token, which counts attention over the whole packed
row as if it were one non-causal document and leaves the embedding/head out). Compare tokens/s on
the same shape, never an MFU of one formula with one of the other.

Shapes (``benchmarks/model_shapes.py``):

- default ``cpu-35m``: a Llama-shaped 35.7M model (8 layers, hidden 512, vocabulary 8192, untied)
  that is matmul-bound on a CPU; fp32, 4 rows of 512 tokens packed from synthetic documents,
  ``sdpa_packed``, the ``torch`` loss, each decoder layer compiled as on a GPU (inductor's C++ fuses
  the norms, rotary embeddings and activations: in CPU time, about 8% of a step; ``--no-compile``
  runs them eagerly). Under a few minutes on 2 cores.
- ``qwen3-0.6b``: the seed study's dense model on a GPU: bf16 weights and matmuls, each decoder
  layer compiled, the fastest packed attention that trains here (``fa_varlen``, ``torch_varlen``,
  ``flex``, else ``sdpa_packed``) and Liger's fused linear cross-entropy where it runs.
  ``--vocab 217473 --seq-len 10240`` is the seed's own shape (151,936 + 65,537 added tokens).

Rows are packed first-fit-decreasing into a static ``--seq-len`` (one compiled shape);
``--rows`` rows per micro-batch and ``--accumulate`` micro-batches per optimizer step (the seed
trains 32 x 10,240 = 327,680 tokens per optimizer step). ``--profile`` adds lit-ablate's
``KernelProfile`` callback to the lit run and prints its top kernels, torch.compile's compiles,
recompiles and graph breaks over the fit, and per profiled step its host synchronisations: the
operators that make the host wait for the device on CUDA (``sync_ops_per_step``, counted on every
device), CUDA's own waits (``host_syncs_per_step``) and the reads lit-ablate makes on purpose
(``host_reads_per_step``: the step clock's, once per optimizer step); docs/profiling.md reads them.

    python benchmarks/mfu.py [--steps 12] [--warmup 3] [--repeats 1] [--threads N]
    python benchmarks/mfu.py --shape qwen3-0.6b --vocab 217473 --seq-len 10240 --accumulate 8 --steps 8 --warmup 3

The RESULT names start with ``--name`` (default ``cpu`` for the CPU default, else ``dense``).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import yaml
from kernels_here import fastest_packed_attention, memory_efficient_loss
from lightning.pytorch import Callback
from lockstep import Lockstep, run_in_turns, turn_order
from model_shapes import model_config

from lit_ablate.callbacks.step_clock import RUNNING_CLOCKS, StepClock

CPU_SHAPE = "cpu-35m"
PROFILED_STEPS = 2
"""``--profile``: steps profiled by ``KernelProfile`` after the measured ones (lit-ablate's run only)."""
LOSS_TOLERANCE_FP32 = 1e-4
"""Largest per-step loss difference between the two sides in fp32 on a CPU: the same module, data
and order differ only in when the gradients are divided by the step's tokens (before backward in
the hand loop, after it in lit-ablate's step objective): rounding, ~1e-6 over 8 steps."""


@dataclass
class Side:
    """One run of one side: per optimizer step its seconds, tokens, useful tokens, FLOPs, loss and the matmul
    ceiling (TFLOP/s) measured beside it."""

    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    useful: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    ceilings: list[float] = field(default_factory=list)
    document_lengths: list[int] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def per_step(self, steps: range) -> list[dict[str, float]]:
        """The measured steps' useful tokens/s, seconds, FLOP/s and MFU over the ceiling beside each."""
        return [
            {
                "useful_per_s": self.useful[i] / self.seconds[i],
                "seconds": self.seconds[i],
                "flops_per_s": self.flops[i] / self.seconds[i],
                "mfu_measured": self.flops[i] / self.seconds[i] / (self.ceilings[i] * 1e12),
            }
            for i in range(steps.start - 1, steps.stop - 1)
        ]


def scheduled_steps(args: argparse.Namespace) -> int:
    """The lit run's steps (the measured ones, then any profiled): both sides' schedules span them."""
    return args.steps + (PROFILED_STEPS if args.profile else 0)


def fit_config(args: argparse.Namespace, root: str) -> dict:
    """The one config both sides are built from."""
    model = model_config(args.shape, args.layers)
    if args.vocab:
        model["vocab_size"] = args.vocab
    bf16 = args.precision == "bf16-true"
    documents = max(400, args.steps * args.accumulate * args.rows * args.seq_len // 150)  # ~450 tokens each
    callbacks = [
        {"class_path": "lit_ablate.callbacks.ThroughputMonitor"},
        {"class_path": "lit_ablate.callbacks.MFUMonitor"},
    ]
    if args.profile:  # after the measured steps: a profiled step is slower, and left out of the medians
        callbacks.append(
            {
                "class_path": "lit_ablate.callbacks.KernelProfile",
                "init_args": {"start_step": args.steps + 1, "num_steps": PROFILED_STEPS},
            }
        )
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "gpu" if args.device == "cuda" else "cpu",
            "devices": 1,
            "precision": args.precision,
            "max_steps": scheduled_steps(args),
            "accumulate_grad_batches": args.accumulate,
            "gradient_clip_val": 1.0,
            "limit_val_batches": 0,
            "log_every_n_steps": 5,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "logger": False,
            "default_root_dir": root,
            "callbacks": callbacks,
        },
        "model": {
            "class_path": "lit_ablate.modules.CausalLM",
            "init_args": {
                "model": {
                    "config": model,
                    "dtype": "bfloat16" if bf16 else "float32",
                    "attn_implementation": args.attention,
                },
                "loss": args.loss,
                "loss_options": args.loss_options,
                "learning_rate": 3e-4,
                "warmup_steps": 0,
                "compile": args.compile,
            },
        },
        "data": {
            "class_path": "lit_ablate.data.LMDataModule",
            "init_args": {
                "source": {
                    "class_path": "lit_ablate.data.SyntheticText",
                    "init_args": {
                        "num_documents": documents,
                        "seed": 0,
                        "median_sentences": 12.0,
                        "length_sigma": 1.0,
                        "max_sentences": 200,
                    },
                },
                "format": "documents",
                "tokenizer": "byte",
                "seq_len": args.seq_len,
                "batch_size": args.rows,
                "collator": {
                    "class_path": "lit_ablate.data.PackingCollator",
                    "init_args": {"strategy": "ffd", "max_tokens": args.seq_len, "static_shape": True},
                },
                "val_examples": 0,
                "num_workers": 0,
            },
        },
        "recorder": {"path": str(Path(root) / "run.json"), "warmup_steps": args.warmup},
    }


def _cli(config: dict, root: str, run: bool):  # LitAblateCLI, imported lazily
    from lit_ablate.fit_cli import LitAblateCLI

    path = Path(root) / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args.*sys.argv.*")  # this script's own argv, not the fit's
        return LitAblateCLI(args=["fit", "--config", str(path)] if run else ["--config", str(path)], run=run)


def wait_for_turn(clock: StepClock, lockstep: Lockstep) -> None:
    """The other sides' turns, paused out of this side's step clock (on CUDA: the device time between two
    events, the other sides' kernels in the same stream included)."""
    clock.pause()
    lockstep.mark()
    clock.resume()


class TakesTurns(Callback):
    """`lit-ablate fit`'s side of the lockstep: one turn per optimizer step, taken at its first micro-batch. At
    the end it keeps each step's FLOPs as the step clock summed them (``batch_model_flops`` of every
    micro-batch, what the run's MFU divides): known for every step, where the record leaves a step's MFU
    null when it came out above 1 (a ceiling measured while the machine was slower)."""

    def __init__(self, lockstep: Lockstep) -> None:
        self.lockstep, self.step = lockstep, None
        self.flops: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            self.step = trainer.global_step
            wait_for_turn(RUNNING_CLOCKS[trainer], self.lockstep)

    def on_train_end(self, trainer, pl_module) -> None:
        clock = RUNNING_CLOCKS[trainer]
        clock.finish()
        self.flops = [clock.timing(step).flops for step in range(1, trainer.global_step + 1)]


def lit_ablate_run(args: argparse.Namespace, lockstep: Lockstep) -> Side:
    """``lit-ablate fit`` of the config in this process; its run record's per-step figures."""
    with tempfile.TemporaryDirectory() as root:
        cli = _cli(fit_config(args, root), root, run=False)
        turns = TakesTurns(lockstep)
        cli.trainer.callbacks.append(turns)
        cli.trainer.fit(cli.model, cli.datamodule)
        record = json.loads((Path(root) / "run.json").read_text())
    side = Side(summary={**record["summary"], "profile": record.get("profile")}, flops=turns.flops)
    for step in record["steps"]:
        seconds = step["step_time_s"]
        side.seconds.append(seconds)
        side.useful.append(round(step["useful_tokens_per_sec"] * seconds))
        side.tokens.append(round(step["tokens_per_sec"] * seconds))
        side.losses.append(step["loss"])
    return side


def hand_loop_run(args: argparse.Namespace, lockstep: Lockstep) -> Side:
    """The same module and data in a plain PyTorch loop (see the module docstring)."""
    from lightning.pytorch import seed_everything

    from lit_ablate.callbacks.step_clock import clock_for
    from lit_ablate.estimate.flops import batch_model_flops
    from lit_ablate.modules.optim import build_optimizer, decay_groups, decay_names

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as root:
        cli = _cli(fit_config(args, root), root, run=False)  # only to build the same module and data
    module, data = cli.model, cli.datamodule
    seed_everything(0)
    module.to(device)
    module.configure_model()
    data.setup("fit")
    model, hp = module.model, module.hparams
    optimizer, _ = build_optimizer(
        module.optimizer_name,
        decay_groups(model, decay_names(model, model.lm.get_input_embeddings().weight), hp.weight_decay),
        hp.learning_rate,
        hp.betas,
        module.optimizer_options,
    )
    scheduler = module.learning_rate_schedule.scheduler(optimizer, scheduled_steps(args))
    side = Side()
    batches = iter(data.train_dataloader())
    model.train()
    clock = clock_for(device, first=None, last=None)  # lit-ablate's step clock, started now: both sides time alike
    for step in range(1, args.steps + 1):
        wait_for_turn(clock, lockstep)
        micro = [next(batches) for _ in range(args.accumulate)]
        counted = [int((b["labels"] != -100).sum()) for b in micro]  # host tensors: no device sync
        useful = sum(counted)
        for batch, count in zip(micro, counted):
            batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            loss_sum, _ = model(batch)
            (loss_sum / useful).backward()
            clock.add(
                {
                    "tokens": batch["input_ids"].numel(),
                    "useful_tokens": count,
                    "flops": 0.0,
                    "loss_sum": loss_sum.detach(),
                }
            )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        clock.close(step)  # its time and loss read at the next step's end, as lit-ablate's monitors read them
        side.useful.append(useful)
        side.tokens.append(sum(b["input_ids"].numel() for b in micro))
        side.flops.append(sum(batch_model_flops(b, module.flops_per_token) for b in micro))
        side.document_lengths += [n for b in micro for n in b["document_lengths"]]
    clock.finish()
    for step in range(1, args.steps + 1):
        totals = clock.timing(step)
        side.seconds.append(totals.seconds)
        side.losses.append(totals.loss_sum / totals.useful_tokens)
    return side


def seed_formula_flops_per_token(hf_config: Any, seq_len: int) -> float:
    """The seed study's FLOPs per token: ``6 (N - N_emb) + 12 L H d seq`` (attention over the whole
    packed row, non-causal; the embedding, tied to the head, left out)."""
    from lit_ablate.estimate.flops import attention_shape, count_parameters_of_config

    counts = count_parameters_of_config(hf_config)
    layers, heads, head_dim = attention_shape(hf_config)
    return 6.0 * (counts.total - counts.embedding) + 12.0 * layers * heads * head_dim * seq_len


def ceiling_now(args: argparse.Namespace) -> float:
    """The matmul ceiling (TFLOP/s) in the run's compute dtype, measured now (as a run's start measures it)."""
    from lit_ablate.estimate.matmul_ceiling import ceiling_here

    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    return ceiling_here(torch.device(args.device), dtype).tflops


def ceiling_turns(args: argparse.Namespace, lockstep: Lockstep) -> list[float]:
    """The ceiling side of the lockstep: a sweep in each of its turns, the first (beside the others' set-ups)
    and one per cycle of the measured steps (turn k beside step k), never beside a profiled step."""
    ceilings = [ceiling_now(args)]
    while len(ceilings) <= args.steps and lockstep.others_running():
        lockstep.mark()
        ceilings.append(ceiling_now(args))
    return ceilings


def ceilings_beside(ceilings: list[float], steps: int) -> list[float]:
    """Step k's ceiling: the best of the sweeps of its cycle and the two beside it (a low sweep only lowers
    MFU's denominator if all three were low)."""
    return [max(ceilings[max(k - 1, 0) : k + 2]) for k in range(1, steps + 1)]


def lockstep_round(args: argparse.Namespace, round_: int) -> tuple[Side | None, Side, list[float]]:
    """One run of each side and the ceiling's sweeps, in lockstep: ``(hand, lit, ceilings)``."""
    names = [*(["hand"] if args.hand_loop else []), "lit", "ceiling"]
    lockstep = Lockstep(turn_order(names, round_), time.perf_counter)
    runs = run_in_turns(
        lockstep,
        {
            "hand": lambda: hand_loop_run(args, lockstep),
            "lit": lambda: lit_ablate_run(args, lockstep),
            "ceiling": lambda: ceiling_turns(args, lockstep),
        },
    )
    for side in (runs.get("hand"), runs["lit"]):
        if side is not None:
            side.ceilings = ceilings_beside(runs["ceiling"], args.steps)
    return runs.get("hand"), runs["lit"], runs["ceiling"]


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.1f}"
    return str(value)


def report(args: argparse.Namespace, hand: list[Side], lit: list[Side], ceilings: list[float]) -> dict[str, Any]:
    """The table and the RESULT lines; returns the results."""
    from transformers import AutoConfig

    from lit_ablate.ablation.speed_verdict import sign_interval
    from lit_ablate.estimate.matmul_ceiling import device_name
    from lit_ablate.estimate.peaks import peak_tflops_of

    w = args.warmup
    measured = range(w + 1, args.steps + 1)
    config = fit_config(args, "/unused")["model"]["init_args"]["model"]["config"]
    hf_config = AutoConfig.for_model(**config)
    peak = peak_tflops_of(device_name(torch.device(args.device))) if args.device == "cuda" else None
    beside = [c for run in lit for c in run.ceilings[measured.start - 1 : measured.stop - 1]]
    results: dict[str, Any] = {}
    p = args.name
    seed_flops = seed_formula_flops_per_token(hf_config, args.seq_len)
    print(
        f"\n{args.shape} ({hf_config.num_hidden_layers} layers, vocabulary {hf_config.vocab_size}), {args.rows} x "
        f"{args.seq_len} packed tokens per micro-batch, {args.accumulate} per optimizer step, {args.precision}, "
        f"attention {args.attention}, loss {args.loss} {args.loss_options or ''}, compile {args.compile}, "
        f"{args.device} ({device_name(torch.device(args.device))}); {args.repeats} lockstep round(s), medians of "
        f"steps {w + 1}-{args.steps} of every round"
    )
    print(
        f"matmul ceilings (TFLOP/s) measured beside the measured steps: median {statistics.median(beside):.4g} "
        f"[{min(beside):.4g}-{max(beside):.4g}], {len(ceilings)} sweeps in all; spec peak {_fmt(peak)}"
    )
    print(
        "\n| loop | useful tokens/s | step (s) | MFU (ours, spec peak) | MFU (ours, ceiling beside each step) "
        "| seed-formula MFU (spec peak) | per round: useful tokens/s |\n|---|---|---|---|---|---|---|"
    )
    for label, runs in (("hand-written PyTorch loop", hand), ("lit-ablate fit", lit)):
        if not runs:
            continue
        steps = [step for run in runs for step in run.per_step(measured)]
        useful, step_s, flops, mfu_measured = (
            statistics.median(step[key] for step in steps)
            for key in ("useful_per_s", "seconds", "flops_per_s", "mfu_measured")
        )
        mfu = flops / (peak * 1e12) if peak else None
        seed_mfu = useful * seed_flops / (peak * 1e12) if peak else None
        per_round = (statistics.median(step["useful_per_s"] for step in run.per_step(measured)) for run in runs)
        print(
            f"| {label} | {useful:,.0f} | {step_s:.4f} | {_fmt(mfu)} | {_fmt(mfu_measured)} | {_fmt(seed_mfu)} "
            f"| {', '.join(f'{r:,.0f}' for r in per_round)} |"
        )
        key = p if label.startswith("lit") else f"{p}_hand"
        results.update(
            {
                f"{key}_useful_tokens_per_s": useful,
                f"{key}_step_s": step_s,
                f"{key}_mfu": mfu,
                f"{key}_mfu_measured": mfu_measured,
                f"{key}_mfu_seed_formula": seed_mfu,
            }
        )
    if hand and lit:
        ratios = [
            ours["useful_per_s"] / theirs["useful_per_s"]
            for h, lt in zip(hand, lit)
            for ours, theirs in zip(lt.per_step(measured), h.per_step(measured))
        ]
        diff = max(abs(a - b) for h, lt in zip(hand, lit) for a, b in zip(h.losses, lt.losses[: args.steps]))
        results[f"{p}_lit_vs_hand"] = statistics.median(ratios)
        interval = sign_interval(ratios, 0.99)
        if interval is not None:
            results[f"{p}_lit_vs_hand_low"], results[f"{p}_lit_vs_hand_high"] = interval[:2]
        results[f"{p}_loss_max_abs_diff"] = diff
        shown = f"99% interval {interval[0]:.3f}-{interval[1]:.3f}" if interval else "too few pairs for an interval"
        print(
            f"\nlit-ablate / hand loop, useful tokens/s: median of {len(ratios)} paired steps "
            f"{results[f'{p}_lit_vs_hand']:.3f} ({shown}); largest per-step loss difference {diff:.3g}"
        )
    if hand and hand[0].document_lengths:
        lengths = hand[0].document_lengths
        results[f"{p}_mean_document_tokens"] = sum(lengths) / len(lengths)
    summary = lit[-1].summary
    results.update(
        {
            f"{p}_tokens_per_step": args.rows * args.seq_len * args.accumulate,
            f"{p}_seq_len": args.seq_len,
            f"{p}_vocab": hf_config.vocab_size,
            f"{p}_layers": hf_config.num_hidden_layers,
            f"{p}_attention": args.attention,
            f"{p}_loss": args.loss,
            f"{p}_compile": args.compile,
            f"{p}_spec_peak_tflops": peak,
            f"{p}_ceiling_tflops": statistics.median(beside),
            f"{p}_final_loss": summary.get("final_loss"),
        }
    )
    if args.device == "cuda":
        results[f"{p}_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if summary.get("profile"):
        print_profile(summary["profile"])
        results[f"{p}_profile"] = json.dumps(summary["profile"], separators=(",", ":"))
    for name, value in results.items():
        print(f"RESULT {name}={_fmt(value) if not isinstance(value, str) else value}")
    return results


def print_profile(profile: dict[str, Any]) -> None:
    """``KernelProfile``'s record section: where the profiled steps' time went, and what stalled them."""
    compiled = profile.get("compile") or {}
    print(
        f"\nprofile of steps {profile.get('steps')} ({profile.get('kind')}): wall {_fmt(profile.get('wall_ms'))} ms, "
        f"device {_fmt(profile.get('device_ms'))} ms"
    )
    print(
        f"torch.compile over the fit: {_fmt(compiled.get('compiles'))} compiles, "
        f"{_fmt(compiled.get('recompiles'))} recompiles, {_fmt(compiled.get('graph_breaks'))} graph breaks"
    )
    for reason in [*(compiled.get("graph_break_reasons") or []), *(compiled.get("recompile_reasons") or [])]:
        print(f"  {reason['count']} x {reason['reason']}")
    for key, what in (
        ("sync_ops_per_step", "operators that make the host wait for the device on CUDA"),
        ("host_syncs_per_step", "CUDA's waits outside lit-ablate's own reads"),
        ("host_reads_per_step", "lit-ablate's reads on purpose"),
    ):
        counts = profile.get(key) or {}
        print(f"per step, {what}: {', '.join(f'{n} x {c:g}' for n, c in counts.items()) or 'none'}")
    print("\n| kernel | ms | calls | share |\n|---|---|---|---|")
    for row in profile.get("top") or []:
        print(f"| {row['name'][:90]} | {row['time_ms']:.2f} | {row['calls']} | {row['share']:.1%} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shape", default=CPU_SHAPE, help="a model shape of benchmarks/model_shapes.py or a tiny preset"
    )
    parser.add_argument("--layers", type=int, help="fewer decoder layers than the shape's")
    parser.add_argument("--vocab", type=int, help="another vocabulary size than the shape's (the seed: 217473)")
    parser.add_argument("--seq-len", type=int, help="tokens per packed row (default 512 on the CPU shape, else 8192)")
    parser.add_argument("--rows", type=int, help="rows per micro-batch (default 4 on the CPU shape, else 1)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--steps", type=int, default=12, help="optimizer steps per run (8 after warm-up give the ratio an interval)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=1, help="lockstep rounds (the turn order reversed every other)")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], help="default: cuda if present, on shapes other than the CPU one"
    )
    parser.add_argument(
        "--precision", choices=["32-true", "bf16-true"], help="default 32-true on a CPU, bf16-true on CUDA"
    )
    parser.add_argument("--attention", help="packed attention backend (default: the fastest that trains here)")
    parser.add_argument("--loss", help="loss backend (default: liger where it runs, else torch)")
    parser.add_argument("--loss-options", type=json.loads, default=None, help="the loss backend's options as JSON")
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="eager decoder layers (default: compiled)"
    )
    parser.add_argument("--no-hand-loop", dest="hand_loop", action="store_false", help="lit-ablate's run only")
    parser.add_argument(
        "--profile", action="store_true", help="KernelProfile on the lit run: top kernels, graph breaks"
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--name", help="prefix of the RESULT names (default: cpu on the CPU shape, else dense)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_shape = args.shape == CPU_SHAPE
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not cpu_shape else "cpu")
    args.precision = args.precision or ("bf16-true" if args.device == "cuda" else "32-true")
    args.seq_len = args.seq_len or (512 if cpu_shape else 8192)
    args.rows = args.rows or (4 if cpu_shape else 1)
    args.attention = args.attention or fastest_packed_attention()
    args.loss = args.loss or memory_efficient_loss()
    args.name = args.name or ("cpu" if cpu_shape else "dense")
    hand, lit, ceilings = [], [], []
    # a cache folder of this run's own: no ceiling measured under another load; removed at the end
    with (
        tempfile.TemporaryDirectory(prefix="mfu-ceiling-") as cache,
        mock.patch.dict(os.environ, LIT_ABLATE_CACHE_DIR=cache),
    ):
        for round_ in range(args.repeats):
            hand_run, lit_run, sweeps = lockstep_round(args, round_)
            hand += [hand_run] if hand_run is not None else []
            lit.append(lit_run)
            ceilings += sweeps
    results = report(args, hand, lit, ceilings)
    if hand and args.device == "cpu" and args.precision == "32-true":
        diff = results[f"{args.name}_loss_max_abs_diff"]
        assert diff <= LOSS_TOLERANCE_FP32, f"the two loops did not do the same work: loss curves differ by {diff:.3g}"
    return 0 if all(s.summary.get("status") == "ok" for s in lit) else 1


if __name__ == "__main__":
    sys.exit(main())
