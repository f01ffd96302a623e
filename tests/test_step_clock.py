"""The step clock reads a step's time one step late: on CUDA from events recorded at each step
boundary, so no step ends with the host waiting for the device.

On CPU the CUDA clock runs with a stand-in event class whose "device time" the test chooses: each
micro-batch advances it by its own number of milliseconds (all different), a validation run by a
second, so every step's exact time is known. Through real fits the monitors must publish each step's
time, tokens and loss under the right step number, and wait only for events that later boundaries
have already passed (except at the end of training).
"""

from __future__ import annotations

import json
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_ablate.callbacks import MFUMonitor, RunRecorder, ThroughputMonitor, step_monitor
from lit_ablate.callbacks.step_clock import CudaEventClock, WallClock
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.modules import CausalLM
from tests.test_callbacks import SEQ, _batches

MICRO_BATCH_MS = [3.0, 5.0, 7.0, 11.0, 13.0, 17.0, 19.0, 23.0, 29.0, 31.0, 37.0, 41.0]
"""The device milliseconds of micro-batch i (primes: no two steps take the same time)."""
VALIDATION_MS = 1000.0


class FakeDevice:
    """The stand-in device's timeline and what was waited for."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.recorded: list[FakeEvent] = []
        self.training_ended = False
        self.stalls: list[str] = []
        """Waits, before training ended, for an event no later boundary event follows: a real
        device would make the host wait for the work still queued."""
        self.boundary_waits = 0


class FakeEvent:
    """``torch.cuda.Event``'s interface over ``FakeDevice``'s time."""

    device: FakeDevice

    def __init__(self, enable_timing: bool = False) -> None:
        self.timing, self.at_ms, self.index = enable_timing, None, None

    def record(self) -> None:
        self.at_ms, self.index = self.device.now_ms, len(self.device.recorded)
        self.device.recorded.append(self)

    def synchronize(self) -> None:
        assert self.at_ms is not None, "waited for an event never recorded"
        passed = any(e.timing and e.index > self.index for e in self.device.recorded)
        if not passed and not self.device.training_ended:
            self.stalls.append(f"event {self.index} (timing={self.timing}) of {len(self.device.recorded)}")
        self.device.boundary_waits += self.timing

    @property
    def stalls(self) -> list[str]:
        return self.device.stalls

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing and end.at_ms is not None
        return end.at_ms - self.at_ms


class TimedLM(CausalLM):
    """Each training micro-batch takes ``MICRO_BATCH_MS[batch_idx]`` on the fake device, each
    validation run ``VALIDATION_MS``."""

    def __init__(self, device: FakeDevice) -> None:
        super().__init__(ModelFactory(preset="tiny-llama"), learning_rate=3e-3, warmup_steps=0)
        self.device_time = device

    def training_step(self, batch, batch_idx):
        self.device_time.now_ms += MICRO_BATCH_MS[batch_idx]
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.device_time.now_ms += VALIDATION_MS


class Watch(L.Callback):
    """First on the list: marks the end of training before any monitor reads its last step, stops
    training after ``stop_at`` steps, and keeps each step's exact loss."""

    def __init__(self, device: FakeDevice, stop_at: int | None) -> None:
        self.device, self.stop_at, self.losses = device, stop_at, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.objective.last_step_loss is not None:
            self.losses[trainer.global_step] = pl_module.objective.last_step_loss.item()
            if trainer.global_step == self.stop_at:
                trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        self.device.training_ended = True


def fit_with_events(
    tmp_path,
    monkeypatch,
    accumulate: int,
    max_steps: int,
    stop_at: int | None = None,
    validate_every: int | None = None,
    warmup: int = 1,
) -> tuple[dict, list[dict], Watch, FakeDevice, TimedLM]:
    """A fit whose monitors run on the CUDA clock over stand-in events."""
    device = FakeDevice()
    event = type("Event", (FakeEvent,), {"device": device})
    monkeypatch.setattr(
        step_monitor, "clock_for", lambda _, first, last: CudaEventClock(first, last, event_class=event)
    )
    L.seed_everything(0)
    batches = _batches(len(MICRO_BATCH_MS), 2, masked_prefix=[0, 9, 21, 4])
    watch = Watch(device, stop_at)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
        logger=False,
        callbacks=[
            watch,
            ThroughputMonitor(),
            MFUMonitor(peak_tflops=1.0, measure_ceiling=False),
            RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=warmup),
        ],
        val_check_interval=validate_every,
        limit_val_batches=1 if validate_every else 0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = TimedLM(device)
    trainer.fit(
        module,
        DataLoader(batches, batch_size=None),
        DataLoader(batches[:1], batch_size=None) if validate_every else None,
    )
    return json.loads((tmp_path / "run.json").read_text()), batches, watch, device, module


def expected_seconds(step: int, accumulate: int) -> float:
    return sum(MICRO_BATCH_MS[(step - 1) * accumulate : step * accumulate]) / 1000


def useful_tokens(batches: list[dict], step: int, accumulate: int) -> int:
    return sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches[(step - 1) * accumulate : step * accumulate])


@pytest.mark.parametrize(
    ("accumulate", "max_steps", "stop_at", "validate_every"),
    [
        (1, 5, None, None),
        (2, 5, None, 4),  # a validation run after step 2 (4 micro-batches): paused out of step 3
        (3, 4, 2, None),  # training stopped early, at step 2
    ],
)
def test_each_step_gets_its_own_device_time_tokens_and_loss(
    tmp_path, monkeypatch, accumulate, max_steps, stop_at, validate_every
):
    """Step N's values are read at step N+1's end and the last step's at the end of training, each
    under its own step: step time = the device time of exactly its micro-batches, tokens/s x time =
    its useful tokens, MFU x time = its FLOPs, loss = the objective's loss of that step; the host
    waits only for events that a later boundary has passed, once per step. Seen failing with step N
    given step N+1's time (step 1 read 0.005 s for 0.003 s), with the newest step read at once, as
    a synchronising clock does (a stall at every step end), with step N given step N+1's tokens
    (44 useful tokens for 62), and with pauses not subtracted (step 3 read 1.03 s for 0.03 s)."""
    record, batches, watch, device, module = fit_with_events(
        tmp_path, monkeypatch, accumulate, max_steps, stop_at, validate_every
    )
    steps = record["steps"]
    last = stop_at or max_steps
    assert [s["step"] for s in steps] == list(range(1, last + 1))
    for s in steps:
        seconds = expected_seconds(s["step"], accumulate)
        assert s["step_time_s"] == pytest.approx(seconds, rel=1e-9), s["step"]
        assert s["useful_tokens_per_sec"] * seconds == pytest.approx(useful_tokens(batches, s["step"], accumulate))
        assert s["tokens_per_sec"] * seconds == pytest.approx(accumulate * 2 * SEQ)
        assert s["loss"] == pytest.approx(watch.losses[s["step"]], rel=1e-6)
        flops = s["mfu"] * 1e12 * seconds
        assert flops == pytest.approx(module.flops_per_token(SEQ) * accumulate * 2 * SEQ, rel=1e-6)
    assert device.stalls == []
    assert device.boundary_waits == last  # each step's end event, once (the last at the end of training)


def test_warm_up_steps_leave_the_summary_and_only_they(tmp_path, monkeypatch):
    record, *_ = fit_with_events(tmp_path, monkeypatch, accumulate=1, max_steps=6, warmup=2)
    times = [expected_seconds(step, 1) for step in range(3, 7)]
    summary = record["summary"]["step_time_s"]
    assert summary["n"] == 4
    assert (summary["min"], summary["max"]) == (pytest.approx(min(times)), pytest.approx(max(times)))


def test_the_clocks_read_a_step_one_step_later_and_pauses_out():
    """The clock alone: after ``close(N)`` step N-1 is known and step N is not until ``finish``;
    a pause inside a step is subtracted, on the event clock as on the wall clock."""
    device = FakeDevice()
    event = type("Event", (FakeEvent,), {"device": device})
    clock = CudaEventClock(event_class=event)
    device.now_ms = 10.0
    clock.close(1)
    device.now_ms = 14.0
    clock.pause()
    device.now_ms = 114.0
    clock.resume()
    device.now_ms = 120.0
    clock.close(2)
    assert clock.timing(1).seconds == pytest.approx(0.010)
    with pytest.raises(KeyError):
        clock.timing(2)
    clock.finish()
    assert clock.timing(2).seconds == pytest.approx(0.010)  # 110 ms, of which 100 paused

    wall = WallClock()
    wall.pause()
    time.sleep(0.05)
    wall.resume()
    wall.close(1)
    wall.finish()
    assert wall.timing(1).seconds < 0.04


def test_a_step_s_device_sums_are_read_with_its_end_event_once_and_without_a_stall():
    """The sums of a step are copied before its end mark, so the one wait for that mark a step later
    covers them: one read per step (one wait), and no wait for an event no later boundary passed. A
    monitor's own sums (``sum_outputs``) travel in the same copy. Seen failing with those sums
    overwritten by each micro-batch instead of added ([1.0, 2.0] for [2.0, 4.0])."""
    device = FakeDevice()
    event = type("Event", (FakeEvent,), {"device": device})
    clock = CudaEventClock(event_class=event)
    clock.sum_outputs("preference")
    outputs = {
        "tokens": 8,
        "useful_tokens": torch.tensor(5),
        "flops": 1.0,
        "loss_sum": torch.tensor(2.5),
        "preference": torch.tensor([1.0, 2.0]),
    }
    clock.add(outputs)
    clock.add(outputs)
    clock.close(1)
    clock.close(2)  # a later boundary: step 1 is read now
    totals = clock.timing(1)
    assert (totals.tokens, totals.useful_tokens, totals.loss_units, totals.loss_sum) == (16, 10, 10, 5.0)
    assert totals.extra == {"preference": [2.0, 4.0]} and totals.micro_batches == 2
    assert device.stalls == [] and device.boundary_waits == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_event_clock_agrees_with_a_synchronised_wall_clock(tmp_path):
    """On a GPU: each step's event time equals the wall time between synchronisations at every step
    end (the old clock), within 3% over 10 steps of a model large enough for ~10 ms steps."""

    class SyncedWallClock(L.Callback):
        def __init__(self) -> None:
            self.marks: dict[int, float] = {}

        def on_train_start(self, trainer, pl_module):
            torch.cuda.synchronize()
            self.marks[0] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            self.marks[trainer.global_step] = time.perf_counter()

    L.seed_everything(0)
    factory = ModelFactory(
        preset="tiny-llama",
        config={
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
        },
    )
    module = CausalLM(factory, warmup_steps=0)
    wall = SyncedWallClock()
    trainer = L.Trainer(
        max_steps=12,
        accelerator="gpu",
        devices=1,
        logger=False,
        callbacks=[wall, ThroughputMonitor(), RunRecorder(path=str(tmp_path / "run.json"))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(_batches(12, 8, masked_prefix=[0]), batch_size=None))
    steps = json.loads((tmp_path / "run.json").read_text())["steps"]
    for s in steps[2:]:
        wall_seconds = wall.marks[s["step"]] - wall.marks[s["step"] - 1]
        assert s["step_time_s"] == pytest.approx(wall_seconds, rel=0.03), s["step"]


def test_a_checkpoint_carries_the_loss_of_the_step_it_was_saved_at(tmp_path):
    """The loss is read a step late, but a checkpoint saved at a step's end (a resumed run's
    ``steps_before_resume``) must carry that step's loss too. Seen failing without reading the
    closed steps before the save (step 2 missing from a checkpoint saved at step 2)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_ablate.callbacks.run_recorder import LOSS_CHECKPOINT_KEY

    L.seed_everything(0)
    module = CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=0)
    watch = Watch(FakeDevice(), stop_at=None)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[watch, RunRecorder(path=str(tmp_path / "run.json")), saver],
    )
    trainer.fit(module, DataLoader(_batches(3, 2, masked_prefix=[0, 7]), batch_size=None))
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=2*.ckpt")
    carried = torch.load(checkpoint, weights_only=False)[LOSS_CHECKPOINT_KEY]
    assert carried == {1: pytest.approx(watch.losses[1], rel=1e-6), 2: pytest.approx(watch.losses[2], rel=1e-6)}
