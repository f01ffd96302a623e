"""fp8 under FSDP2 on 2 gloo ranks trains the one-process fp8 model (emulated tensorwise).

Both 2-rank runs (weights gathered in high precision, and ``fsdp_all_gather``: weights cast to
fp8 before the all-gather with scales precomputed after each optimizer step) share one
``run_ranks`` call and are compared with one process over 5 steps of the step-objective data
(unequal useful tokens per rank). Tolerances are ``test_step_objective``'s (fp32 reduction
order): a weight's scale comes from the whole weight (an all-reduced amax under fp8
all-gather), so sharding must not change what a layer computes.

The one-process reference accumulates the same two micro-batches the two ranks read, not one
batch of all four rows: tensorwise fp8 scales activations and output gradients per tensor, so a
micro-batch's rows quantise differently next to other rows (measured: step losses 0.04 apart
from step 1 against the one-batch run). Data parallelism with fp8 equals accumulation, as the
global token mean requires, but not a larger micro-batch.

Seen failing with the scale precompute broken on purpose (run after the first optimizer step
only, so later steps gather weights updated since with stale scales): the fp8 all-gather run's
step-3 loss is 2.6e-3 off. (Running it *before* ``super().optimizer_step`` is not a bug: the
step's forward runs inside the optimizer's closure, after it.)
"""

from __future__ import annotations

import pytest

from lit_ablate.strategies import FSDP2Strategy
from tests.distributed import run_ranks
from tests.test_fp8 import fit
from tests.test_step_objective import assert_same_training

STEPS = 3


def _two_rank_fits(rank: int, world_size: int) -> dict:
    return {
        name: fit(STEPS, fp8={"fsdp_all_gather": gather}, strategy=FSDP2Strategy(), devices=2, rank=rank)
        for name, gather in (("fsdp2", False), ("fsdp2_fp8_all_gather", True))
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_rank_fits, 2, init_process_group=False, timeout_s=500)


@pytest.mark.slow  # one 2-rank run of two fits: ~15 s on a quiet machine, 35 s on a loaded one
@pytest.mark.parametrize(("name", "gathered"), [("fsdp2", 0), ("fsdp2_fp8_all_gather", 2 * 7)])
def test_fsdp2_fp8_equals_one_process(fp8_run, two_ranks, name, gathered):
    for rank in two_ranks:
        assert rank[name]["fp8_gathered"] == gathered  # fp8 all-gather really on (its weight subclass), or off
        assert_same_training(rank[name], fp8_run, steps=STEPS)


@pytest.fixture(scope="module")
def fp8_run() -> dict:
    return fit(STEPS, fp8={"recipe": "tensorwise"}, accumulate=2)
