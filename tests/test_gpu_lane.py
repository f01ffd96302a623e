"""The GPU lane (``benchmarks/gpu/``) is checked here, on the CPU, so that its one device run is not
spent on a mistake: its step table is well formed and fits the 8-minute budget, every flag a step
passes is one its script defines, a failing or hanging step loses only itself, and ``render`` turns
a lane's JSON into the results table with each figure beside its anchor and goal.

What each test catches (each seen failing with the mechanism broken on purpose):

- ``test_step_limits_fit_the_budget``: a step's limit raised so the sum passes 8 minutes (fp8 at
  150 s: 545 s > 480 s);
- ``test_every_flag_a_step_passes_is_defined_by_its_script``: a misspelt flag (``--seqlen`` in the
  mfu step);
- ``test_a_failing_and_a_hanging_step_lose_only_themselves``: a non-zero return code counted as
  ``ok``; the process group not killed at the limit (the lane then waited 21 s for the sleeper);
- ``test_render_puts_each_figure_beside_its_anchor_and_goal``: a ``<=`` goal compared as ``>=``
  (the Liger row then says yes at 0.30 against <= 0.21).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"


def _load(name: str) -> ModuleType:
    """A module of benchmarks/gpu (not a package), registered so its dataclasses resolve."""
    spec = importlib.util.spec_from_file_location(f"gpu_lane_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


lane = _load("lane")
render = _load("render")


def test_step_table_is_well_formed():
    names = [step.name for step in lane.STEPS]
    assert len(names) == len(set(names))
    assert names[:2] == ["env", "gpu_tests"], "versions first, then every gpu-marked test (the issue's order)"
    for step in lane.STEPS:
        assert re.fullmatch(r"[a-z0-9_]+", step.name)
        assert isinstance(step.timeout_s, int) and step.timeout_s > 0
        assert step.argv[0] == "{python}"
        assert step.collect in lane.COLLECTORS
        assert step.name in lane.HEADLINES
        assert step.dry_argv or step.name == "env", f"{step.name}: no CPU variant for the dry run"
        script = step.argv[1]
        if script.endswith(".py"):
            assert (ROOT / script).is_file(), script
    files = lane.gpu_test_files()
    assert "tests/test_memory_categories.py" in files and "tests/test_gpu_lane.py" not in files
    assert all(lane.GPU_MARK in (ROOT / f).read_text() for f in files)
    pytest_step = next(s for s in lane.STEPS if s.name == "gpu_tests")
    assert lane.command(pytest_step, Path("/scratch"), dry_run=False)[-len(files) :] == files


def test_step_limits_fit_the_budget():
    """One device call of at most 9 minutes on a fresh machine, compile warm-ups included, with time
    left for the machine's own start of the command."""
    total = sum(step.timeout_s for step in lane.STEPS) + lane.INSTALL_RESERVE_S + lane.FINISH_RESERVE_S
    assert lane.LANE_BUDGET_S <= 9 * 60 - 20
    assert total <= lane.LANE_BUDGET_S, f"step limits and reserves add up to {total} s > {lane.LANE_BUDGET_S} s"
    step = lane.STEPS[2]
    assert lane.step_timeout(step, dry_run=False, seconds_left=1000) == step.timeout_s
    assert lane.step_timeout(step, dry_run=False, seconds_left=30) == 30 - lane.FINISH_RESERVE_S
    assert lane.step_timeout(step, dry_run=True, seconds_left=-5) == lane.DRY_RUN_TIMEOUT_S


def _defined_options(source: str) -> set[str]:
    return set(re.findall(r"""add_argument\(\s*["'](--[a-z0-9-]+)["']""", source))


def test_every_flag_a_step_passes_is_defined_by_its_script():
    """A typo in the table would otherwise cost a step of the device run (the dry run catches it
    too, in minutes; this in milliseconds)."""
    for step in lane.STEPS:
        argv = [*step.argv, *step.dry_argv]
        if argv[1].endswith(".py"):
            script = ROOT / argv[1]
        else:  # pytest's own flags, and LightningCLI's dotted keys (checked by the dry run)
            continue
        defined = _defined_options(script.read_text())
        used = {arg for arg in argv if arg.startswith("--")}
        assert used <= defined, f"{step.name}: {sorted(used - defined)} not defined in {script.relative_to(ROOT)}"


def test_result_lines_become_numbers_or_text():
    lines = [
        "noise",
        "RESULT a=1",
        "RESULT b=0.25",
        "RESULT gpu=NVIDIA H100 80GB HBM3",
        "  RESULT ok=True",
        "RESULT none=None",
        "RESULTS c=3",
    ]
    assert lane.result_lines(lines) == {"a": 1, "b": 0.25, "gpu": "NVIDIA H100 80GB HBM3", "ok": True, "none": None}


def test_pytest_outcomes_from_junit_xml_and_from_verbose_lines(tmp_path):
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_x"/>'
        '<testcase classname="tests.test_a" name="test_y"><skipped message="needs 2 CUDA devices"/></testcase>'
        '<testcase classname="tests.test_b" name="test_z"><failure message="assert 1 == 2">trace</failure></testcase>'
        "</testsuite></testsuites>"
    )
    got = lane.collect_pytest(["collecting ... collected 9 items / 6 deselected / 3 selected"], tmp_path)
    assert (got["selected"], got["passed"], got["skipped"], got["failed"]) == (3, 1, 1, 1)
    assert got["tests"]["tests.test_a::test_y"] == {"outcome": "skipped", "message": "needs 2 CUDA devices"}
    killed = [
        "tests/test_a.py::test_x PASSED [ 50%]",
        "tests/test_a.py::test_y SKIPPED (needs flash-attn) [100%]",
        "SKIPPED [1] tests/test_a.py:12: needs the flash-attn package",
    ]
    got = lane.collect_pytest(killed, tmp_path / "no-xml-here")
    assert got["passed"] == 1 and got["tests"]["tests/test_a.py::test_y"]["message"] == "needs the flash-attn package"


def test_pytest_durations_are_collected():
    lines = [
        "============================= slowest 15 durations =============================",
        "21.35s call     tests/test_loss_kernels.py::test_compiled_kernel_matches_torch[liger_bf16_cuda]",
        "3.02s setup    tests/test_attention.py::test_gpu_backends_train_packed_like_separate_documents[flex]",
    ]
    got = lane.collect_pytest(lines, Path("/no-xml-here"))["durations"]
    assert got == [
        {
            "seconds": 21.35,
            "phase": "call",
            "test": "tests/test_loss_kernels.py::test_compiled_kernel_matches_torch[liger_bf16_cuda]",
        },
        {
            "seconds": 3.02,
            "phase": "setup",
            "test": "tests/test_attention.py::test_gpu_backends_train_packed_like_separate_documents[flex]",
        },
    ]


def test_the_compile_cache_comes_back_and_is_restored_only_when_small_enough(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    (cache / "inductor" / "fx").mkdir(parents=True)
    (cache / "inductor" / "fx" / "graph").write_bytes(b"x" * 1000)
    (cache / "triton").mkdir()
    (cache / "triton" / "kernel.cubin").write_bytes(b"y" * 10)
    out.mkdir()
    assert lane.save_compile_cache(cache, out).startswith("compile_cache.tar.gz")
    restored = tmp_path / "fresh"
    assert lane.restore_compile_cache(restored, out / lane.COMPILE_CACHE)["restored"] is True
    assert (restored / "inductor" / "fx" / "graph").read_bytes() == b"x" * 1000
    assert (restored / "triton" / "kernel.cubin").read_bytes() == b"y" * 10
    assert lane.save_compile_cache(cache, out, limit=10).startswith("not saved")
    assert not (out / lane.COMPILE_CACHE).exists(), "an archive too large to come back is not left in $OUT"
    assert lane.restore_compile_cache(tmp_path / "none", out / lane.COMPILE_CACHE) == {"restored": False}


def test_a_failing_and_a_hanging_step_lose_only_themselves(tmp_path):
    """Steps run in order, each in its own process group under its own limit; the JSON has them all."""
    steps = (
        lane.Step("first", "prints a result", ("{python}", "-c", "print('RESULT x=1.5')"), 20),
        lane.Step("fails", "exits 3", ("{python}", "-c", "import sys; print('boom'); sys.exit(3)"), 20),
        lane.Step("hangs", "sleeps past its limit", ("{python}", "-c", "import time; time.sleep(30)"), 1),
        lane.Step("last", "still runs", ("{python}", "-c", "print('RESULT y=done')"), 20),
    )
    started = time.time()
    record = lane.run_lane(steps, tmp_path, dry_run=False, started_at=started)
    assert time.time() - started < 8, "the hanging step was not stopped at its limit"
    statuses = {name: entry["status"] for name, entry in record["steps"].items()}
    assert statuses == {"first": "ok", "fails": "failed", "hangs": "timeout", "last": "ok"}
    assert record["steps"]["first"]["results"] == {"x": 1.5} and record["steps"]["last"]["results"] == {"y": "done"}
    assert record["steps"]["fails"]["returncode"] == 3 and "boom" in record["steps"]["fails"]["tail"]
    assert json.loads((tmp_path / "lane.json").read_text())["steps"].keys() == record["steps"].keys()
    assert "===== hangs" in (tmp_path / "lane.log").read_text()
    table = lane.summary_table(record)
    assert "| fails | failed |" in table and "| hangs | timeout |" in table


def test_steps_past_the_budget_are_skipped_not_started(tmp_path):
    steps = (lane.Step("late", "would run", ("{python}", "-c", "print('RESULT ran=1')"), 20),)
    record = lane.run_lane(steps, tmp_path, dry_run=False, started_at=time.time() - lane.LANE_BUDGET_S + 8)
    assert record["steps"]["late"]["status"] == "skipped" and "results" not in record["steps"]["late"]


def _sample_lane() -> dict:
    tests = {
        "tests.test_attention::test_gpu_backends_train_packed_like_separate_documents[fa_varlen]": {
            "outcome": "skipped",
            "message": "flash-attn varlen needs CUDA and the flash-attn package",
        },
        "tests.test_memory_categories::test_on_cuda": {"outcome": "passed", "message": ""},
    }
    breakdown = {
        "step": 3,
        "method": "cuda_max_allocated",
        "at_peak": {"params": 2**20, "activations": 3 * 2**20},
        "max": {"params": 2**20, "activations": 4 * 2**20},
    }

    def step(status, results, tail=""):
        return {
            "what": "w",
            "command": "c",
            "timeout_s": 60,
            "status": status,
            "seconds": 12.5,
            "results": results,
            "tail": tail,
        }

    return {
        "lane": {
            "budget_s": 480,
            "dry_run": False,
            "started_at": "2026-12-01T10:00:00+0000",
            "elapsed_s": 401.2,
            "prepared": {"git_commit": "0123456789abcdef", "git_dirty": False},
        },
        "steps": {
            "env": step("ok", {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "torch_cuda": "13.0"}),
            "gpu_tests": step(
                "failed", {"passed": 1, "failed": 0, "error": 0, "skipped": 1, "selected": 2, "tests": tests}
            ),
            "mfu_seed": step(
                "ok",
                {
                    "seed_useful_tokens_per_s": 66123.4,
                    "seed_lit_vs_hand": 0.975,
                    "seed_mfu_seed_formula": 0.655,
                    "seed_attention": "torch_varlen",
                },
            ),
            "mfu": step("ok", {"dense_mfu": 0.612, "dense_mfu_measured": 0.77, "dense_attention": "flex"}),
            "loss": step("ok", {"liger_memory_ratio": 0.30, "cce_working_mib": 0.5}),
            "moe": step("timeout", {}, tail="compiling...\nstill compiling"),
            "fit": step(
                "ok",
                {
                    "status": "ok",
                    "tensor_method": "cuda_max_allocated",
                    "peak_tensor_bytes": 4 * 2**20,
                    "tensor_breakdown": breakdown,
                },
            ),
        },
    }


def _rows(text: str, label: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if f"| {label} |" in line
    ]


def _row(text: str, label: str) -> list[str]:
    return _rows(text, label)[0]


def test_render_puts_each_figure_beside_its_anchor_and_goal(tmp_path):
    text = render.readme(_sample_lane())
    assert text.startswith("# GPU lane: NVIDIA H100 80GB HBM3, 2026-12-01")
    assert "torch 2.11.0+cu130 (CUDA 13.0)" in text and "0123456789" in text
    seed = _row(
        text, "useful tokens/s, Qwen3-0.6B + 65,537 tokens (vocab 217,473), 10,240-token packed rows, bf16, compiled"
    )
    assert seed[2:] == [
        "66,123 tok/s",
        "~61k (seed: one H100, 32 x 10,240-token packs, FA3 varlen + Liger + compile)",
        ">= 65000",
        "yes",
    ]
    assert _row(text, "lit-ablate / the hand-written loop, useful tokens/s, same run")[2:] == [
        "0.975x",
        "—",
        ">= 0.98x",
        "no",
    ]
    assert _row(text, "our MFU / spec peak")[2:] == ["0.612", "—", "—", "—"], "an older lane's step 'mfu' still renders"
    liger = _row(text, "Liger fused linear-CE peak / torch's (V 151,936, H 1024, 16k tokens)")
    assert liger[2:] == ["0.3", "0.21 (Liger: -79% memory)", "<= 0.21", "no"]
    assert _row(text, "CCE: loss memory beyond its gradients")[2:] == ["0.50 MiB", "1 MB (CCE paper)", "<= 1.0", "yes"]
    moe = _row(text, "grouped vs loop experts, Qwen3-30B-A3B layer, bf16 fwd+bwd")
    assert moe[2] == "(timeout)" and moe[5] == "n/a"
    assert [r[2:] for r in _rows(text, "packed attention used")] == [
        ["torch_varlen", "—", "== fa_varlen or torch_varlen or flex", "yes"],
        ["flex", "—", "== fa_varlen or torch_varlen or flex", "yes"],
    ]
    assert _row(text, "memory measured by")[-1] == "yes"
    skipped = _row(text, "`tests.test_attention::test_gpu_backends_train_packed_like_separate_documents[fa_varlen]`")
    assert skipped[1:] == ["skipped", "flash-attn varlen needs CUDA and the flash-attn package"]
    assert _row(text, "activations")[1:] == ["3.00", "4.00"]
    assert "### moe (timeout)" in text and "still compiling" in text and "### mfu" not in text
    assert (
        _row(text, "useful tokens/s, Qwen3-0.6B (vocab 151,936), 8,192-token packed rows, bf16, compiled")[2]
        == "(not reported)"
    )


def test_render_saves_the_results_folder(tmp_path):
    lane_json = tmp_path / "lane.json"
    lane_json.write_text(json.dumps(_sample_lane()))
    assert render.results_folder(_sample_lane()).name == "h100-2026-12-01"
    folder = render.save(lane_json, tmp_path / "h100-2026-12-01")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "lane.json", "log_tails.md"]
    assert "## moe (timeout, 12.5 s)" in (folder / "log_tails.md").read_text()


def test_a_rerun_is_shown_beside_the_lane_never_instead_of_it(tmp_path):
    """A step rerun by hand on the same machine (a longer limit) gets its own section: its figures
    beside the lane's, its pytest failures with the message pytest printed. Seen failing with the
    rerun's value written into the lane's column (the MFU row then read 0.238 twice) and with the
    failure messages not read from a log without JUnit XML (an empty message)."""
    log = tmp_path / "mfu.log"
    log.write_text("noise\nRESULT dense_mfu=0.238\nRESULT dense_useful_tokens_per_s=44058.5\n")
    tests_log = tmp_path / "tests.log"
    tests_log.write_text(
        "tests/test_a.py::test_x[p] FAILED [ 50%]\ntests/test_a.py::test_y PASSED [100%]\n"
        "=================================== FAILURES ===================================\n"
        "______ test_x[p] ______\n\n    def test_x():\n>       boom()\nE       RuntimeError: mat1 (32x6)\n"
    )
    reruns = [render.Rerun("mfu", 150, log), render.Rerun("gpu_tests", 150, tests_log)]
    text = render.readme(_sample_lane(), reruns)
    assert _row(text, "dense_mfu") == ["dense_mfu", "0.612", "0.238"]  # the sample lane's step is the older "mfu"
    assert _row(text, "dense_useful_tokens_per_s")[1:] == ["n/a", "44,058"]
    assert _row(text, "`tests/test_a.py::test_x[p]`")[1:] == ["failed", "RuntimeError: mat1 (32x6)"]
    assert _row(text, "our MFU / spec peak")[2] == "0.612", "the figures table shows the lane's value, not the rerun's"
    folder = render.save(_write(tmp_path / "lane.json", _sample_lane()), tmp_path / "out", reruns)
    assert (folder / "rerun_mfu.log").read_text() == log.read_text()


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path
