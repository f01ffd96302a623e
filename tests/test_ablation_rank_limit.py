"""Far more CPU ranks than cores is refused up front: by ``fit`` before any rank starts, and as a
skipped variant in a study (today's bug: ``trainer.devices: 64`` on 2 cores starts 64 processes
that hang until the timeout)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ablate.cli import main
from lit_ablate.errors import ConfigError
from lit_ablate.rules import Scope, first_refusal
from lit_ablate.rules.devices import CPU_RANKS_PER_CORE, check_cpu_ranks, usable_cpu_cores

QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")


def test_limit_is_ranks_per_core_times_usable_cores():
    check_cpu_ranks({"accelerator": "cpu", "devices": CPU_RANKS_PER_CORE * 2}, cores=2)  # at the limit: runs
    with pytest.raises(ConfigError) as info:
        check_cpu_ranks({"accelerator": "cpu", "devices": str(CPU_RANKS_PER_CORE * 2 + 1)}, cores=2)
    assert info.value.key == "trainer.devices"
    assert f"{CPU_RANKS_PER_CORE * 2 + 1} ranks on 2 usable cores" in str(info.value)
    assert f"at most {CPU_RANKS_PER_CORE * 2} devices" in str(info.value)
    check_cpu_ranks({"accelerator": "gpu", "devices": 64}, cores=2)  # GPUs are counted elsewhere
    check_cpu_ranks({"accelerator": "cpu", "devices": "auto"}, cores=2)  # one rank


def test_study_variant_with_too_many_cpu_ranks_is_skipped_with_the_numbers():
    too_many = CPU_RANKS_PER_CORE * usable_cpu_cores() + 1
    here = (Scope.CONFIG, Scope.MACHINE)
    reason = first_refusal({"trainer": {"accelerator": "cpu", "devices": too_many}}, *here, skips_variant=True)
    assert reason is not None and reason.startswith(f"trainer.devices={too_many}: on CPU every rank is a process")
    assert first_refusal({"trainer": {"accelerator": "cpu", "devices": 2}}, *here) is None


def test_fit_refuses_before_any_rank_starts(tmp_path: Path, capsys):
    """In-process: had the check come after the launch, this would start 64 processes and hang."""
    too_many = CPU_RANKS_PER_CORE * usable_cpu_cores() * 8
    with pytest.raises(SystemExit) as info:
        main(
            [
                "fit",
                "--config",
                QUICKSTART,
                "--trainer.devices",
                str(too_many),
                "--trainer.default_root_dir",
                str(tmp_path),
            ]
        )
    message = capsys.readouterr().err.strip()
    assert info.value.code == 2  # a config error
    assert message.startswith(f"lit-ablate: error: trainer.devices={too_many}: on CPU every rank is a process")
    assert "\n" not in message and not list(tmp_path.iterdir()), "nothing ran"
