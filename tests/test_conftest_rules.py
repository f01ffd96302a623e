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


def test_this_process_runs_the_thread_count_the_environment_sets():
    """Rule 3: the variable is set before torch loads, so it takes effect (1 unless the user set it)."""
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
