"""Cross-entropy backends behind one contract, chosen by config (``model.init_args.loss``).

Every backend takes the final hidden states, the LM-head weight (and bias) and labels that are
already shifted (``labels[i]`` is the target of position ``i``, ``-100`` = no loss), and returns the
**sum** of per-token cross-entropy over the counted labels as an fp32 scalar. The caller divides
by the number of useful tokens, so all backends normalise the same way and an ablation compares
only the kernel. A fused backend never materialises the ``[tokens, vocab]`` logits.

Every backend takes ``z_loss_weight`` (default 0): it adds ``z_loss_weight * logsumexp(logits)^2``
per counted token to the returned sum (PaLM's z-loss, which keeps the softmax normaliser near 1).
``cce`` accepts only 0: Cut Cross-Entropy does not expose the log-sum-exp.

Options reach a backend as ``loss_backend(name, **options)`` (the module's ``loss_options``);
unknown options, bad values and names raise ``ConfigError`` naming the key.

``liger`` and ``cce`` import fine on a CPU machine and fail at their first kernel, so they are
gated on ``torch.cuda.is_available()`` when they are built, unless ``LIT_ABLATE_TRITON_INTERPRET=1``
runs their kernels through Triton's interpreter (``lit_ablate.models.losses.triton_interpreter``; fp32 /
fp16 only): call ``check_loss_backend`` at start-up (the ablation runner does, to mark variants
that cannot run here ``skipped``). lit-ablate patches no Liger kernels into models (only the
``liger`` loss backend uses Liger), so CCE can never run beside a Liger loss kernel.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_ablate.errors import ConfigError
from lit_ablate.extras import installed, not_installed
from lit_ablate.models.losses import triton_interpreter
from lit_ablate.models.losses.chunked_cross_entropy import IGNORE_INDEX, chunked_linear_cross_entropy

LOSS_KEY = "model.init_args.loss"
LOSS_OPTIONS_KEY = "model.init_args.loss_options"
DTYPE_KEY = "model.init_args.model.dtype"


class LossBackend(Protocol):
    """``(hidden [N, H], weight [V, H], labels [N], bias [V] | None) -> fp32 scalar sum``."""

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor: ...


def _check_z_loss_weight(z_loss_weight: float) -> None:
    if z_loss_weight < 0:
        raise ConfigError(
            f"{LOSS_OPTIONS_KEY}.z_loss_weight", z_loss_weight, "use 0 (off) or a small positive weight such as 1e-4"
        )


def _require_kernel_package(backend: str, module: str, cpu_alternative: str) -> None:
    """The fused Triton backends need their package and a CUDA device, or the interpreter opt-in."""
    interpreted = triton_interpreter.requested()
    missing = not_installed(module, f"the {backend} loss", extra="kernels-cpu" if interpreted else None)
    if missing:
        raise ConfigError(LOSS_KEY, backend, missing)
    if interpreted:
        triton_interpreter.enable(module)
    elif not torch.cuda.is_available():
        raise ConfigError(
            LOSS_KEY,
            backend,
            f"{backend} needs CUDA (its Triton kernels fail on CPU); {cpu_alternative}; or set "
            f"{triton_interpreter.OPT_IN_ENV}=1 to run its kernels through Triton's interpreter "
            f"(tiny shapes, fp32/fp16; {triton_interpreter.INSTALL_FIX})",
        )


@dataclass(frozen=True)
class TorchCrossEntropy:
    """The reference: full ``[tokens, vocab]`` logits, then ``F.cross_entropy`` in fp32.

    Choose it as the baseline every other backend is compared with, or when tokens x vocab is
    small; its memory grows with tokens x vocab (several fp32 copies in forward and backward).
    """

    z_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        _check_z_loss_weight(self.z_loss_weight)

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        logits = F.linear(hidden, weight, bias).float()
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        if self.z_loss_weight:
            lse = torch.logsumexp(logits, dim=-1)
            loss = loss + self.z_loss_weight * torch.where(labels != IGNORE_INDEX, lse.square(), 0.0).sum()
        return loss


@dataclass(frozen=True)
class ChunkedCrossEntropy:
    """Pure-torch linear + cross-entropy over token chunks; never holds ``[tokens, vocab]`` logits.

    Choose it to cut loss memory on any device (CPU included) without extra packages. Matches
    ``torch`` to fp32 rounding. Peak extra memory is about ``chunk_tokens x chunk_vocab x 4``
    bytes, plus an fp32 weight-gradient accumulator (``vocab x hidden x 4``) when the weights are
    bf16. See ``lit_ablate.models.losses.chunked_cross_entropy`` for the algorithm.

    Args:
        chunk_tokens: tokens per chunk; smaller saves memory, larger runs bigger (faster) matmuls.
        chunk_vocab: also split the vocabulary into chunks of this many columns (None: whole
            vocabulary); for very large vocabularies. Costs one more logits matmul per chunk.
        z_loss_weight: weight of ``logsumexp^2`` per counted token, added to the sum.
        grad_in_forward: form the gradients while the forward's chunk logits exist (as Liger
            does: as many matmuls as torch); false recomputes the logits in the backward (one
            more matmul per chunk, but only the ``[tokens]`` log-sum-exp is kept in between, and
            backward with ``retain_graph`` works).
    """

    chunk_tokens: int = 1024
    chunk_vocab: int | None = None
    z_loss_weight: float = 0.0
    grad_in_forward: bool = True

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ConfigError(
                f"{LOSS_OPTIONS_KEY}.chunk_tokens", self.chunk_tokens, "use a positive number of tokens, e.g. 1024"
            )
        if self.chunk_vocab is not None and self.chunk_vocab < 1:
            raise ConfigError(
                f"{LOSS_OPTIONS_KEY}.chunk_vocab", self.chunk_vocab, "use a positive column count or null"
            )
        _check_z_loss_weight(self.z_loss_weight)

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        return chunked_linear_cross_entropy(
            hidden, weight, labels, bias, self.chunk_tokens, self.chunk_vocab, self.z_loss_weight, self.grad_in_forward
        )


LIGER_ACCUM_DTYPES = {"float32": torch.float32}
"""``accum_dtype`` values besides null (the weight's own dtype)."""


@dataclass(frozen=True)
class LigerFusedLinearCrossEntropy:
    """Liger-Kernel's fused linear cross-entropy (Triton; CUDA, or interpreted on CPU).

    Choose it on GPUs to compare with ``chunked`` and ``cce``: it chunks tokens and computes the
    gradients during the forward. ``z_loss_weight`` maps to Liger's ``lse_square_scale``.

    Each chunk reads the whole ``[V, H]`` head and adds into the ``[V, H]`` weight gradient, so the
    chunk size trades that traffic against a ``[chunk, V]`` logits buffer. Liger (0.8.5) picks its
    chunks itself: a power of two near ``tokens x H / V`` (64 tokens for 8,192 tokens at V 151,936,
    H 1,024: 128 reads of the head), grown by its ``chunk_mem_const`` budget.

    Args:
        z_loss_weight: weight of ``logsumexp^2`` per counted token, added to the sum.
        chunk_tokens: tokens per chunk, a power of two (one chunk when the batch has fewer tokens);
            null keeps Liger's own choice. Reached through Liger's ``chunk_mem_const``, so the
            kernel path is Liger's own; a size below Liger's own chunk for the batch's shape (its
            smallest) is refused at the first step, naming the sizes that shape allows.
        accum_dtype: ``float32`` accumulates the weight (and bias) gradient over chunks in fp32,
            cast to the weight's dtype once at the end; null accumulates in the weight's dtype
            (Liger's default: bf16 weights round once per chunk).
    """

    z_loss_weight: float = 0.0
    chunk_tokens: int | None = None
    accum_dtype: str | None = None

    def __post_init__(self) -> None:
        _check_z_loss_weight(self.z_loss_weight)
        if self.chunk_tokens is not None and (self.chunk_tokens < 1 or self.chunk_tokens & (self.chunk_tokens - 1)):
            raise ConfigError(
                f"{LOSS_OPTIONS_KEY}.chunk_tokens",
                self.chunk_tokens,
                "Liger's chunks are powers of two: use one, e.g. 256 or 1024, or null for Liger's own",
            )
        if self.accum_dtype is not None and self.accum_dtype not in LIGER_ACCUM_DTYPES:
            raise ConfigError(
                f"{LOSS_OPTIONS_KEY}.accum_dtype",
                self.accum_dtype,
                "use float32 (the weight gradient summed in fp32) or null (in the weight's dtype)",
            )
        _require_kernel_package("liger", "liger_kernel", "use 'chunked' for a memory-efficient loss on CPU")

    def check_compute_dtype(self, dtype: torch.dtype, training: bool = True) -> None:
        """Refuse bf16 under the interpreter (silently wrong there)."""
        if triton_interpreter.requested():
            triton_interpreter.refuse_bf16(dtype)

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        self.check_compute_dtype(hidden.dtype)
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        options: dict[str, Any] = {}
        if self.chunk_tokens is not None:
            options["chunk_mem_const"] = liger_chunk_budget(
                hidden.shape[0], weight.shape[0], weight.shape[1], self.chunk_tokens
            )
        if self.accum_dtype is not None:
            options["accum_dtype"] = LIGER_ACCUM_DTYPES[self.accum_dtype]
        return liger_fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            bias,
            ignore_index=IGNORE_INDEX,
            lse_square_scale=self.z_loss_weight,
            reduction="sum",
            **options,
        ).float()


def liger_chunk(tokens: int, vocab: int, hidden: int, budget: int) -> int:
    """Tokens per chunk of Liger 0.8.5's fused linear cross-entropy under ``chunk_mem_const=budget``
    (its rule: logits of about ``budget x tokens x hidden`` elements, rounded to a power of two,
    at most ``tokens``)."""
    chunks = -(-vocab // (budget * hidden))
    return min(1 << (-(-tokens // chunks) - 1).bit_length(), tokens)


@functools.lru_cache(maxsize=64)
def liger_chunk_budget(tokens: int, vocab: int, hidden: int, chunk_tokens: int) -> int:
    """The smallest ``chunk_mem_const`` whose Liger chunks hold ``chunk_tokens`` tokens (all ``tokens``
    when fewer); a ``ConfigError`` naming the reachable sizes when none does."""
    wanted = min(chunk_tokens, tokens)
    largest = -(-vocab // hidden)  # one chunk of every token from here on
    budget = next(b for b in range(1, largest + 1) if liger_chunk(tokens, vocab, hidden, b) >= wanted)
    if liger_chunk(tokens, vocab, hidden, budget) != wanted:
        sizes = sorted({liger_chunk(tokens, vocab, hidden, b) for b in range(1, largest + 1)})
        raise ConfigError(
            f"{LOSS_OPTIONS_KEY}.chunk_tokens",
            chunk_tokens,
            f"Liger's chunks of {tokens} tokens at vocabulary {vocab} and hidden {hidden} can hold "
            f"{sizes} tokens (its own: {sizes[0]}); use one of these or null",
        )
    return budget


@dataclass(frozen=True)
class CutCrossEntropy:
    """Apple's Cut Cross-Entropy: logits are formed block by block in on-chip memory only.

    Choose it on GPUs for the smallest loss memory. ``impl="cce"`` is the Triton kernel (CUDA, or
    interpreted on CPU); its backward takes only fp16/bf16 hidden states, so training in float32
    is refused. ``impl="torch_compile"`` is CCE's compiled reference, which also runs on CPU.
    ``filter_eps`` skips gradient blocks whose softmax is below it ("high", "auto", a float, or
    None for exact gradients). CCE does not return the log-sum-exp, so z-loss is not available.
    """

    impl: str = "cce"
    filter_eps: float | str | None = "high"
    z_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.impl not in ("cce", "torch_compile"):
            raise ConfigError(f"{LOSS_OPTIONS_KEY}.impl", self.impl, "use 'cce' (CUDA) or 'torch_compile'")
        if self.z_loss_weight:
            raise ConfigError(
                f"{LOSS_OPTIONS_KEY}.z_loss_weight",
                self.z_loss_weight,
                "cce does not expose the log-sum-exp: use 0, or the chunked/liger/torch backend",
            )
        if self.impl == "cce":
            _require_kernel_package(
                "cce", "cut_cross_entropy", "use 'chunked', or loss_options impl: torch_compile for CCE's CPU reference"
            )
        elif not installed("cut_cross_entropy"):
            raise ConfigError(LOSS_KEY, "cce", not_installed("cut_cross_entropy", "the cce loss"))

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        self.check_compute_dtype(hidden.dtype, training=hidden.requires_grad or weight.requires_grad)
        from cut_cross_entropy import linear_cross_entropy

        bias_kwargs = {}
        if bias is not None:
            if "bias" not in inspect.signature(linear_cross_entropy).parameters:
                raise ConfigError(
                    LOSS_KEY,
                    "cce",
                    "the installed cut-cross-entropy takes no LM-head bias; "
                    "use chunked or torch for a model whose lm_head has a bias",
                )
            bias_kwargs["bias"] = bias
        return linear_cross_entropy(
            hidden,
            weight,
            labels,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            filter_eps=self.filter_eps,
            impl=self.impl,
            **bias_kwargs,
        ).float()

    def check_compute_dtype(self, dtype: torch.dtype, training: bool = True) -> None:
        """The Triton kernel: bf16 is refused under the interpreter, and training in float32 always
        (CCE's backward asserts fp16/bf16 hidden states, cut-cross-entropy 25.1)."""
        if self.impl != "cce":
            return
        if triton_interpreter.requested():
            triton_interpreter.refuse_bf16(dtype)
        if dtype == torch.float32 and training:
            raise ConfigError(
                DTYPE_KEY,
                "float32",
                "cce's Triton backward takes only float16/bfloat16 hidden states: "
                "use bfloat16 (CUDA) or float16, or loss_options impl: torch_compile for float32",
            )


LOSS_BACKENDS: dict[str, type[LossBackend]] = {
    "torch": TorchCrossEntropy,
    "chunked": ChunkedCrossEntropy,
    "liger": LigerFusedLinearCrossEntropy,
    "cce": CutCrossEntropy,
}


def loss_backend(name: str, **options: Any) -> LossBackend:
    """Build backend ``name`` with its options; unknown names, options or values raise ConfigError.

    Building also checks the backend can run here (``liger``/``cce`` need CUDA and their package).
    """
    return named_class(LOSS_BACKENDS, name, options, key=LOSS_KEY, options_key=LOSS_OPTIONS_KEY)(**options)


def named_class(
    registry: dict[str, Any],
    name: str,
    options: dict[str, Any],
    *,
    key: str,
    options_key: str,
    other_choices: tuple[str, ...] = (),
) -> Any:
    """``registry[name]``, the class to build with ``options``, or a ``ConfigError`` before any
    constructor runs: naming ``key`` for an unknown name (listing the registry and ``other_choices``,
    names the caller serves elsewhere), or ``options_key`` for an option the class does not take."""
    if name not in registry:
        raise ConfigError(key, name, f"choose one of {sorted(registry) + list(other_choices)}")
    accepted = inspect.signature(registry[name]).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(options_key, options, f"'{name}' takes no option {unknown}; it takes {sorted(accepted)}")
    return registry[name]


def check_loss_backend(name: str, compute_dtype: str | None = None, **options: Any) -> None:
    """Start-up check: raises ConfigError (with the reason and fix) if ``name`` cannot run here.

    ``compute_dtype`` (``float32`` / ``float16`` / ``bfloat16``: the dtype the hidden states will
    have) also refuses what only fails at the first step: bf16 under the interpreter, cce's kernel
    training in float32. The rule ``loss_backend_available`` calls it to mark variants
    that cannot run here ``skipped``; it builds nothing heavy.
    """
    backend = loss_backend(name, **options)
    check_dtype = getattr(backend, "check_compute_dtype", None)
    if check_dtype is not None and compute_dtype is not None:
        check_dtype(getattr(torch, compute_dtype))
