"""The attention mask of prefix-shared preference pairs: one prompt, two response branches.

A prefix-shared pair is laid out once as ``[prompt, chosen branch, rejected branch]`` (see
``lit_ablate.data.preference_collate``), with ``position_ids`` continuing from the prompt in both
branches and ``branch_ids`` 0 (prompt), 1 (chosen), 2 (rejected). A query may attend a key when
the key is not after it, in the same document (documents start where the position is 0), and on
the prompt or on the query's own branch: the rejected branch sees the prompt, never the chosen
branch, so each branch computes exactly what its unshared sequence computes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_ablate.models.attention.backends import document_ids

MASK_BACKENDS = ("sdpa", "eager")
"""Attention implementations that take a custom 4-D boolean mask as given (transformers passes a
4-D ``attention_mask`` through unchanged). Varlen kernels know documents only, not branches."""


def prefix_sharing_mask(position_ids: Tensor, branch_ids: Tensor) -> Tensor:
    """``[B, 1, T, T]`` boolean mask (True = may attend) for rows of prefix-shared pairs."""
    length = position_ids.shape[-1]
    index = torch.arange(length, device=position_ids.device)
    causal = index[None, :] <= index[:, None]  # [query, key]
    docs = document_ids(position_ids)
    same_document = docs[:, :, None] == docs[:, None, :]
    key_branch, query_branch = branch_ids[:, None, :], branch_ids[:, :, None]
    visible = (key_branch == 0) | (key_branch == query_branch)
    return (causal & same_document & visible)[:, None]
