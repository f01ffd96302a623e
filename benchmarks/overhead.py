"""Framework overhead: the same training in a hand-written loop, `lit-ablate fit` and transformers' `Trainer`.

All three train the quickstart model (tiny-llama, 8 x 128 tokens) on the same batches in the
same order, with the same optimizer (torch AdamW with lit-ablate's decay groups and its choice of
kernels, ``build_optimizer``: fused on the CPU as on a GPU), schedule (linear
warm-up + cosine to ``min_lr_ratio``, ``lit_ablate.modules.optim.warmup_cosine``), gradient
clipping at 1.0 and number of steps. Each is timed the same way: the interval between the
starts of consecutive steps, so data loading, logging, the progress bar and every callback are
inside the window.

The three run side by side, in lockstep: each in a thread of its own, one step at a time in turn
(hand, lit-ablate, Trainer, hand, ...; backwards in every other round, so each side follows each
other side equally often), each clock counting only its own turns (``Lockstep``), each side
setting up alone in its first turn. So step k of every side runs within a fraction of a second of
the others', and a drift of the machine's speed (on a shared VM the same loop's steps moved by
30 % between runs a minute apart) hits all three alike. Each step after warm-up gives one paired
ratio per comparison (lit-ablate ÷ hand, lit-ablate ÷ Trainer); the headline ratios are the
medians of the pairs of all rounds, with the sign test's 99 % interval
(``lit_ablate.ablation.speed_verdict.sign_interval``, as a study judges speed): a ratio whose
interval contains 1 is no difference. What runs outside the turns is charged to whoever holds the
turn: lit-ablate's progress-bar thread (2 redraws a second, ~0.3 ms of CPU per step) is partly
charged to the other two.

`lit-ablate fit` and `Trainer` run as users run them: progress bar on, logging every
``log_every_n_steps`` (5) steps (lit-ablate: its rich progress bar, the quickstart's callbacks
and its CSV logger; Trainer: its tqdm bar and console logging, ``report_to="none"``), checkpoints at the end,
no validation on either side. Two things differ from a default Trainer, both so that it does the
same work: the optimizer and schedule are passed in (``optimizers=``; Trainer's own AdamW would
decay the embedding and its warm-up starts at LR 0), and the dataset is lit-ablate's epoch order
read sequentially (``train_sampling_strategy="sequential"``) instead of Trainer's own shuffle.
Labels come pre-shifted from lit-ablate's collator, so they reach the model as ``shift_labels``
(transformers' padding-free convention). The loss curves must agree, or the comparison is not the
same work: lit-ablate vs the hand loop per step, and Trainer's logged losses (means over each
logging window) vs lit-ablate's means over the same windows, both within ``LOSS_TOLERANCE``;
the script exits non-zero otherwise.

The default clock is this process's CPU time with one torch thread: framework overhead is CPU
work, and CPU time does not count the time other jobs hold the core, which on a shared 2-core
machine moves wall-clock medians by 20 %. ``--clock wall --threads 2`` times wall clock instead
(use it on a quiet or GPU machine).

``--profile`` runs each side once and prints where its step time goes instead: main-thread CPU
time inside each part of the step (each part net of the parts it calls, so the rows add up to the
step; about 2 us of timer per call), the time of other threads (progress-bar redraws), and the
rest (the loop's own code and Lightning's hook dispatch).

    python benchmarks/overhead.py [--steps 60] [--repeats 3] [--clock cpu|wall] [--threads 1]
``--count`` runs each side twice and prints, per step, what each does instead of how long it takes:
the ATen operators it dispatches (forward, backward and optimizer; on a GPU each one or more kernel
launches) and the Python functions and builtins its main thread calls. Counts hardly move with the
machine's speed (the operators not at all; lit-ablate's calls by a few per step, its progress bar
refreshing on a timer), so they show a difference of a few operators or a few hundred calls that no
timing on a shared VM resolves.

    python benchmarks/overhead.py --profile [--steps 200]
    python benchmarks/overhead.py --count [--steps 25]

``--shape dispatch`` (any mode) runs the quickstart's layers and heads at hidden size 8 on 1 x 8 tokens:
nearly the same ATen operators per step as the quickstart (a few fewer in attention and the loss) and
the same work of each loop beyond the hand loop's (``--count`` says so), with kernels of microseconds:
each loop's step is mostly dispatch, and what a loop adds beyond the hand loop's is a large part of its
step instead of 1-3 % inside the kernels' noise: the framework's cost per step, measured in milliseconds
with an interval (``RESULT *_extra_ms``, the median of the paired steps' differences).

    python benchmarks/overhead.py --shape dispatch [--profile --steps 400]
"""

from __future__ import annotations

import argparse
import collections
import functools
import operator
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.trainer import call as lightning_call
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lockstep import Lockstep, run_in_turns, turn_order
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data.dataloader import _BaseDataLoaderIter
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from lit_ablate.ablation.speed_verdict import sign_interval
from lit_ablate.data.collate import Collator
from lit_ablate.fit_cli import LitAblateCLI
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.modules.optim import build_optimizer, decay_groups, decay_names, warmup_cosine
from lit_ablate.strategies.step_objective import StepObjective

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
WARMUP = 5
# fp32, same batches: the sides differ only in summation order (HF's cross-entropy on full logits
# vs lit-ablate's loss backend; the order of parameters in the clipping norm), ~1e-6 at step 20
# and at most 6e-5 after 60 steps (training amplifies it). Not the same work, measured: Trainer's
# own shuffle 8e-2, decaying the embedding 3e-2, a warm-up that starts at LR 0 4e-1.
LOSS_TOLERANCE = 1e-3
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]
SHAPES = {
    "quickstart": [],
    "dispatch": [
        "--model.init_args.model.config",
        '{"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1}',
        "--data.init_args.seq_len",
        "8",
        "--data.init_args.batch_size",
        "1",
    ],
}
shape_args = SHAPES["quickstart"]


@dataclass
class Run:
    """One training run: the clock at each step start, and the per-step (or per-window) losses."""

    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def steps(self) -> list[float]:
        """Each step's time after warm-up: the intervals between step starts."""
        return [b - a for a, b in zip(self.times[WARMUP:], self.times[WARMUP + 1 :])]


class LightningRecorder(L.Callback):
    """The clock at every training batch start; the step's loss kept as a tensor (no sync in the step)."""

    def __init__(self) -> None:
        self.run, self._losses = Run(), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.run.times.append(clock())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._losses.append((outputs["loss_sum"] / outputs["useful_tokens"]).detach())  # backprop loss is rescaled

    def on_train_end(self, trainer, pl_module) -> None:
        self.run.losses = [float(x) for x in self._losses]


class TrainerRecorder(TrainerCallback):
    """The clock at every Trainer step start (its losses are read from ``log_history`` after training)."""

    def __init__(self) -> None:
        self.run = Run()

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.run.times.append(clock())


class ShiftedLabels:
    """lit-ablate's collator for Trainer, keeping the model inputs only (Trainer passes every key to
    the model). Its labels are already shifted, so they also go in as ``shift_labels``, which
    transformers' causal-LM loss (and Trainer's token count) then uses as is."""

    def __init__(self, collator: Collator) -> None:
        self.collator = collator

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator(examples)
        return {**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}, "shift_labels": batch["labels"]}


def _cli(steps: int, root: str) -> LitAblateCLI:
    return LitAblateCLI(
        args=[
            "--config",
            QUICKSTART,
            "--trainer.max_steps",
            str(steps),
            "--trainer.default_root_dir",
            root,
            "--trainer.limit_val_batches",
            "0",
            *shape_args,
        ],
        run=False,
    )


def _built(steps: int):
    """The quickstart's module (model built with the fit's seed), data, optimizer, schedule and CLI."""
    with tempfile.TemporaryDirectory() as root:
        cli = _cli(steps, root)  # only to build the same model and data from the same config
    module, data = cli.model, cli.datamodule
    L.seed_everything(0)
    module.configure_model()
    data.setup("fit")
    model, hp = module.model, module.hparams
    optimizer, _ = build_optimizer(  # lit-ablate's choice of kernels too (fused AdamW): the same update
        module.optimizer_name,
        decay_groups(model, decay_names(model, model.lm.get_input_embeddings().weight), hp.weight_decay),
        hp.learning_rate,
        hp.betas,
        module.optimizer_options,
    )
    return module, data, optimizer, warmup_cosine(optimizer, hp.warmup_steps, steps, hp.min_lr_ratio), cli


def lit_ablate_run(steps: int) -> Run:
    with tempfile.TemporaryDirectory() as root:
        cli = _cli(steps, root)
        recorder = LightningRecorder()
        cli.trainer.callbacks.append(recorder)
        if profiler is not None:
            profiler.wrap_hooks(cli.trainer.callbacks, cli.model)
        cli.trainer.fit(cli.model, cli.datamodule)
    return recorder.run


def hand_written_run(steps: int) -> Run:
    module, data, optimizer, scheduler, _ = _built(steps)
    model, run, losses = module.model, Run(), []
    batches = iter(data.train_dataloader())
    for _ in range(steps):
        run.times.append(clock())
        batch = next(batches)
        loss_sum, useful = model(batch)
        loss = loss_sum / useful.clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    run.times.append(clock())
    run.losses = [float(x) for x in losses]
    return run


def hf_trainer_run(steps: int) -> Run:
    module, data, optimizer, scheduler, cli = _built(steps)
    ordered = [data.train_set[i] for i in data.train_dataloader().sampler]  # lit-ablate's epoch-0 order
    recorder = TrainerRecorder()
    with tempfile.TemporaryDirectory() as root:
        args = TrainingArguments(
            output_dir=root,
            max_steps=steps,
            per_device_train_batch_size=data.batch_size,
            logging_steps=cli.trainer.log_every_n_steps,
            max_grad_norm=cli.trainer.gradient_clip_val,
            train_sampling_strategy="sequential",
            dataloader_drop_last=True,
            use_cpu=True,
        )
        if profiler is not None:
            module.model.lm.forward = profiler.wrap("model forward + loss", module.model.lm.forward)
        trainer = Trainer(
            model=module.model.lm,
            args=args,
            train_dataset=ordered,
            data_collator=ShiftedLabels(data.collator),
            optimizers=(optimizer, scheduler),
            callbacks=[recorder],
        )
        trainer.train()
    recorder.run.losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return recorder.run


SIDES: dict[str, Callable[[int], Run]] = {
    "hand-written PyTorch": hand_written_run,
    "lit-ablate fit": lit_ablate_run,
    "transformers Trainer": hf_trainer_run,
}


class ExclusiveTimes:
    """Main-thread CPU time inside wrapped functions, each net of the wrapped functions it calls, so
    that the parts add up to the step. Not cProfile: its per-call cost would inflate exactly the
    Python-heavy parts (hooks, logging) this is meant to measure."""

    def __init__(self) -> None:
        self.totals: collections.Counter[str] = collections.Counter()
        self.marks: list[tuple[float, float, collections.Counter[str]]] = []
        self._open: list[list[float]] = []  # [start, time inside wrapped callees] per active call

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._open.append([time.thread_time(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, inner = self._open.pop()
                spent = time.thread_time() - start
                self.totals[label] += spent - inner
                if self._open:
                    self._open[-1][1] += spent

        return timed

    def patch(self, owner, name: str, label: str) -> None:
        setattr(owner, name, self.wrap(label, getattr(owner, name)))

    def wrap_hooks(self, callbacks: list[L.Callback], module: L.LightningModule) -> None:
        """Each callback's and the module's own hooks (only those their classes define: Lightning
        treats a hook as overridden when its code differs from the base class's)."""
        for callback in callbacks:
            if isinstance(callback, LightningRecorder):
                continue
            for hook in TRAIN_HOOKS:
                if getattr(type(callback), hook) is not getattr(L.Callback, hook):
                    setattr(callback, hook, self.wrap(f"callback {type(callback).__name__}", getattr(callback, hook)))
        for hook in ("training_step", "optimizer_step", *TRAIN_HOOKS):
            if hook in vars(type(module)):
                setattr(module, hook, self.wrap(f"{type(module).__name__}'s own hooks", getattr(module, hook)))

    def mark(self) -> float:
        """The step clock in profile mode: keeps a snapshot of the totals at each step start."""
        self.marks.append((time.thread_time(), time.process_time(), self.totals.copy()))
        return self.marks[-1][1]

    def per_step(self) -> dict[str, float]:
        """Milliseconds per step of every part between the first step after warm-up and the last mark."""
        (thread0, process0, totals0), (thread1, process1, totals1) = self.marks[WARMUP], self.marks[-1]
        steps = len(self.marks) - 1 - WARMUP
        parts = {label: (totals1[label] - totals0[label]) / steps * 1e3 for label in totals1}
        main_thread = (thread1 - thread0) / steps * 1e3
        parts[REST] = main_thread - sum(v for k, v in parts.items() if k != REST)  # its wrapped part, and the unwrapped
        parts["other threads (progress-bar redraws)"] = (process1 - process0) / steps * 1e3 - main_thread
        return parts


TRAIN_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)
COMPUTE = (
    "model forward + loss",
    "backward",
    "AdamW step",
    "clip_grad_norm_",
    "zero_grad",
    "LR schedule",
    "data: DataLoader + collate",
)
REST = "the rest: loop code"
CLOSURE = "optimizer closure's own code (a module's gradient rescale, Lightning's plumbing)"
profiler: ExclusiveTimes | None = None


def install_profiler() -> ExclusiveTimes:
    """Wrap the parts every side shares (compute, data) and the framework parts worth naming."""
    times = ExclusiveTimes()
    adam_step = torch.optim.Adam.step

    def step(optimizer, closure=None):  # Lightning runs forward and backward inside the step's closure
        if closure is not None:
            closure = times.wrap(CLOSURE, closure)
        return adam_step(optimizer, closure)

    torch.optim.Adam.step = times.wrap("AdamW step", step)
    for owner, name, label in (
        (CausalLMWithLoss, "forward", "model forward + loss"),
        (torch.autograd, "backward", "backward"),
        (torch.nn.utils, "clip_grad_norm_", "clip_grad_norm_"),
        (torch.optim.Optimizer, "zero_grad", "zero_grad"),
        (torch.nn.Module, "zero_grad", "zero_grad"),
        (torch.optim.lr_scheduler.LRScheduler, "step", "LR schedule"),
        (_BaseDataLoaderIter, "__next__", "data: DataLoader + collate"),
        (L.LightningModule, "log", "Lightning: LightningModule.log"),
        (_LoggerConnector, "on_batch_start", "Lightning: logger connector"),
        (_LoggerConnector, "on_batch_end", "Lightning: logger connector"),
        (_LoggerConnector, "update_train_step_metrics", "Lightning: logger connector"),
        (Closure, "__call__", REST),
        (StepObjective, "normalize_gradients", "StepObjective: the gradients rescaled to the step's token mean"),
        (CallbackHandler, "call_event", "Trainer: callbacks (progress bar, printer)"),
        (Trainer, "_maybe_log_save_evaluate", "Trainer: logging"),
        (Trainer, "training_step", "Trainer: training_step, compute_loss"),
        (Trainer, "_clip_grad_norm", "clip_grad_norm_"),  # accelerate clips with its own function, not torch's
        (Trainer, "get_batch_samples", "Trainer: batch fetch, token count"),
    ):
        times.patch(owner, name, label)
    times.patch(lightning_call, "_call_callback_hooks", "Lightning: dispatching callback hooks")
    for name in ("_call_lightning_module_hook", "_call_strategy_hook"):
        times.patch(lightning_call, name, "Lightning: dispatching module and strategy hooks")
    return times


def profile(steps: int) -> None:
    global profiler, clock
    profiler = install_profiler()
    clock = profiler.mark
    columns = {}
    for name, run in SIDES.items():
        profiler.marks, profiler.totals = [], collections.Counter()
        run(steps)
        columns[name] = profiler.per_step()
    labels = [*COMPUTE, *sorted({k for c in columns.values() for k in c} - set(COMPUTE))]
    print(
        f"\nmain-thread CPU ms per step, {steps} steps after {WARMUP} warm-up, one torch thread; "
        "each part net of the parts it calls\n"
    )
    print(f"| part | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
    for label in labels:
        print(f"| {label} | " + " | ".join(f"{c[label]:.3f}" if label in c else "" for c in columns.values()) + " |")
    for name, parts in (("compute and data", COMPUTE), ("everything else", [k for k in labels if k not in COMPUTE])):
        print(
            f"| **{name}** | "
            + " | ".join(f"**{sum(c.get(k, 0.0) for k in parts):.2f}**" for c in columns.values())
            + " |"
        )
    print("| **step** | " + " | ".join(f"**{sum(c.values()):.2f}**" for c in columns.values()) + " |")


def window_means(losses: list[float], window: int) -> list[float]:
    """Means over consecutive ``window``-step windows, as Trainer logs its loss."""
    return [statistics.fmean(losses[i : i + window]) for i in range(0, len(losses) - window + 1, window)]


def max_gap(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise SystemExit(f"loss curves have different lengths ({len(a)} vs {len(b)}): not the same work")
    return max(abs(x - y) for x, y in zip(a, b))


class StepCounts:
    """The per-step count of ATen operators (``"ops"``: a ``TorchDispatchMode``, backward included: on a CPU
    the autograd engine runs it in the caller's thread) or of the main thread's Python calls (``"calls"``:
    ``sys.setprofile``, a Python function's call or a builtin's each), between step starts ``first`` and
    ``last`` (``mark`` is the sides' clock meanwhile)."""

    def __init__(self, what: str, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.marks, self.total = 0, 0
        self.mode = _OperatorCount(self) if what == "ops" else None

    def mark(self) -> float:
        self.marks += 1
        if self.marks == self.first:
            self._count(True)
        elif self.marks == self.last:
            self._count(False)
        return time.perf_counter()

    def _count(self, on: bool) -> None:
        if self.mode is None:
            sys.setprofile(self._call if on else None)
        elif on:
            self.mode.__enter__()
        else:
            self.mode.__exit__(None, None, None)

    def per_step(self) -> float:
        if self.marks < self.last:
            raise SystemExit(f"a side took {self.marks} steps, fewer than the {self.last} counted: raise --steps")
        return self.total / (self.last - self.first)

    def _call(self, frame, event: str, arg) -> None:
        if event in ("call", "c_call"):
            self.total += 1


class _OperatorCount(TorchDispatchMode):
    def __init__(self, counts: StepCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.total += 1
        return func(*args, **(kwargs or {}))


def count(steps: int) -> None:
    """``--count``: each side's ATen operators and Python calls per step, beside the hand loop's."""
    global clock
    own_clock, rows = clock, {}
    for what in ("ops", "calls"):
        for name, run in SIDES.items():
            counts = StepCounts(what, WARMUP + 1, steps)
            clock = counts.mark
            try:
                run(steps)
            finally:
                clock = own_clock
            rows.setdefault(name, {})[what] = counts.per_step()
    hand = rows["hand-written PyTorch"]
    print(f"\nper step, steps {WARMUP + 1}-{steps - 1}, main thread\n")
    print("| loop | ATen operators | beyond the hand loop | Python calls | beyond the hand loop |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['ops']:.1f} | {row['ops'] - hand['ops']:+.1f} | {row['calls']:,.0f} "
            f"| {row['calls'] - hand['calls']:+,.0f} |"
        )
    print()
    for key, name in (("lit", "lit-ablate fit"), ("trainer", "transformers Trainer")):
        print(f"RESULT {key}_extra_ops_per_step={rows[name]['ops'] - hand['ops']:.1f}")
        print(f"RESULT {key}_extra_calls_per_step={rows[name]['calls'] - hand['calls']:.0f}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--shape", choices=list(SHAPES), default="quickstart", help="quickstart's, or dispatch-bound")
    parser.add_argument("--profile", action="store_true", help="where each side's step time goes (one run each)")
    parser.add_argument("--count", action="store_true", help="each side's ATen operators and Python calls per step")
    args = parser.parse_args(argv)
    global clock, shape_args
    clock, shape_args = CLOCKS[args.clock], SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    if args.profile:
        return profile(args.steps)
    if args.count:
        return count(args.steps)
    runs: dict[str, list[Run]] = {name: [] for name in SIDES}
    for round_ in range(args.repeats):
        for name, run in lockstep_round(SIDES, turn_order(list(SIDES), round_), args.steps).items():
            runs[name].append(run)
        if torch.get_num_threads() != args.threads:
            raise SystemExit(f"a side changed torch's threads to {torch.get_num_threads()}: not the same setup")
    hand, lit, hf = runs.values()
    window = _cli(args.steps, tempfile.gettempdir()).trainer.log_every_n_steps
    vs_hand = max(max_gap(ours.losses, h.losses) for ours, h in zip(lit, hand))
    vs_hf = max(max_gap(window_means(ours.losses, window), t.losses) for ours, t in zip(lit, hf))
    print(
        f"\nclock: {args.clock}, torch threads: {args.threads}, {args.steps} steps, {args.repeats} lockstep "
        "round(s) of the three sides"
    )
    print(
        f"loss curves, max |difference| over all runs (tolerance {LOSS_TOLERANCE:g}): lit-ablate vs hand-written "
        f"{vs_hand:.2e} per step; lit-ablate vs Trainer {vs_hf:.2e} per {window}-step logging window"
    )
    print("\n| loop | median step (ms), all rounds | per round (ms) |\n|---|---|---|")
    for name, side in runs.items():
        steps = [s for r in side for s in r.steps]
        shown = ", ".join(f"{statistics.median(r.steps) * 1e3:.2f}" for r in side)
        print(f"| {name} | {statistics.median(steps) * 1e3:.2f} | {shown} |")
    if max(vs_hand, vs_hf) > LOSS_TOLERANCE:
        raise SystemExit("loss curves differ beyond the tolerance: the loops did not do the same work")
    print("\n| ratio | median of paired steps | 99% interval | pairs | reading |\n|---|---|---|---|---|")
    results = {}
    for result, label, base in (
        ("overhead_ratio", "lit-ablate ÷ hand-written", hand),
        ("vs_hf_trainer_ratio", "lit-ablate ÷ Trainer", hf),
    ):
        ratios = paired(lit, base, operator.truediv)
        results[result] = statistics.median(ratios)
        interval = sign_interval(ratios, 0.99)
        if interval is None:
            print(f"| {label} | {results[result]:.3f} | too few pairs | {len(ratios)} | n/a |")
            continue
        results[f"{result}_low"], results[f"{result}_high"] = interval[:2]
        reading = "no difference" if interval[0] <= 1 <= interval[1] else ("slower" if interval[0] > 1 else "faster")
        print(f"| {label} | {results[result]:.3f} | {interval[0]:.3f}–{interval[1]:.3f} | {len(ratios)} | {reading} |")
    print("\n| beyond the hand loop | ms per step, median of paired steps | 99% interval | pairs |\n|---|---|---|---|")
    for result, label, side in (("lit_extra_ms", "lit-ablate fit", lit), ("trainer_extra_ms", "Trainer", hf)):
        differences = paired(side, hand, lambda a, b: (a - b) * 1e3)
        results[result] = statistics.median(differences)
        interval = sign_interval(differences, 0.99)
        shown = f"{interval[0]:.3f}–{interval[1]:.3f}" if interval else "too few pairs"
        print(f"| {label} | {results[result]:.3f} | {shown} | {len(differences)} |")
        if interval:
            results[f"{result}_low"], results[f"{result}_high"] = interval[:2]
    print()
    for name, value in results.items():
        print(f"RESULT {name}={value:.3f}")


def lockstep_round(sides: dict[str, Callable[[int], Run]], order: list[str], steps: int) -> dict[str, Run]:
    """One run of each side, in lockstep (``Lockstep``) in ``order``: their runs by name. The recorders read
    the module's ``clock``, which is the lockstep's own-turn clock meanwhile."""
    global clock
    lockstep = Lockstep(order, clock)
    clock, own_clock = lockstep.mark, clock
    try:
        return run_in_turns(lockstep, {name: functools.partial(sides[name], steps) for name in order})
    finally:
        clock = own_clock


def paired(ours: list[Run], base: list[Run], combine: Callable[[float, float], float]) -> list[float]:
    """``combine`` of step k of ours and step k of the base (their ratio, their difference), each round's
    steps after warm-up: a pair ran beside each other, so the machine's drift cancels in it."""
    return [combine(a, b) for o, r in zip(ours, base) for a, b in zip(o.steps, r.steps)]


if __name__ == "__main__":
    main(sys.argv[1:])
