"""Import-time warnings of optional libraries that change nothing in a run, kept off stderr.

torchao (the 8-bit optimizer extra, imported by transformers' quantizer registry whenever it is
installed) tries to load its CUDA/GPU C extensions at import and logs one "Failed to load
..._C_*.so" warning per library when they cannot load (a CPU machine, or wheels built for another
Python), and registering its enums with torch's pytree makes torch log a deprecation line per
enum. Its optimizers use neither; on stderr they would turn every one-line refusal of a bad config
into five lines. bitsandbytes (imported by peft) warns on every CPU import that an optional kernel
package is missing ("Failed to load CPU gemm_4bit_forward from kernels-community"), which changes
nothing here (its own CPU kernels run). Lightning warns on every run started on a machine where
SLURM's ``srun`` is on PATH but not used (a login node, or any host with SLURM's client installed):
a ``lit-ablate fit`` started there is a local run by intent, a study's SLURM jobs start their ranks
with ``srun`` (``launch.executor: slurm``), and the two-line warning broke the one-line error.
Lightning 2.6 builds torch pytree ``LeafSpec`` objects, which torch 2.13 deprecates with a
``FutureWarning`` on every run: a note to Lightning's developers, nothing a user can act on. It is
filtered only where Lightning's ``_pytree`` module raises it, so our own code would still see it.
Only those exact messages are filtered; everything else these libraries log stays.
"""

from __future__ import annotations

import logging
import warnings


def _not_torchao_extension_load(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Failed to load ") and ".so" in message)


logging.getLogger("torchao").addFilter(_not_torchao_extension_load)


def _not_enum_constant_deprecation(record: logging.LogRecord) -> bool:
    return "is an Enum subclass and is now natively supported by torch.compile" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_not_enum_constant_deprecation)


def _not_bitsandbytes_kernel_package(record: logging.LogRecord) -> bool:
    return "gemm_4bit_forward from kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_bitsandbytes_kernel_package)


warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
warnings.filterwarnings(
    "ignore",
    message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    category=FutureWarning,
    module=r"lightning\.pytorch\.utilities\._pytree",
)
