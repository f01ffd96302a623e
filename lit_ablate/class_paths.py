"""What a dotted ``class_path`` names: the one way lit-ablate imports a class a config or checkpoint names.

Configs name classes as LightningCLI does (``lit_ablate.strategies.FSDP2Strategy``); run records,
checkpoints and the optimizer table name them the same way.
"""

from __future__ import annotations

import importlib
from typing import Any


def import_class(class_path: str) -> Any:
    """The attribute ``class_path`` (``package.module.Name``) names.

    Raises ``ImportError`` when the module does not import or has no such attribute (also for a
    path without a module), so a caller handles one exception type for "does not import".
    """
    module, _, name = class_path.rpartition(".")
    if not module:
        raise ImportError(f"{class_path!r} is not a dotted path (package.module.Name)")
    try:
        return getattr(importlib.import_module(module), name)
    except AttributeError as err:
        raise ImportError(f"{module} has no {name}") from err
