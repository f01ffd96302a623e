"""Learning-rate schedules (``lr_schedule``) against transformers' own schedule functions, over every
step of a run, and the refusals of values that would give a wrong schedule.

One warm-up serves every schedule: step ``s`` < ``warmup_steps`` uses ``(s + 1) / warmup_steps``,
which is transformers' warm-up one step later (theirs starts at LR 0). So during the warm-up
lit-ablate's step ``s`` is compared with transformers' step ``s + 1``, after it step for step.
transformers' ``linear`` and ``cosine`` decay to 0 (lit-ablate's ``min_lr_ratio: 0``); a final ratio
above 0 is compared with ``get_cosine_with_min_lr_schedule_with_warmup`` and ``get_wsd_schedule``
(its warm-up starts at ``min_lr_ratio``: compared after the warm-up only).

Seen failing with bugs put in on purpose: the warm-up as ``s / warmup_steps`` (every warm-up row and
``test_the_default_is_the_warmup_cosine_of_before``); ``sqrt`` as ``sqrt(1 - progress)`` (the
``wsd-sqrt`` rows); the wsd decay counted from the warm-up's end instead of the run's last
``decay_fraction`` (every ``wsd`` row); ``min_lr_ratio`` left out of ``linear`` (``linear-min``);
the ``min_lr_ratio`` range check removed (``test_values_that_would_give_a_wrong_schedule_are_refused``);
``configure_optimizers`` still calling the cosine schedule (``test_a_fit_steps_the_configured_schedule``).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from transformers import optimization as hf

from lit_ablate.callbacks import RunRecorder
from lit_ablate.errors import ConfigError
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import DPO, CausalLM
from lit_ablate.modules.optim import LRSchedule
from lit_ablate.record import read_record
from tests.test_step_objective import STEPS, micro_batches

TOTAL, WARMUP = 60, 7
HF_SHAPES = {"linear": "linear", "cosine": "cosine", "sqrt": "1-sqrt"}


def _theirs(make) -> list[float]:
    """transformers' factors for steps 0..TOTAL (one more than the run, for the shifted warm-up)."""
    scheduler = make(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
    factors = []
    for _ in range(TOTAL + 1):
        factors.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return factors


def _wsd(shape: str, fraction: float, ratio: float):
    return lambda opt, warmup: hf.get_wsd_schedule(
        opt,
        warmup,
        num_decay_steps=round(fraction * TOTAL),
        num_training_steps=TOTAL,
        decay_type=HF_SHAPES[shape],
        min_lr_ratio=ratio,
    )


def _decay_after_warmup(shape: str, ratio: float):
    """transformers' WSD with no stable phase: a decay from the warm-up's end to ``ratio`` at TOTAL."""
    return lambda opt, warmup: _wsd(shape, 1 - warmup / TOTAL, ratio)(opt, warmup)


# name: (lit-ablate's LRSchedule arguments, transformers' schedule (optimizer, warm-up steps), whether
# its warm-up starts at LR 0 like lit-ablate's)
CASES = {
    "linear": (
        {"schedule": "linear", "min_lr_ratio": 0.0},
        lambda opt, w: hf.get_linear_schedule_with_warmup(opt, w, TOTAL),
        True,
    ),
    "linear-min": ({"schedule": "linear", "min_lr_ratio": 0.2}, _decay_after_warmup("linear", 0.2), False),
    "cosine": (
        {"schedule": "cosine", "min_lr_ratio": 0.0},
        lambda opt, w: hf.get_cosine_schedule_with_warmup(opt, w, TOTAL),
        True,
    ),
    "cosine-min": (
        {"schedule": "cosine", "min_lr_ratio": 0.1},
        lambda opt, w: hf.get_cosine_with_min_lr_schedule_with_warmup(opt, w, TOTAL, min_lr_rate=0.1),
        True,
    ),
    "constant": ({"schedule": "constant", "min_lr_ratio": 0.1}, hf.get_constant_schedule_with_warmup, True),
    **{
        f"wsd-{shape}-{ratio}": (
            {"schedule": "wsd", "min_lr_ratio": ratio, "decay_fraction": 0.25, "decay_shape": shape},
            _wsd(shape, 0.25, ratio),
            ratio == 0,
        )
        for shape in HF_SHAPES
        for ratio in (0.0, 0.2)
    },
    "wsd-defaults": ({"schedule": "wsd", "min_lr_ratio": 0.0}, _wsd("cosine", 0.1, 0.0), True),
    "wsd-all-decay": (
        {"schedule": "wsd", "min_lr_ratio": 0.0, "decay_fraction": 1.0, "decay_shape": "linear"},
        _decay_after_warmup("linear", 0.0),
        True,
    ),  # the decay shortened to what the warm-up leaves
}


@pytest.mark.parametrize("warmup", [WARMUP, 0])
@pytest.mark.parametrize("case", list(CASES))
def test_each_schedule_equals_transformers_over_every_step(case: str, warmup: int) -> None:
    options, make, same_warmup = CASES[case]
    theirs = _theirs(lambda opt: make(opt, warmup))
    ours = [LRSchedule(warmup_steps=warmup, **options).factor(step, TOTAL) for step in range(TOTAL)]
    for step, factor in enumerate(ours):
        if step < warmup:
            if same_warmup:
                assert factor == pytest.approx(theirs[step + 1], rel=1e-12, abs=1e-15), f"warm-up step {step}"
        else:
            assert factor == pytest.approx(theirs[step], rel=1e-12, abs=1e-15), f"step {step}"
    assert ours[-1] < 1.0 or options["schedule"] == "constant"  # the run ends decayed: the comparison saw the decay


def test_the_default_is_the_warmup_cosine_of_before() -> None:
    """``lr_schedule: cosine`` (the default) is bit for bit the warm-up + cosine every run used before
    there was a choice (its formula, copied here), past the end of the run included."""

    def before(step: int, warmup: int, total: int, ratio: float) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    module = CausalLM(ModelFactory(preset="tiny-llama"))
    assert (module.hparams.lr_schedule, module.hparams.min_lr_ratio, module.hparams.warmup_steps) == ("cosine", 0.1, 10)
    for warmup, total in ((10, 100), (0, 17), (5, 3)):
        for step in range(total + 3):
            assert LRSchedule("cosine", warmup, 0.1).factor(step, total) == before(step, warmup, total, 0.1)


class LearningRates(Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_a_fit_steps_the_configured_schedule(tmp_path) -> None:
    """A Lightning fit applies ``lr_schedule`` (here wsd, half of the run decaying linearly) at
    every optimizer step: the LR each step trains with is the peak times ``LRSchedule.factor``, and the run
    record's ``steps[].lr`` is that rate. Seen failing with the record reading the rate at the step's end,
    after Lightning stepped the scheduler: each step showed the next one's (step 3: 6.7e-3 for 1e-2)."""
    pl.seed_everything(0, verbose=False)
    module = CausalLM(
        ModelFactory(preset="tiny-llama"),
        learning_rate=1e-2,
        warmup_steps=1,
        min_lr_ratio=0.0,
        lr_schedule="wsd",
        decay_fraction=0.6,
        decay_shape="linear",
    )
    seen = LearningRates()
    recorder = RunRecorder(path=str(tmp_path / "run.json"), warmup_steps=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        callbacks=[seen, recorder],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(micro_batches("reference"), batch_size=None))
    expected = [1e-2 * LRSchedule("wsd", 1, 0.0, 0.6, "linear").factor(s, STEPS) for s in range(STEPS)]
    assert seen.rates == pytest.approx(expected, rel=1e-12)
    assert [step["lr"] for step in read_record(tmp_path / "run.json")["steps"]] == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx([1e-2, 1e-2, 1e-2, 1e-2 * 2 / 3, 1e-2 / 3])  # warm-up, stable, decay


@pytest.mark.parametrize("module_class", [CausalLM, DPO])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_lr_ratio": -0.33}, r"model\.init_args\.min_lr_ratio=-0\.33: .*in \[0, 1\]"),
        ({"min_lr_ratio": 1.5}, r"model\.init_args\.min_lr_ratio=1\.5: .*in \[0, 1\]"),
        ({"lr_schedule": "wsd", "decay_fraction": 1.2}, r"model\.init_args\.decay_fraction=1\.2: .*in \[0, 1\]"),
        ({"lr_schedule": "wsd", "decay_fraction": -0.1}, r"model\.init_args\.decay_fraction=-0\.1: .*in \[0, 1\]"),
        ({"lr_schedule": "exponential"}, r"model\.init_args\.lr_schedule='exponential': choose one of \['linear', "),
        ({"lr_schedule": "wsd", "decay_shape": "step"}, r"model\.init_args\.decay_shape='step': choose one of"),
        (
            {"decay_fraction": 0.2},
            r"model\.init_args\.decay_fraction=0\.2: only lr_schedule: wsd .*\(lr_schedule is cosine\)",
        ),
    ],
)
def test_values_that_would_give_a_wrong_schedule_are_refused(module_class, options: dict, message: str) -> None:
    """``min_lr_ratio: -0.33`` used to be accepted and drove the learning rate negative at the end."""
    with pytest.raises(ConfigError, match=message):
        module_class(ModelFactory(preset="tiny-llama"), **options)


def test_dpo_takes_the_schedule_keys() -> None:
    """DPO's optimiser set-up is CausalLM's: the keys reach the scheduler it builds."""
    dpo = DPO(
        ModelFactory(preset="tiny-llama"),
        lr_schedule="wsd",
        decay_fraction=0.5,
        decay_shape="sqrt",
        min_lr_ratio=0.0,
        warmup_steps=0,
    )
    scheduler = dpo.learning_rate_schedule.scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 10)
    factors = []
    for _ in range(10):
        factors.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    assert factors[:5] == [1.0] * 5 and factors[5:] == pytest.approx([1 - math.sqrt(p / 5) for p in range(5)])
