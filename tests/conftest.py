"""Rules every test obeys, enforced here rather than remembered in each test file.

1. Tests never write into the checkout. The whole session runs with its working directory in
   pytest's temp dir, so whatever a test writes by a relative path (a shipped config's
   ``default_root_dir: runs/...``, Lightning's ``lightning_logs/``, a CLI subprocess started
   without ``cwd``) lands there: a leftover ``runs/sft_tiny/lightning_logs/version_0`` once sent
   a user's own run to ``version_1``. Tests find repository files through ``Path(__file__)``.
2. Tests never fork the pytest process (fork without exec). A child forked after this process
   compiled or started threads inherits their state but not the threads, and can wait forever
   (Lightning's ``ddp_fork`` hung here too:
   docs/platform.md#forking-after-inductor-compiled-deadlocks). Ranks come from
   ``tests.distributed.run_ranks`` (a forkserver); a test that forks anyway fails, naming itself.
   ``subprocess`` (fork + exec) and DataLoader workers (no compile, no collectives) are fine.
3. One intra-op thread per process (``OMP_NUM_THREADS=1`` unless set, read when torch loads,
   inherited by CLI subprocesses; ranks set it too). On 2 cores shared with ranks and other work,
   two OpenMP threads per process wait on each other: a 5-step tiny-Llama fit took 2-9 s with 2
   threads and 0.3 s with 1 on a loaded machine; test_moe.py + test_packing.py 30-68 s vs 20 s.
4. The longest files start first (``LONGEST_FILES``). pytest-xdist's ``--dist loadfile`` hands out
   files with the most tests first, which put the files of one or two long end-to-end tests (the
   user guide, the SLURM cluster, the examples) last, one worker busy with one of them while the
   other had nothing left; longest first, the run ends on short files.
5. No test inherits a process group. A test that fails between a process group's start and its end
   (an in-process fit, a simulated rank) leaves it initialised in the worker, and any later test of
   that worker that starts one failed with "trying to initialize the default
   process group twice" (seen: every test of test_simulated_rank.py after one such failure). It is
   destroyed after each test.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test module imports torch (rule 3)
_forks: list[str] = []  # "<test and phase>: <where it forked>", recorded in the parent before each fork
_ALLOWED_FORKERS = ("subprocess.py", "torch/utils/data/")
_TESTS = os.path.dirname(os.path.abspath(__file__))

pytest_plugins = ["pytester"]  # tests/test_conftest_rules.py runs these rules on small test files


def _note_fork() -> None:
    stack = traceback.extract_stack()[:-1]
    if not any(allowed in frame.filename for frame in stack for allowed in _ALLOWED_FORKERS):
        caller = next((f for f in reversed(stack) if f.filename.startswith(_TESTS)), stack[-1])
        _forks.append(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {caller.filename}:{caller.lineno}")


os.register_at_fork(before=_note_fork)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    if _forks:
        where = "\n".join(dict.fromkeys(_forks))  # one line per place, not per rank
        _forks.clear()
        report.outcome = "failed"
        report.longrepr = (
            "forked the pytest process "
            "(docs/platform.md#forking-after-inductor-compiled-deadlocks):\n"
            f"{where}\nstart ranks with tests.distributed.run_ranks (Lightning: strategy 'ddp' inside it)"
        )
    return report


LONGEST_FILES = (
    "tests/test_slurm_cluster.py",
    "tests/test_benchmarks.py",
    "tests/test_user_guide.py",
    "tests/test_gradient_check_study.py",
    "tests/test_examples.py",
    "tests/test_estimate_composition.py",
    "tests/test_context_parallel.py",
    "tests/test_step_stalls.py",
    "tests/test_bad_inputs.py",
    "tests/test_tensor_parallel.py",
    "tests/test_pipeline_mesh.py",
    "tests/test_mesh_triples.py",
    "tests/test_estimate_memory.py",
    "tests/test_moe_expert_parallel.py",
    "tests/test_ablation_runner.py",
    "tests/test_distributed_helper.py",
    "tests/test_tensor_parallel_composition.py",
    "tests/test_exact_match.py",
    "tests/test_memory_categories.py",
    "tests/test_ablation_report.py",
    "tests/test_dpo.py",
    "tests/test_adapters_strategies.py",
    "tests/test_ablation_slurm.py",
    "tests/test_ablation_cli.py",
    "tests/test_ablation_first_try.py",
)
"""The files that took longest on 2 cores (``python -m pytest -n 2 --dist loadfile --durations=0``, summed
per file), longest first: started first (rule 4). A file missing here only starts later."""


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below (rule 4)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order


RENDEZVOUS_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
)


@pytest.fixture(autouse=True)
def _no_rendezvous_from_an_earlier_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without a distributed rendezvous in the environment, and leaves none behind.
    Lightning's subprocess launcher writes ``MASTER_PORT`` and friends into the launching process (a test
    that fits on two ranks in-process); a later test's ``lit-ablate fit`` subprocess inherited that port
    and failed with EADDRINUSE (seen in CI: two multi-rank CLI tests on port 42519)."""
    for name in RENDEZVOUS_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """Rule 5: whatever process group a test leaves initialised is destroyed after it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _cwd_outside_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests (and the processes they start) run in a temporary directory, with lit-ablate's caches
    (matmul ceilings, tokenised data) in temporary ones too: never in the checkout or the user's home."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    caches = {"LIT_ABLATE_CACHE_DIR": "cache", "LIT_ABLATE_DATA_CACHE": "data_cache"}
    saved = {name: os.environ.get(name) for name in caches}
    os.environ.update({name: str(tmp_path_factory.mktemp(folder)) for name, folder in caches.items()})
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.chdir(before)
