"""Import-time warnings of optional libraries that change nothing in a run, kept off stderr.

torchao (the 8-bit optimizer extra, imported by transformers' quantizer registry whenever it is
installed) tries to load its CUDA/GPU C extensions at import and logs one "Failed to load
..._C_*.so" warning per library when they cannot load (a CPU machine, or wheels built for another
Python), and registering its enums with torch's pytree makes torch log a deprecation line per
enum. Its optimizers use neither; on stderr they would turn every one-line refusal of a bad config
into five lines. Only those exact messages are filtered; everything else both libraries log stays.
"""

from __future__ import annotations

import logging


def _not_torchao_extension_load(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Failed to load ") and ".so" in message)


logging.getLogger("torchao").addFilter(_not_torchao_extension_load)


def _not_enum_constant_deprecation(record: logging.LogRecord) -> bool:
    return "is an Enum subclass and is now natively supported by torch.compile" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_not_enum_constant_deprecation)
