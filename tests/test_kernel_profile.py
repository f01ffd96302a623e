"""``KernelProfile``: the top operators of a few profiled steps and torch.compile's graph breaks and
recompiles, written into the run record."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_ablate.callbacks import KernelProfile, RecordSection, RunRecorder, ThroughputMonitor
from lit_ablate.errors import ConfigError
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from tests.test_callbacks import _batches


def _fit(tmp_path, profile: KernelProfile, module: CausalLM | None = None, max_steps: int = 4) -> dict:
    L.seed_everything(0)
    module = module or CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=0)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ThroughputMonitor(), profile, RunRecorder(path=str(tmp_path / "run.json"))],
    )
    trainer.fit(module, DataLoader(_batches(2 * max_steps, 2, masked_prefix=[0, 5]), batch_size=None))
    return json.loads((tmp_path / "run.json").read_text())


def test_the_profiled_steps_top_operators_land_in_the_run_record(tmp_path):
    """Steps 2 and 3 of 4 profiled: the top operators by self time have non-zero times and calls,
    their shares of all operators' self time add up to at most 1, and all operators' time fits in
    the window's wall time. Seen failing with inclusive instead of self time (a parent counts its
    children's time again: 614 ms of operators in a 404 ms window) and with the window closed a
    step late (3 profiled steps)."""
    record = _fit(tmp_path, KernelProfile(start_step=2, num_steps=2, top=8))
    profile = record["profile"]
    assert (profile["profiled_steps"], profile["steps"], profile["kind"]) == (2, [2, 3], "cpu_operators")
    top = profile["top"]
    assert len(top) == 8 and all(op["time_ms"] > 0 and op["calls"] > 0 for op in top)
    assert [op["time_ms"] for op in top] == sorted((op["time_ms"] for op in top), reverse=True)
    assert 0 < sum(op["share"] for op in top) <= 1
    assert sum(op["time_ms"] for op in top) <= profile["device_ms"] <= profile["wall_ms"]
    assert any(op["name"] == "aten::mm" or op["name"] == "aten::addmm" for op in top)  # a model step is matmuls
    assert profile["compile"]["graph_breaks"] == 0 and profile["compile"]["recompiles"] == 0
    assert profile["host_syncs_per_step"] == {}  # CUDA's synchronisation calls: none on a CPU


class _BreakingLM(CausalLM):
    """A step that also runs a compiled function with a deliberate graph break, on 4 values until
    step 2 and on 6 from step 3 (a shape change: a recompile)."""

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        size = 4 if self.global_step < 2 else 6
        return {**output, "loss": output["loss"] + 0.0 * _with_break(torch.ones(size)).sum()}


def _doubled_then_incremented(x: torch.Tensor) -> torch.Tensor:
    x = x * 2
    torch._dynamo.graph_break()
    return x + 1


_with_break = torch.compile(_doubled_then_incremented, backend="eager", dynamic=False)


def test_graph_breaks_and_recompiles_of_the_fit_are_counted_with_their_reasons(tmp_path):
    """The function compiles into two graphs around the break (frames 0 and 1), and both frames
    compile again when the shape changes at step 3: 2 graph breaks (one per compile of the first
    frame), 4 graphs, 2 recompiles caused by the size guard. Seen failing with every compile counted
    as a recompile (4) and without the counters taken relative to the fit's start (the second fit in
    the same process reported the first one's 2 breaks and 4 graphs again)."""
    for run in ("first", "second"):  # the second fit recompiles nothing new: its own counts only
        folder = tmp_path / run
        folder.mkdir()
        record = _fit(
            folder,
            KernelProfile(start_step=2, num_steps=1),
            module=_BreakingLM(ModelFactory(preset="tiny-llama"), warmup_steps=0),
        )
        compile_ = record["profile"]["compile"]
        if run == "first":
            assert (compile_["graph_breaks"], compile_["unique_graphs"], compile_["recompiles"]) == (2, 4, 2)
            (reason,) = compile_["graph_break_reasons"]
            assert reason["count"] == 2 and "torch._dynamo.graph_break()" in reason["reason"]
            reasons = compile_["recompile_reasons"]
            assert len(reasons) == 2 and all(
                "size mismatch at index 0. expected 4, actual 6" in r["reason"] for r in reasons
            )
        else:
            assert (compile_["graph_breaks"], compile_["unique_graphs"], compile_["recompiles"]) == (0, 0, 0)


def test_profile_arguments_and_section_names_are_checked():
    with pytest.raises(
        ConfigError, match=r"trainer\.callbacks\[KernelProfile\]\.init_args\.num_steps=0: use 1 or more"
    ):
        KernelProfile(num_steps=0)
    with pytest.raises(ValueError, match="'steps' is one of the run record's own keys"):
        RecordSection("steps")


def test_a_window_past_the_end_of_training_records_no_operators_but_the_compile_counts(tmp_path):
    profile = _fit(tmp_path, KernelProfile(start_step=9, num_steps=2), max_steps=3)["profile"]
    assert (profile["profiled_steps"], profile["top"], profile["kind"]) == (0, [], None)
    assert profile["compile"]["graph_breaks"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_profile_names_cuda_kernels_and_the_host_syncs(tmp_path):
    L.seed_everything(0)
    module = CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=0)
    trainer = L.Trainer(
        max_steps=4,
        accelerator="gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ThroughputMonitor(),
            KernelProfile(start_step=2, num_steps=2, top=10),
            RunRecorder(path=str(tmp_path / "run.json")),
        ],
    )
    trainer.fit(module, DataLoader(_batches(4, 2, masked_prefix=[0]), batch_size=None))
    profile = json.loads((tmp_path / "run.json").read_text())["profile"]
    assert profile["kind"] == "cuda_kernels" and profile["profiled_steps"] == 2
    assert len(profile["top"]) == 10 and all(k["time_ms"] > 0 and k["calls"] > 0 for k in profile["top"])
    assert 0 < sum(k["share"] for k in profile["top"]) <= 1 and 0 < profile["device_ms"] <= profile["wall_ms"]
    assert all(name.startswith("cuda") and count > 0 for name, count in profile["host_syncs_per_step"].items())
