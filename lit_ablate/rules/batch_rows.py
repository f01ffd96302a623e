"""The lengths of the batches the collator makes, against what splits them: sequence parallelism cuts every
row over ``tp`` ranks, and pipeline stages take every batch in one shape. The collator decides the lengths,
so each refusal names the collator key that fixes it (refused at the first batch before)."""

from __future__ import annotations

from lit_ablate.errors import Refusal
from lit_ablate.rules.registry import Scope, rule
from lit_ablate.run_config import RunConfig

DATA_OPTIONS = "data.init_args"
COLLATOR_KEY = f"{DATA_OPTIONS}.collator"


@rule(Scope.CONFIG, skips_variant=True)
def sequence_parallel_rows_split(run: RunConfig) -> Refusal | None:
    """Sequence parallelism splits every row's tokens over the ``tp`` ranks: every batch's length must be a
    multiple of ``tp``."""
    tp = run.mesh_size("tp")
    if tp == 1 or not run.trainer.strategy.option("sequence_parallel", False):
        return None
    return rows_refusal(run, tp, f"sequence parallelism splits each row over tp={tp} ranks")


def rows_refusal(run: RunConfig, multiple: int, why: str) -> Refusal | None:
    """Why a batch's length may not be a multiple of ``multiple`` (its rows are padded to a length the
    collator picks), naming the key that fixes it; None when every batch's is."""
    data, collator = run.data, run.data.collator
    seq_len = data.seq_len if isinstance(data.seq_len, int) else None
    fix = f"{why}, so every batch's length must be a multiple of {multiple}"
    if collator is not None and collator.name == "PackingCollator":
        capacity = collator.option("max_tokens") or seq_len
        if not collator.option("static_shape", False):
            return Refusal(
                f"{COLLATOR_KEY}.init_args.static_shape",
                False,
                f"{fix}, and packed rows are as long as "
                f"their longest; set static_shape: true with max_tokens (or seq_len) a multiple of {multiple}",
            )
        if capacity and capacity % multiple:
            key = "max_tokens" if collator.option("max_tokens") else None
            return Refusal(
                f"{COLLATOR_KEY}.init_args.{key}" if key else "data.init_args.seq_len",
                capacity,
                f"{fix}; use a multiple of {multiple}",
            )
        return None
    if collator is not None and collator.name != "PaddingCollator":
        return None  # a collator of the user's own: the first batch tells
    pad_to = collator.option("pad_to_multiple_of", 1) if collator is not None else 1
    fixed = data.format == "pretrain" or (collator is not None and collator.option("static_length", False))
    if isinstance(pad_to, int) and pad_to % multiple == 0:
        return None
    if fixed and seq_len and -(-seq_len // pad_to) * pad_to % multiple == 0:
        return None  # every row is seq_len long (pretrain windows, or static_length)
    if collator is None:
        return Refusal(
            COLLATOR_KEY,
            None,
            f"{fix}, and the default PaddingCollator pads each batch to its longest "
            f"row; set it to {{class_path: lit_ablate.data.PaddingCollator, init_args: {{pad_to_multiple_of: "
            f"{multiple}}}}}",
        )
    return Refusal(f"{COLLATOR_KEY}.init_args.pad_to_multiple_of", pad_to, f"{fix}; use a multiple of {multiple}")


def static_rows_refusal(run: RunConfig) -> Refusal | None:
    """Pipeline stages take every batch in one shape: variable-length rows must be padded to ``seq_len``."""
    collator = run.data.collator
    why = "pipeline stages take every training batch in one shape (torch sizes their hand-off buffers once)"
    if collator is None:
        return Refusal(
            COLLATOR_KEY,
            None,
            f"{why}, and the default collator pads each batch to its longest row; "
            "set it to {class_path: lit_ablate.data.PaddingCollator, init_args: {static_length: true}} "
            "(PreferencePaddingCollator for preference pairs)",
        )
    option = {
        "PaddingCollator": "static_length",
        "PreferencePaddingCollator": "static_length",
        "PackingCollator": "static_shape",
    }.get(collator.name)
    if option and not collator.option(option, False):
        return Refusal(
            f"{COLLATOR_KEY}.init_args.{option}", False, f"{why}; set {option}: true (every batch padded to seq_len)"
        )
    return None
