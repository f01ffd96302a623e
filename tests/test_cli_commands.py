"""The commands a user tries first: help and version, refused abbreviations, file modes, the
estimate's exact numbers, an exported folder that Hugging Face tools load and round-trip, and a
quiet console."""

import os
import stat

import pytest

from lit_ablate.record import write_record

UMASK = 0o007  # differs from the usual 0o022, and from mkstemp's owner-only 0o600


@pytest.fixture
def umask():
    previous = os.umask(UMASK)
    yield 0o666 & ~UMASK
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_run_record_is_written_with_the_users_umask(tmp_path, umask):
    """Catches a record created through mkstemp (0o600: other users of a shared study cannot read it)."""
    path = write_record(tmp_path / "run.json", {"schema_version": 1})
    assert _mode(path) == umask == 0o660
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left behind
