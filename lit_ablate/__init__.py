"""lit-ablate: ablation studies of LLM training techniques on PyTorch Lightning."""

__version__ = "0.1.0"

from lit_ablate import import_warnings  # noqa: F401  (before any optional library is imported)
from lit_ablate.models.losses import triton_interpreter

triton_interpreter.set_before_triton_loads()  # LIT_ABLATE_TRITON_INTERPRET=1: before anything imports triton
