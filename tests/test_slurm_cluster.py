"""Studies on a real SLURM cluster: two nodes on this machine (``tests/slurm_cluster.py``), jobs that
run the real ``lit-ablate fit``, one cluster for the whole module.

Each test names the broken mechanism it was seen failing with. The module skips with the reason
where the cluster cannot start (not root, no apt); with ``LIT_ABLATE_REQUIRE_SLURM=1`` (CI) it fails
instead. Tiny runs (one decoder layer, 32-token rows, 12 steps) and one requeued job that is also
one of the study's variants keep the module to ~145 s on the 2-core dev machine with other tests
beside it; most of it is the 13 ``lit-ablate fit`` processes' start-up (imports, ~8 s of CPU each).
The runs' configs differ from the local reference only where the test says.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from slurm_cluster import HOLDING, REQUIRE_ENV, ClusterUnavailable, SlurmCluster, start_cluster

from lit_ablate.ablation.spec import parse_study
from lit_ablate.commands.ablate import run_study
from lit_ablate.record import read_record

pytest.importorskip("submitit", reason="submitit not installed (pip install 'lit-ablate[slurm]')")
pytestmark = pytest.mark.slurm

TESTS = Path(__file__).resolve().parent
QUICKSTART = TESTS.parent / "configs" / "quickstart.yaml"
STEPS = 12
CHECKPOINT_EVERY = 3
PAUSED_AT = 7
"""The requeue test's first attempt holds at this step, after the checkpoint of the step before."""
DDP = {"class_path": "lit_ablate.strategies.DDPStrategy"}
FSDP2 = {"class_path": "lit_ablate.strategies.FSDP2Strategy"}
CHECKPOINTS = {
    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
    "init_args": {"save_last": True, "every_n_train_steps": CHECKPOINT_EVERY},
}
SHAPE = {  # a model and data small enough that a rank's start-up (imports) is most of a run
    "model.init_args.model.config": {"num_hidden_layers": 1},
    "data.init_args.source.init_args.num_documents": 80,
    "data.init_args.seq_len": 32,
    "data.init_args.batch_size": 2,
    "data.init_args.val_examples": 2,
    "trainer.limit_val_batches": 0,
}
ON_THIS_CLUSTER = {
    # n1 and n2 are names only this cluster knows: rank 0's address for the rendezvous is given
    # (Lightning would take the first node's name, which does not resolve: docs/platform.md#slurm-clusters)
    "setup": ["export MASTER_ADDR=127.0.0.1"],
    "poll_s": 0.5,
}
LOSS_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        started = start_cluster(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as err:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but the SLURM test cluster cannot start: {err}")
        pytest.skip(f"no SLURM test cluster here: {err}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(started.conf))
        # jobs inherit this environment from sbatch: no rendezvous or SLURM values of this process may leak
        for name in [n for n in os.environ if n.startswith(("SLURM_", "SBATCH_", "SRUN_")) and n != "SLURM_CONF"]:
            patch.delenv(name)
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
            patch.delenv(name, raising=False)
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        try:
            yield started
        finally:
            started.stop()


def study(
    variants: list[dict[str, Any]],
    vary: list[str],
    slurm: dict[str, Any] | None,
    overrides: dict[str, Any] | None = None,
    callbacks: list[dict[str, Any]] | None = None,
) -> Any:
    """A study of tiny runs that checkpoint every few steps; ``slurm`` None runs it on this machine."""
    launch: dict[str, Any] = {"accelerator": "cpu", "timeout_s": 300}
    if slurm is not None:
        launch.update(executor="slurm", slurm={**ON_THIS_CLUSTER, **slurm})
    return parse_study(
        {
            "name": "slurm",
            "base": str(QUICKSTART),
            "steps": STEPS,
            "warmup_steps": 1,
            "vary": vary,
            "overrides": {
                **SHAPE,
                "trainer.strategy": DDP,
                "trainer.callbacks": [CHECKPOINTS, *(callbacks or [])],
                **(overrides or {}),
            },
            "variants": variants,
            "launch": launch,
        }
    )


def losses(record: dict[str, Any]) -> dict[int, float]:
    return {step["step"]: step["loss"] for step in record["steps"]}


def largest_difference(ran: dict[int, float], reference: dict[int, float]) -> float:
    assert sorted(ran) == sorted(reference) == list(range(1, STEPS + 1)), (sorted(ran), sorted(reference))
    return max(abs(ran[s] - reference[s]) for s in reference)


def record_of(out: Path, variant: str) -> dict[str, Any]:
    return read_record(out / "runs" / variant / "seed0" / "run.json")


@pytest.fixture(scope="module")
def multi_node_study(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One study on the cluster: DDP 1 node x 2 tasks, DDP 2 nodes x 1 task, FSDP2 2 nodes x 1 task;
    and the same study on this machine (the 2-node variant cannot run here: its local twin is the
    1-node one). The 1-node DDP job is requeued mid-run (``scontrol requeue``, what pre-emption does):
    its first attempt holds at step 7 until then (``slurm_cluster.HoldFirstAttempt``), so the requeue
    lands mid-run every time, and the tests below see both a requeued and two uninterrupted jobs
    (one requeued job of its own cost ~50 s more on 2 cores)."""
    root = tmp_path_factory.mktemp("studies")
    marker = root / "held"
    hold = {"class_path": "slurm_cluster.HoldFirstAttempt", "init_args": {"step": PAUSED_AT, "marker": str(marker)}}
    variants = [
        {
            "name": "ddp_1x2",
            "overrides": {"trainer.callbacks": [CHECKPOINTS, hold]},
            "launch": {"devices": 2, "num_nodes": 1},
        },
        {"name": "ddp_2x1", "launch": {"devices": 1, "num_nodes": 2}},
        {"name": "fsdp2_2x1", "overrides": {"trainer.strategy": FSDP2}, "launch": {"devices": 1, "num_nodes": 2}},
    ]
    vary = ["trainer.strategy", "trainer.devices", "trainer.num_nodes"]
    requeued: list[str] = []

    def requeue_when_held() -> None:
        deadline = time.monotonic() + 240
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        job_id = json.loads((root / "cluster" / "runs" / "ddp_1x2" / "seed0" / "job.json").read_text())["job_id"]
        cluster.requeue(job_id)
        requeued.append(job_id)

    watcher = threading.Thread(target=requeue_when_held, daemon=True)
    watcher.start()
    report = run_study(study(variants, [*vary, "trainer.callbacks"], slurm={}), root / "cluster")
    watcher.join(timeout=5)
    here = [
        {"name": "ddp_1x2", "launch": {"devices": 2}},
        {"name": "fsdp2_1x2", "overrides": {"trainer.strategy": FSDP2}, "launch": {"devices": 2}},
    ]
    run_study(study(here, vary, slurm=None), root / "here")
    return {"cluster": root / "cluster", "here": root / "here", "report": report, "requeued": requeued}


def test_variants_run_as_real_jobs_on_one_and_two_nodes_with_the_losses_of_a_local_run(
    multi_node_study: dict[str, Any],
):
    """Each variant is a SLURM job whose tasks Lightning turns into ranks: its record names the job,
    its nodes and each rank's node rank, world size 2, and its losses equal the same run on this
    machine (DDP on one node x 2 tasks, requeued once, and on two nodes x 1 task, FSDP2 over two nodes;
    measured 0.0). Seen failing with ``--ntasks`` instead of ``--ntasks-per-node`` (Lightning refuses
    the job)."""
    out, here = multi_node_study["cluster"], multi_node_study["here"]
    placements = {"ddp_1x2": ["n1"], "ddp_2x1": ["n1", "n2"], "fsdp2_2x1": ["n1", "n2"]}
    twins = {"ddp_1x2": "ddp_1x2", "ddp_2x1": "ddp_1x2", "fsdp2_2x1": "fsdp2_1x2"}
    restarts = {"ddp_1x2": 1, "ddp_2x1": 0, "fsdp2_2x1": 0}
    for variant, nodes in placements.items():
        record = record_of(out, variant)
        assert record["summary"]["status"] == "ok", record["summary"]
        job = record["job"]
        assert job["cluster"] == "slurm" and job["id"].isdigit() and job["state"] == "COMPLETED"
        assert job["restarts"] == restarts[variant], (variant, job)
        assert job["nodes"] == nodes
        assert [(r["rank"], r["node_rank"]) for r in job["ranks"]] == [(0, 0), (1, len(nodes) - 1)]
        assert record["environment"]["world_size"] == 2 and record["environment"]["num_nodes"] == len(nodes)
        reference = record_of(here, twins[variant])
        assert reference["summary"]["status"] == "ok", reference["summary"]
        difference = largest_difference(losses(record), losses(reference))
        assert difference <= LOSS_TOLERANCE, f"{variant}: loss differs from the local run by {difference:.3g}"
    rows = [line for line in multi_node_study["report"].read_text().splitlines() if line.startswith("| ")]
    for variant in placements:
        assert any(re.match(rf"\| (\*\*)?{variant}(\*\*)? \| ok \|", row) for row in rows), rows


def test_a_requeued_job_resumes_from_its_checkpoint_with_the_whole_loss_curve(multi_node_study: dict[str, Any]):
    """The requeued job (``multi_node_study``'s 1-node DDP): SLURM starts it again, it resumes from its
    last checkpoint (step 6 of 12), its logs keep both attempts, its record says it restarted once, and
    its loss curve equals the uninterrupted local run's at every step (measured 0.0). Seen failing:
    resumed without the checkpoint (from step 0: ``resumed_from`` null), without the losses the
    checkpoint carries (steps 1-6 missing), and with the logs reopened for writing (the first
    attempt's lines lost)."""
    requeued = multi_node_study["requeued"]
    assert requeued, "the first attempt never reached the step it holds at"
    record = record_of(multi_node_study["cluster"], "ddp_1x2")
    assert record["summary"]["status"] == "ok", record["summary"]
    assert record.get("job"), "the record names no SLURM job: the run did not go through the cluster"
    assert record["job"]["restarts"] == 1 and record["job"]["id"] == requeued[0], record["job"]
    assert record.get("resumed_from"), "the requeued job started again from step 0: its fit got no --ckpt_path"
    assert record["resumed_from"]["step_offset"] == PAUSED_AT - 1, record["resumed_from"]
    reference = record_of(multi_node_study["here"], "ddp_1x2")
    difference = largest_difference(losses(record), losses(reference))
    assert difference <= LOSS_TOLERANCE, f"the resumed curve differs from the uninterrupted one by {difference:.3g}"
    run_dir = multi_node_study["cluster"] / "runs" / "ddp_1x2" / "seed0"
    log = (run_dir / "stderr.log").read_text()
    held, restarted = log.find(f"{HOLDING} {PAUSED_AT}"), log.find(f"--- restart 1 of job {requeued[0]}: resuming from")
    assert 0 <= held < restarted, log  # the first attempt's lines, then the second's
    assert "run record:" in log[restarted:], log
    assert (run_dir / "attempts" / "run.0.json").is_file()


@pytest.mark.timeout(300)
def test_a_job_that_dies_is_a_failed_row_with_its_reason_never_a_hang(cluster: SlurmCluster, tmp_path: Path):
    """Jobs that die on a cluster without accounting (``sacct`` answers nothing, as here): one killed
    before its fit starts (its batch script SIGKILLs itself, so no task leaves a result) and one whose
    fit refuses its config in the job (a vocabulary smaller than the tokenizer's, found when the model
    is built). Both become failed rows with their reason and the study ends. Seen failing with the
    scheduler's state read only from sacct (as submitit's watcher does: ``UNKNOWN`` for ever, the
    study waited until this test's timeout)."""
    killed = {**ON_THIS_CLUSTER, "setup": ["kill -9 $$"]}
    variants = [
        {"name": "killed", "launch": {"slurm": killed}},
        {
            "name": "bad_vocab",
            "overrides": {"model.init_args.model.config": {"num_hidden_layers": 1, "vocab_size": 100}},
        },
    ]
    spec = study(variants, ["model.init_args.model.config"], slurm={})
    out = tmp_path / "dying"
    report = run_study(spec, out)
    summary = {variant: record_of(out, variant)["summary"] for variant in ("killed", "bad_vocab")}
    assert summary["killed"]["status"] == "error", summary["killed"]
    assert summary["killed"]["message"].startswith("scheduler: FAILED"), summary["killed"]["message"]
    assert summary["bad_vocab"]["status"] == "error", summary["bad_vocab"]
    assert "model.init_args.model.config.vocab_size=100" in summary["bad_vocab"]["message"]
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    for variant in ("killed", "bad_vocab"):
        assert any(re.match(rf"\| (\*\*)?{variant}(\*\*)? \| error", row) for row in rows), rows
