"""``PipelineBubbleMonitor``: how much of a pipeline-parallel step the stages spend waiting."""

from __future__ import annotations

import statistics

from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks.step_monitor import StepMonitor
from lit_ablate.strategies.interface import interface_of


class PipelineBubbleMonitor(StepMonitor):
    """Per optimizer step, the pipeline's idle share: ``1 - compute / schedule`` on each stage,
    where ``schedule`` is the wall time of the schedule's step (every micro-batch's forward and
    backward, with the sends and receives between stages) and ``compute`` the time the stage spent
    in its own forward and backward chunks (``PipelineParallelStrategy.schedule_timing``).

    Records ``pipeline_idle_share``, the mean over stages (they wait at different moments: in 1f1b
    the first stage at the end, the last at the start), and ``pipeline_bubble_theory``, the
    schedule's own idle share with equal stages and free communication ((pp - 1) / (m + pp - 1)
    for gpipe and 1f1b over m micro-batches, (pp - 1) / (v m + pp - 1) interleaved with v stages per
    rank: ``PipelineParallelStrategy.schedule_bubble``), so a report shows what stage imbalance and
    communication add to the schedule's bubble. ``lit-ablate fit`` adds one to every pipeline run;
    elsewhere it records nothing.
    """

    def measure(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        timing = interface_of(trainer.strategy).schedule_timing()
        if timing is None:
            return
        schedule_seconds, compute_seconds = timing
        self.series.setdefault("_idle", {})[step] = max(0.0, 1.0 - compute_seconds / schedule_seconds)

    def finalize(self, trainer: Trainer) -> None:
        if "_idle" not in self.series:
            return
        theory = interface_of(trainer.strategy).schedule_bubble
        for step, stages in self.gather_over_ranks(trainer, ["_idle"])["_idle"].items():
            self.series.setdefault("pipeline_idle_share", {})[step] = statistics.fmean(stages)
            self.series.setdefault("pipeline_bubble_theory", {})[step] = theory
