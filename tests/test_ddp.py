"""Lightning DDP on 2 CPU ranks (gloo) trains the same model as one process with the same global batch.

The ranks come from ``run_ranks`` (strategy ``ddp`` on an externally launched group), not from
Lightning's ``ddp_fork``, which forks the test process: unsafe once an earlier test compiled or
started threads (docs/platform.md#forking-after-inductor-compiled-deadlocks), and a hang there waited
for pytest's timeout.
"""

import json
from pathlib import Path

import lightning as L
import pytest

from lit_ablate.callbacks import RunRecorder, ThroughputMonitor
from lit_ablate.data import LMDataModule, SyntheticText
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from tests.distributed import run_ranks

GLOBAL_BATCH, STEPS = 4, 5


def _fit(path: Path, devices: int) -> dict:
    L.seed_everything(0)
    data = LMDataModule(source=SyntheticText(num_documents=200), seq_len=64, batch_size=GLOBAL_BATCH // devices)
    module = CausalLM(ModelFactory(preset="tiny-llama"), warmup_steps=2)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        callbacks=[ThroughputMonitor(), RunRecorder(path=str(path), warmup_steps=1)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    return json.loads(path.read_text()) if trainer.is_global_zero else {}  # rank 0 writes the record


def _fit_rank(rank: int, world_size: int, path: str) -> dict:
    return _fit(Path(path), devices=world_size)


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process(tmp_path):
    """Each rank gets every second example of the same global order, so a step sees the same 4
    examples either way; equal token counts per rank make DDP's gradient average the global mean.
    Tolerance 1e-4 relative: the reduction order of the gradient all-reduce differs in fp32."""
    single = _fit(tmp_path / "single.json", devices=1)
    ddp = run_ranks(_fit_rank, 2, str(tmp_path / "ddp.json"), init_process_group=False)[0]
    assert ddp["environment"]["world_size"] == 2
    assert [s["loss"] for s in ddp["steps"]] == pytest.approx([s["loss"] for s in single["steps"]], rel=1e-4)
    # global throughput counts both ranks' tokens: twice this rank's own
    for s in ddp["steps"]:
        assert s["tokens_per_sec"] == pytest.approx(2 * s["tokens_per_sec_per_device"])
