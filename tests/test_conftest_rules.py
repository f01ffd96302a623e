"""The rules ``tests/conftest.py`` enforces, checked on small test files in a separate pytest run.

Catches a conftest that stops noticing forks of the test process (the guard against a fork after
inductor compiled, docs/platform.md, coming back through a new ``ddp_fork`` test) or stops moving
the working directory out of the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


@pytest.fixture
def run_tests(pytester: pytest.Pytester):
    pytester.makeconftest(CONFTEST)
    return lambda source: pytester.runpytest_subprocess("-p", "no:cacheprovider", pytester.makepyfile(source))


def test_a_test_that_forks_the_test_process_fails_naming_itself(run_tests):
    result = run_tests(
        """
        import multiprocessing

        def test_forks():
            process = multiprocessing.get_context("fork").Process(target=int)
            process.start()
            process.join()
            assert process.exitcode == 0

        def test_subprocess_is_fine():
            import subprocess, sys
            assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
        """
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*forked the pytest process*", "*test_forks (call)*", "*run_ranks*"])


def test_tests_run_outside_the_checkout(run_tests, pytester: pytest.Pytester):
    result = run_tests(
        f"""
        import os

        def test_cwd():
            assert os.getcwd() != {str(pytester.path)!r}
            os.makedirs("runs/quickstart/lightning_logs")
        """
    )
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "runs").exists()


def test_a_process_group_a_test_leaves_is_gone_before_the_next_test(run_tests):
    """Rule 5. Seen failing without the fixture (the second test found the first one's group)."""
    result = run_tests(
        """
        import torch.distributed as dist

        def test_leaves_a_group(tmp_path):
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)

        def test_starts_without_one():
            assert not dist.is_initialized()
        """
    )
    result.assert_outcomes(passed=2)


def test_this_process_runs_the_thread_count_the_environment_sets():
    """Rule 3: the variable is set before torch loads, so it takes effect (1 unless the user set it)."""
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_the_longest_files_exist_and_start_first(request: pytest.FixtureRequest):
    """Rule 4: every file ``LONGEST_FILES`` names exists (a renamed file would silently start last
    again), and pytest-xdist's reordering by test count is off, so the session's order is what rule 4
    sorted. Seen failing with a listed file renamed, and with the reorder option left on."""
    from tests.conftest import LONGEST_FILES

    root = Path(__file__).resolve().parents[1]
    assert [name for name in LONGEST_FILES if not (root / name).is_file()] == []
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
    if hasattr(request.config.option, "loadscopereorder"):
        assert request.config.option.loadscopereorder is False
