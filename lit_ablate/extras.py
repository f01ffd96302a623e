"""Optional packages: which ``pip install 'lit-ablate[extra]'`` brings each, asked before a feature needs one.

A feature that imports an optional package (fp8 imports torchao, a study on SLURM submitit) checks it is
installed first, with ``require``, and refuses in one line naming the key that chose the feature and the
extra to install: the import itself, deep inside a run, ended in a 90-line ``ModuleNotFoundError``.
``installed`` asks the import system without importing anything (torchao takes seconds to import).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from lit_ablate.errors import ConfigError

EXTRAS: dict[str, str] = {
    "torchao": "fp8",
    "submitit": "slurm",
    "zstandard": "mds",
    "flash_attn": "gpu",
    "liger_kernel": "gpu",
    "cut_cross_entropy": "gpu",
    "triton": "kernels-cpu",
    "tensorboard": "trackers",
    "wandb": "trackers",
    "mlflow": "trackers",
    "deepspeed": "deepspeed",
}
"""Each optional package (its import name) and the extra of ``pyproject.toml`` that installs it (torchao
also comes with ``optim8bit``, liger and cce with ``kernels-cpu`` for Triton's interpreter on CPU)."""
PACKAGES: dict[str, str] = {
    "flash_attn": "flash-attn",
    "liger_kernel": "liger-kernel",
    "cut_cross_entropy": "cut-cross-entropy",
    "mlflow": "mlflow-skinny",
}
"""Distribution names where they differ from the import name."""


def installed(module: str) -> bool:
    """Whether ``module`` (an import name) can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or a module without a spec
        return False


def not_installed(module: str, feature: str, extra: str | None = None) -> str | None:
    """``fp8 training needs torchao, which is not installed here: pip install 'lit-ablate[fp8]'`` when
    ``module`` is missing (``extra``: another extra that brings it, the one of ``feature``), else None."""
    if installed(module):
        return None
    package = PACKAGES.get(module, module)
    return (
        f"{feature} needs {package}, which is not installed here: pip install 'lit-ablate[{extra or EXTRAS[module]}]'"
    )


def require(module: str, key: str, value: Any, feature: str, extra: str | None = None) -> None:
    """Raise ``ConfigError`` naming ``key`` (what chose ``feature``), its ``value`` and the extra to install
    when ``feature``'s package ``module`` is missing (``not_installed``)."""
    reason = not_installed(module, feature, extra)
    if reason:
        raise ConfigError(key, value, reason)
