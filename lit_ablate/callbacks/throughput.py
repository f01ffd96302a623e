"""``ThroughputMonitor``: step time and tokens/s, processed and useful, per device and global."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer

from lit_ablate.callbacks.step_monitor import StepMonitor, batch_replicas


class ThroughputMonitor(StepMonitor):
    """Step time, the part of it spent waiting for data, and tokens per second of **processed**
    tokens (padding included) and **useful** tokens (labels that count in the loss).

    The two token rates differ exactly by padding and masked prompt tokens, which is what a
    padding-vs-packing or an SFT ablation must see. ``step_time_s`` is the time from one optimizer
    step's end to the next (``StepClock``: device time between CUDA events, else wall time; each step
    is recorded a step later), ``data_wait_s`` the part of it between micro-batches (fetching,
    collating and moving batches), so a slow collator shows as what it is. Per-device values come
    from this rank's step; global values sum the tokens of every rank (tensor-parallel peers
    counted once; reduced once at the end of training, so no collective runs inside a timed step)
    over this rank's step time.
    """

    def measure_timed(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        t = self.totals
        self.record("step_time_s", step, t.seconds)
        self.record("data_wait_s", step, t.data_wait_seconds)
        self.record("tokens_per_sec_per_device", step, t.tokens / t.seconds)
        self.record("useful_tokens_per_sec_per_device", step, t.useful_tokens / t.seconds)
        self.series.setdefault("_tokens", {})[step] = t.tokens
        self.series.setdefault("_useful_tokens", {})[step] = t.useful_tokens

    def finalize(self, trainer: Trainer) -> None:
        if "_tokens" not in self.series:
            return
        summed = self.reduce_over_ranks(trainer, ["_tokens", "_useful_tokens"])
        replicas = batch_replicas(trainer)
        seconds = self.series["step_time_s"]
        for step, time_s in seconds.items():
            self.series.setdefault("tokens_per_sec", {})[step] = summed["_tokens"][step] / replicas / time_s
            self.series.setdefault("useful_tokens_per_sec", {})[step] = (
                summed["_useful_tokens"][step] / replicas / time_s
            )
        del self.series["_tokens"], self.series["_useful_tokens"]
