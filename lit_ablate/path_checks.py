"""Paths a run will read or write, checked before any work: a folder or file that will be written must be
writable (nothing is created to find out), a checkpoint to read must be one Lightning wrote, a file a run
saved for later runs (a cache) must load.

Without these, an unwritable ``default_root_dir`` fails after the model is built and a text file
given as ``--ckpt_path`` fails as a pickle error deep inside ``torch.load``. Each check raises
``ConfigError`` naming the option, the path and the fix.
"""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

from lit_ablate.errors import ConfigError

SHARDED_METADATA_FILENAME = "meta.pt"
"""Lightning's name for the non-tensor part of a sharded (DCP folder) checkpoint."""
DEEPSPEED_TAG_FILENAME = "latest"
"""What DeepSpeed writes into a checkpoint folder of its own format (the tag of its newest save)."""
DEEPSPEED_STATES_FILENAME = "mp_rank_00_model_states.pt"
"""The file of a DeepSpeed checkpoint's tag folder that holds Lightning's loop, data and module state."""


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint folder in DeepSpeed's own format (``DeepSpeedStrategy`` writes them)."""
    folder = Path(path).expanduser()
    return (folder / DEEPSPEED_TAG_FILENAME).is_file() and not (folder / SHARDED_METADATA_FILENAME).is_file()


def deepspeed_states_file(path: str | Path) -> Path:
    """The newest save's states file of a DeepSpeed checkpoint folder (its ``latest`` tag)."""
    folder = Path(path).expanduser()
    return folder / (folder / DEEPSPEED_TAG_FILENAME).read_text().strip() / DEEPSPEED_STATES_FILENAME


def writable_dir(key: str, path: str | Path) -> Path:
    """``path`` as a folder that accepts new files: an existing folder, or one that can be created where no
    file stands in its way. Nothing is created (a refusal that comes after this check leaves nothing behind):
    the nearest existing folder on the way is probed with a temporary file, which is removed."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(key, str(path), "it is a file, not a folder; give a folder path")
    _check_creatable(key, path, folder, "choose a writable folder")
    return folder


def writable_file(key: str, path: str | Path) -> Path:
    """``path`` as a file that can be (re)written: not a folder, in a folder that exists or can be created
    (nothing is created, as for ``writable_dir``)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise ConfigError(key, str(path), "it is a folder; give a file path (e.g. .../run.json)")
    _check_creatable(key, path, file.parent, "choose a writable path")
    return file


def _check_creatable(key: str, given: str | Path, folder: Path, fix: str) -> None:
    """Refuse ``folder`` when a file stands on its way or its nearest existing folder takes no new file."""
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(key, str(given), f"cannot write there ({existing} is a file, not a folder); {fix}")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise ConfigError(key, str(given), f"cannot write there ({err.strerror or err}); {fix}") from err


def checkpoint_path(key: str, path: str | Path, deepspeed: bool = False) -> Path:
    """``path`` as a Lightning checkpoint: a ``torch.save`` file (a zip archive) or a sharded folder
    holding ``meta.pt``, or with ``deepspeed`` (a ``DeepSpeedStrategy`` run reads it) a DeepSpeed folder.
    Cheap: only the archive's directory is read, never the tensors."""
    checkpoint = Path(path).expanduser()
    fix = "give a .ckpt file or sharded checkpoint folder written by lit-ablate fit (e.g. .../checkpoints/last.ckpt)"
    if checkpoint.is_dir():
        if is_deepspeed_checkpoint(checkpoint):
            if deepspeed and deepspeed_states_file(checkpoint).is_file():
                return checkpoint
            raise ConfigError(
                key,
                str(path),
                "a DeepSpeed checkpoint (ZeRO's own per-rank partitions), which does not reshard and from which only "
                "lit_ablate.strategies.DeepSpeedStrategy resumes; resume with it on the ranks that wrote it "
                "(lit-ablate export and generate read the folder as it is)",
            )
        if not (checkpoint / SHARDED_METADATA_FILENAME).is_file():
            raise ConfigError(
                key, str(path), f"a folder without {SHARDED_METADATA_FILENAME} is not a sharded checkpoint; {fix}"
            )
    elif not checkpoint.is_file():
        raise ConfigError(key, str(path), f"no such file or folder; {fix}")
    elif not zipfile.is_zipfile(checkpoint):
        raise ConfigError(key, str(path), f"not a checkpoint (torch.save writes a zip archive); {fix}")
    return checkpoint


def saved_file(key: str, path: str | Path, required: tuple[str, ...], fix: str) -> Path:
    """``path`` as a file a run reads back if it is there (a cache it wrote): absent, it must be writable
    (``writable_file``); present, a ``torch.save`` archive of a mapping with the ``required`` keys that
    loads with ``weights_only=True``. Otherwise ``ConfigError`` naming ``key`` and ``fix``, instead of torch's
    own error from the middle of the run (an ``UnpicklingError`` that advises ``weights_only=False``)."""
    file = Path(path).expanduser()
    if not file.exists():
        return writable_file(key, path)
    if file.is_dir():
        raise ConfigError(key, str(path), "it is a folder; give a file path")
    if not zipfile.is_zipfile(file):
        raise ConfigError(key, str(path), f"not a file lit-ablate wrote (torch.save writes a zip archive); {fix}")
    import pickle

    import torch

    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(key, str(path), f"it does not load as plain tensors ({reason[:120]}); {fix}") from err
    missing = [name for name in required if not isinstance(saved, dict) or name not in saved]
    if missing:
        raise ConfigError(key, str(path), f"not a file lit-ablate wrote (no {', '.join(missing)}); {fix}")
    return file


def looks_local(name: str) -> bool:
    """A filesystem path rather than a hub name (``org/name``): it exists, or it is written as a path."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()
