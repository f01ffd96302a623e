"""``PreferenceMonitor``: per-step DPO metrics (rewards, reward accuracy, log-probs, pair loss)."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks.step_clock import step_clock
from lit_ablate.callbacks.step_monitor import StepMonitor
from lit_ablate.record import PREFERENCE_STATS

MEANS = {
    "dpo_loss": "loss",
    "reward_accuracy": "correct",
    "rewards_chosen": "reward_chosen",
    "rewards_rejected": "reward_rejected",
    "logps_chosen": "logps_chosen",
    "logps_rejected": "logps_rejected",
}
"""Series recorded per step: the mean over the step's pairs of each of ``PREFERENCE_STATS``."""
OUTPUT_KEY = "preference"
"""What ``DPO.training_step`` returns its per-micro-batch sums of ``PREFERENCE_STATS`` under."""


class PreferenceMonitor(StepMonitor):
    """Rewards of chosen and rejected responses, their margin, reward accuracy (share of pairs
    whose chosen response earns the higher implicit reward), mean sequence log-probs and the
    exact pair-mean loss of every optimizer step, into the run record and the loggers.

    Use it with ``DPO``, which reports per-pair sums with each micro-batch (``outputs["preference"]``).
    Values are exact means over the step's pairs: summed over micro-batches (by the step clock, which
    reads them with the step's other sums, a step late), and over ranks once
    at the end of training (during training the loggers get this rank's values), as
    ``ThroughputMonitor`` does. Reward accuracy above 0.5 on data with a checkable preference
    (``ArithmeticPreference``) is the sign that preference training works.
    """

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        step_clock(trainer).sum_outputs(OUTPUT_KEY)

    def measure_timed(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if OUTPUT_KEY not in self.totals.extra:  # the module reported none (not a DPO module)
            return
        sums = dict(zip(PREFERENCE_STATS, self.totals.extra[OUTPUT_KEY]))
        for name, value in sums.items():
            self.series.setdefault(f"_{name}", {})[step] = value
        self._record_means(step, sums)

    def finalize(self, trainer: Trainer) -> None:
        if "_pairs" not in self.series:
            return
        summed = self.reduce_over_ranks(trainer, [f"_{name}" for name in PREFERENCE_STATS])
        for step in summed["_pairs"]:
            self._record_means(step, {name: summed[f"_{name}"][step] for name in PREFERENCE_STATS}, log=False)
        for name in PREFERENCE_STATS:
            del self.series[f"_{name}"]

    def _record_means(self, step: int, sums: dict[str, float], log: bool = True) -> None:
        pairs = sums["pairs"]
        means = {series: sums[stat] / pairs if pairs else None for series, stat in MEANS.items()}
        means["reward_margin"] = None if not pairs else (sums["reward_chosen"] - sums["reward_rejected"]) / pairs
        for name, value in means.items():
            if log:
                self.record(name, step, value)
            else:
                self.series.setdefault(name, {})[step] = value
