"""Studies on a cluster (``launch.executor: slurm``): submitit's local executor runs a study end to
end through the submission path, and a stand-in SLURM (``sbatch``/``sacct``/``scancel``/``srun``
scripts on PATH) checks what would be asked of the scheduler, the partition check, tracking and
resume across invocations, without a cluster.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_ablation_runner import fake_resolve, install_fake_fit, launches, make_spec, record

from lit_ablate.ablation.slurm import JOB_FILENAME
from lit_ablate.commands.ablate import run_study
from lit_ablate.errors import ConfigError

pytest.importorskip("submitit", reason="submitit not installed (pip install 'lit-ablate[slurm]')")

FAKE_SBATCH = r"""#!{python}
import pathlib, shutil, sys
root = pathlib.Path({root!r})
counter = root / "next_id"
job_id = int(counter.read_text()) if counter.exists() else 1001
counter.write_text(str(job_id + 1))
(root / "submissions").mkdir(exist_ok=True)
shutil.copy(sys.argv[-1], root / "submissions" / f"{{job_id}}.sh")
print(f"Submitted batch job {{job_id}}")
"""
FAKE_SACCT = r"""#!{python}
import json, pathlib, sys
states = json.loads((pathlib.Path({root!r}) / "states.json").read_text() or "{{}}")
ids = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "-j"]
print("JobID|State|NodeList")
for job_id in ids:
    print(f"{{job_id}}|{{states.get(job_id, 'PENDING')}}|node1")
"""
FAKE_SCANCEL = r"""#!{python}
import pathlib, sys
with open(pathlib.Path({root!r}) / "cancelled", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
"""


@pytest.fixture
def fake_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return install_fake_fit(tmp_path, monkeypatch)


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in SLURM on PATH; returns its folder (``submissions/<id>.sh``, ``states.json``, ``cancelled``)."""
    import submitit

    root = tmp_path / "slurm"
    (root / "bin").mkdir(parents=True)
    (root / "states.json").write_text("{}")
    for name, text in (
        ("sbatch", FAKE_SBATCH),
        ("sacct", FAKE_SACCT),
        ("scancel", FAKE_SCANCEL),
        ("srun", "#!/bin/sh\n"),
    ):
        path = root / "bin" / name
        path.write_text(text.format(python=sys.executable, root=str(root)))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(submitit.SlurmJob, "watcher", submitit.slurm.slurm.SlurmInfoWatcher(delay_s=60))
    return root


def submitted(root: Path) -> dict[str, str]:
    folder = root / "submissions"
    return {p.stem: p.read_text() for p in sorted(folder.glob("*.sh"))} if folder.is_dir() else {}


def set_states(root: Path, states: dict[str, str]) -> None:
    (root / "states.json").write_text(json.dumps(states))


def test_local_cluster_runs_a_study_like_the_local_executor(tmp_path: Path, fake_fit: list[str]):
    """Same records and report through submitit's local executor as through the local runner;
    resume keeps finished runs (catches: a job's run folder, logs or record differing from a local run's)."""
    variants = [{"name": "slow"}, {"name": "fast", "overrides": {"fake.speed": 2}}]
    local = run_study(make_spec(variants), tmp_path / "local", fake_fit, fake_resolve)
    launch = {"executor": "slurm", "slurm": {"cluster": "local", "poll_s": 0.2}}
    out = tmp_path / "cluster"
    report = run_study(make_spec(variants, launch=launch), out, fake_fit, fake_resolve)
    for variant in ("slow", "fast"):
        ran, reference = record(out, variant), record(tmp_path / "local", variant)
        assert ran["summary"]["status"] == "ok", ran["summary"]
        assert [s["loss"] for s in ran["steps"]] == [s["loss"] for s in reference["steps"]]
        assert ran["job"]["cluster"] == "local" and ran["job"]["state"] == "FINISHED"
        run_dir = out / "runs" / variant / "seed0"
        assert (run_dir / "stdout.log").is_file() and (run_dir / "stderr.log").is_file()
        assert json.loads((run_dir / JOB_FILENAME).read_text())["job_id"]
    assert report.read_text().count("\n| ") == local.read_text().count("\n| ")
    assert launches(tmp_path).count("fast 0") == 2  # once locally, once through the local cluster
    run_study(make_spec(variants, launch=launch), out, fake_fit, fake_resolve)
    assert launches(tmp_path).count("fast 0") == 2, "a finished run is never submitted again"


def test_a_two_node_gpu_variant_asks_sbatch_for_its_resources(tmp_path: Path, fake_fit: list[str], fake_slurm: Path):
    """What submitit passes to sbatch for a 2-node x 8-GPU variant (catches: tasks per node not
    equal to the ranks Lightning's SLURM environment expects, GPUs or time limit not requested)."""
    launch = {
        "executor": "slurm",
        "devices": 8,
        "num_nodes": 2,
        "timeout_s": 5400,
        "slurm": {
            "partition": "h100",
            "account": "ablate",
            "gpus_per_node": 8,
            "max_nodes": 4,
            "cpus_per_task": 12,
            "sbatch": {"qos": "high"},
            "setup": ["module load cuda"],
        },
    }
    spec = make_spec([{"name": "a"}, {"name": "b", "overrides": {"model.init_args.lr": 0.2}}], launch=launch)
    run_study(spec, tmp_path / "study", fake_fit, fake_resolve, wait=False)
    jobs = submitted(fake_slurm)
    assert sorted(jobs) == ["1001", "1002"]
    script = jobs["1001"]
    for line in (
        "--nodes=2",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--partition=h100",
        "--account=ablate",
        "--cpus-per-task=12",
        "--time=90",
        "--qos=high",
        "--job-name=lit-ablate.a.seed0",
    ):
        assert f"#SBATCH {line}\n" in script, line
    assert "module load cuda" in script and "srun" in script
    assert launches(tmp_path) == [], "nothing ran here: the jobs are the scheduler's"


def test_sbatch_s_refusal_is_one_line_naming_the_slurm_settings(tmp_path: Path, fake_fit: list[str], fake_slurm: Path):
    """A partition or account the cluster does not have is known only to sbatch: its refusal reached
    the user as submitit's 45-line FailedJobError traceback. Seen failing without ``_submitted``."""
    sbatch = fake_slurm / "bin" / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: h200x' >&2\nexit 1\n")
    launch = {"executor": "slurm", "slurm": {"partition": "h200x"}}
    spec = make_spec([{"name": "a"}], launch=launch)
    with pytest.raises(
        ConfigError,
        match=r"launch\.slurm=.*'partition': 'h200x'.*sbatch refused a.*invalid partition "
        r"specified: h200x.*fix the partition",
    ):
        run_study(spec, tmp_path / "study", fake_fit, fake_resolve, wait=False)
    assert launches(tmp_path) == []


def test_a_variant_larger_than_the_partition_is_refused_before_anything_is_submitted(
    tmp_path: Path, fake_fit: list[str], fake_slurm: Path
):
    launch = {"executor": "slurm", "devices": 8, "slurm": {"gpus_per_node": 8}}
    spec = make_spec(
        [{"name": "fits"}, {"name": "too_big", "launch": {"devices": 16}}], launch=launch, vary=["trainer.devices"]
    )
    with pytest.raises(ConfigError, match=r"variants.too_big.launch.*16 GPUs per node.*have 8.*nothing was submitted"):
        run_study(spec, tmp_path / "study", fake_fit, fake_resolve, wait=False)
    assert submitted(fake_slurm) == {}


def test_rerun_resubmits_only_the_preempted_run_and_never_a_queued_one(
    tmp_path: Path, fake_fit: list[str], fake_slurm: Path
):
    """Across invocations: a queued or running job is never submitted twice, a pre-empted one is
    recorded with the scheduler's reason and resubmitted (catches: resubmitting every unfinished run,
    or losing the pre-emption)."""
    launch = {"executor": "slurm", "slurm": {"partition": "cpu"}}
    spec = make_spec([{"name": "a"}, {"name": "b", "overrides": {"model.init_args.lr": 0.2}}], launch=launch)
    out = tmp_path / "study"
    run_study(spec, out, fake_fit, fake_resolve, wait=False)
    assert sorted(submitted(fake_slurm)) == ["1001", "1002"]
    set_states(fake_slurm, {"1001": "RUNNING", "1002": "PENDING"})
    run_study(spec, out, fake_fit, fake_resolve, wait=False)
    assert sorted(submitted(fake_slurm)) == ["1001", "1002"], "queued and running jobs are not submitted again"
    set_states(fake_slurm, {"1001": "PREEMPTED", "1002": "RUNNING"})
    run_study(spec, out, fake_fit, fake_resolve, wait=False)
    assert sorted(submitted(fake_slurm)) == ["1001", "1002", "1003"]
    assert "--job-name=lit-ablate.a.seed0" in submitted(fake_slurm)["1003"]
    preempted = json.loads((out / "runs" / "a" / "seed0" / JOB_FILENAME).read_text())
    assert preempted["job_id"] == "1003"
    set_states(fake_slurm, {"1003": "TIMEOUT", "1002": "RUNNING"})
    run_study(spec, out, fake_fit, fake_resolve, wait=False)
    timed_out = record(out, "a")["summary"]
    assert timed_out["status"] == "timeout" and "scheduler: TIMEOUT" in timed_out["message"]
    run_study(spec, out, fake_fit, fake_resolve, wait=False)
    assert len(submitted(fake_slurm)) == 3, "a timed-out run is redone only with --retry-failed"


def test_a_changed_config_cancels_its_earlier_job(tmp_path: Path, fake_fit: list[str], fake_slurm: Path):
    launch = {"executor": "slurm", "slurm": {"partition": "cpu"}}
    out = tmp_path / "study"
    run_study(make_spec([{"name": "a"}], launch=launch), out, fake_fit, fake_resolve, wait=False)
    run_study(
        make_spec([{"name": "a", "overrides": {"model.init_args.lr": 0.3}}], launch=launch),
        out,
        fake_fit,
        fake_resolve,
        wait=False,
    )
    assert (fake_slurm / "cancelled").read_text().split() == ["1001"]
    assert sorted(submitted(fake_slurm)) == ["1001", "1002"]


def test_slurm_settings_are_checked_when_the_study_is_read():
    with pytest.raises(ConfigError, match=r"launch.slurm.max_job.*launch.slurm keys are"):
        make_spec([{"name": "a"}], launch={"executor": "slurm", "slurm": {"max_job": 2}})
    with pytest.raises(ConfigError, match=r"variants\[0\].launch.slurm.gpus_per_node=0"):
        make_spec([{"name": "a", "launch": {"slurm": {"gpus_per_node": 0}}}], launch={"executor": "slurm"})
    with pytest.raises(ConfigError, match=r"launch.executor='pbs'"):
        make_spec([{"name": "a"}], launch={"executor": "pbs"})


@pytest.mark.parametrize("answer", ["y", None])
def test_ctrl_c_asks_whether_to_cancel_the_submitted_jobs(
    tmp_path: Path, fake_fit: list[str], fake_slurm: Path, monkeypatch: pytest.MonkeyPatch, answer: str | None
):
    """On a terminal, "y" cancels every submitted job (recorded interrupted, redone on resume);
    without a terminal the jobs are left queued for the next invocation to collect."""
    from lit_ablate.ablation import slurm

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(slurm, "time", SimpleNamespace(sleep=interrupt))  # the runner's wait only (not subprocess's)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: answer is not None)
    monkeypatch.setattr(slurm.Console, "input", lambda self, prompt: answer)
    spec = make_spec(
        [{"name": "a"}, {"name": "b", "overrides": {"model.init_args.lr": 0.2}}],
        launch={"executor": "slurm", "slurm": {"partition": "cpu"}},
    )
    out = tmp_path / "study"
    with pytest.raises(KeyboardInterrupt):
        run_study(spec, out, fake_fit, fake_resolve)
    cancelled = (fake_slurm / "cancelled").read_text().split() if (fake_slurm / "cancelled").exists() else []
    if answer == "y":
        assert sorted(cancelled) == ["1001", "1002"]
        assert record(out, "a")["summary"]["status"] == "interrupted"
    else:
        assert cancelled == []
        run_study(spec, out, fake_fit, fake_resolve, wait=False)
        assert sorted(submitted(fake_slurm)) == ["1001", "1002"], "left running: collected, not resubmitted"


@pytest.mark.parametrize("partition_gpus", [8, None])
def test_a_gpu_study_plans_for_slurm_on_a_login_node_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, partition_gpus: int | None
):
    """Planning judges the nodes the study declares, never the machine planning it: with every CUDA
    probe of torch failing (a login node; torch+cpu says "Torch not compiled with CUDA enabled"), an
    fp8 / flash-attn / Liger study for a GPU partition plans with nothing skipped (a GPU's fp8
    kernels are judged by the job on its node), and for a partition without GPUs fp8 with
    ``emulate: false`` is refused for its CPU nodes. Seen failing: the AssertionError from
    fp8_runs_here's capability probe (issue 33), and a CPU partition judged by this machine's CUDA."""
    import torch

    import lit_ablate.fit_cli  # libraries probe CUDA once when imported: done before the probes fail
    import lit_ablate.models.fp8.conversion  # noqa: F401
    from lit_ablate.ablation.plan import plan_study
    from lit_ablate.ablation.spec import parse_study

    def probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("planning probed this machine's CUDA")

    for name in ("is_available", "device_count", "get_device_capability", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, probe)
    slurm = {"partition": "h100", "max_nodes": 4, **({"gpus_per_node": partition_gpus} if partition_gpus else {})}
    spec = parse_study(
        {
            "name": "gpu_parts",
            "base": str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"),
            "overrides": {"trainer.enable_checkpointing": False, "trainer.precision": "bf16-true"},
            "variants": [
                {"name": "fp8", "overrides": {"model.init_args.model.fp8": {"recipe": "tensorwise"}}},
                {
                    "name": "fp8_kernels",
                    "overrides": {"model.init_args.model.fp8": {"recipe": "tensorwise", "emulate": False}},
                },
                {"name": "flash", "overrides": {"model.init_args.model.attn_implementation": "flash_attention_2"}},
                {"name": "liger", "overrides": {"model.init_args.loss": "liger"}},
            ],
            "vary": ["model.init_args.model.fp8", "model.init_args.model.attn_implementation", "model.init_args.loss"],
            "steps": 5,
            "launch": {"executor": "slurm", "devices": 8, "num_nodes": 2, "accelerator": "auto", "slurm": slurm},
        }
    )
    runs = {run.variant.name: run for run in plan_study(spec, tmp_path / "study")}
    assert {name: run.invalid for name, run in runs.items()} == dict.fromkeys(runs)
    skipped = {name: run.skip_reason for name, run in runs.items() if run.skip_reason}
    if partition_gpus:
        assert skipped == {}
    else:
        assert list(skipped) == ["fp8_kernels"] and "emulate" in skipped["fp8_kernels"], skipped


def test_job_states_come_from_the_controller_where_sacct_has_no_accounting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Without SLURM's accounting daemon ``sacct`` fails for every job: states then come from
    ``scontrol``, and a job neither knows while the controller answers is ``GONE`` (final), so the
    runner collects it instead of waiting on ``UNKNOWN`` for ever. Seen failing without the
    controller fallback (every job ``UNKNOWN``)."""
    from lit_ablate.ablation.job_states import GONE, UNKNOWN, job_states

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "sacct": "#!/bin/sh\necho 'Slurm accounting storage is disabled' >&2\nexit 1\n",
        "scontrol": "#!/bin/sh\necho 'JobId=7 JobName=a UserId=root(0) JobState=RUNNING Reason=None Restarts=0'\n"
        "echo 'JobId=8 JobName=b UserId=root(0) JobState=FAILED Reason=NonZeroExitCode Restarts=0'\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert job_states(["7", "8", "9"]) == {"7": "RUNNING", "8": "FAILED", "9": GONE}
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 1\n")  # the controller does not answer: ask again later
    assert job_states(["7"]) == {"7": UNKNOWN}


def test_a_restarted_job_resumes_from_the_newest_complete_checkpoint(tmp_path: Path):
    """What a requeued job's tasks resume from: the newest ``.ckpt`` under the trainer folder, a file
    or a sharded folder with DCP's ``.metadata``; a sharded save cut short (no ``.metadata``) is not
    one. Seen failing with folders taken without their metadata (the cut-short save chosen)."""
    from lit_ablate.ablation.attempts import newest_checkpoint

    trainer = tmp_path / "trainer"
    assert newest_checkpoint(trainer) is None
    older = trainer / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=3.ckpt"
    older.parent.mkdir(parents=True)
    older.write_bytes(b"x")
    sharded = older.parent / "last.ckpt"
    sharded.mkdir()
    (sharded / "__0_0.distcp").write_bytes(b"x")
    (sharded / ".metadata").write_bytes(b"x")
    cut_short = trainer / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    cut_short.mkdir(parents=True)
    (cut_short / "__0_0.distcp").write_bytes(b"x")
    for age, path in enumerate([cut_short, sharded, older]):  # cut_short newest, older oldest
        os.utime(path, (1e9 - age * 100, 1e9 - age * 100))
    assert newest_checkpoint(trainer) == sharded
    os.utime(older, (2e9, 2e9))
    assert newest_checkpoint(trainer) == older


class _Task0:
    """submitit's ``JobEnvironment`` of rank 0 on one node (outside a cluster)."""

    global_rank, node, local_rank = 0, 0, 0


@pytest.mark.parametrize("restart", [0, 1])
def test_a_requeued_task_runs_its_fit_with_the_newest_checkpoint(tmp_path: Path, monkeypatch, restart: int):
    """What a task executes when SLURM starts its job again (``SLURM_RESTART_COUNT``), without a
    cluster: the run's fit command plus ``--ckpt_path`` of the newest checkpoint, its logs appended to,
    the earlier attempt's record kept; a first start runs the command as planned. The real-cluster
    test saw this only through a resumed record (and, without the checkpoint, as a TypeError on a
    missing field). Seen failing with ``--ckpt_path`` left off the restarted command."""
    import submitit

    from lit_ablate.ablation.slurm_task import SUBMITIT_DIRNAME, FitTask

    monkeypatch.setattr(submitit, "JobEnvironment", _Task0)
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run_dir, trainer = tmp_path / "run", tmp_path / "run" / "trainer"
    (run_dir / SUBMITIT_DIRNAME).mkdir(parents=True)
    checkpoint = trainer / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"x")
    (run_dir / "run.json").write_text('{"summary": {"status": "interrupted"}}')
    (run_dir / "stderr.log").write_text("first attempt\n")
    argv_file = tmp_path / "argv.json"
    fit = [
        sys.executable,
        "-c",
        f"import json, sys; json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))",
        "fit",
        "--config",
        "c.yaml",
    ]
    assert FitTask(tuple(fit), {}, str(run_dir), str(trainer))() == 0
    argv = json.loads(argv_file.read_text())
    log = (run_dir / "stderr.log").read_text()
    if restart:
        assert argv == ["fit", "--config", "c.yaml", "--ckpt_path", str(checkpoint)], (
            "the restarted fit does not resume"
        )
        assert log.startswith("first attempt\n") and f"restart 1 of job 4242: resuming from {checkpoint}" in log
        assert json.loads((run_dir / "attempts" / "run.0.json").read_text())["summary"]["status"] == "interrupted"
    else:
        assert argv == ["fit", "--config", "c.yaml"]
        assert log == "" and not (run_dir / "attempts").exists()


def test_a_slurm_task_unpickles_without_torch_or_lightning(tmp_path: Path):
    """Every task of a job unpickles ``FitTask`` (again at each restart) before its ``lit-ablate fit``
    starts: its module imports nothing heavy, so each rank's fit starts seconds sooner. Seen failing with
    ``FitTask`` in ``ablation.slurm`` (unpickling imported the planner, preflight, Lightning and torch:
    about 7 s of CPU per rank on 2 cores, before the fit paid the same again)."""
    import pickle
    import subprocess

    from lit_ablate.ablation.slurm_task import FitTask

    task = pickle.dumps(FitTask(("true",), {}, str(tmp_path), str(tmp_path)))
    code = (
        "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
        "print(sorted(m for m in ('torch', 'lightning', 'transformers', 'jsonargparse') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], input=task, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "[]"
