"""A pipelined model's evaluation forward: the whole batch stage by stage, without the schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_ablate.strategies.pipeline_stages import RankStages, pipeline_batch

if TYPE_CHECKING:
    from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss


def evaluate_stages(stages: RankStages, model: CausalLMWithLoss, batch: dict[str, Any]) -> tuple[Tensor, ...]:
    """What ``model`` returns for the batch (``(loss_sum, useful_tokens)``; DPO's policy: per-sequence
    log-probs and response tokens), forward only (under ``no_grad``), the same on every stage.

    The whole batch goes stage by stage, hidden states sent to the next stage's rank. By hand, not the
    schedule's ``eval``: that keeps the buffers sized by the first evaluation batch after a switch from
    training (a smaller last batch then fails: checked with torch 2.13), needs ``microbatches`` to divide
    every batch, and reruns its shape inference at each switch between training and evaluation (a
    forward, and a backward on the way back).
    """
    batch = pipeline_batch(batch)
    labels, hidden = batch["labels"], batch["input_ids"]
    pp, count = stages.pp, stages.pp * stages.stages_per_rank
    shape = (*hidden.shape, model.lm.config.hidden_size)
    dtype = next(model.parameters()).dtype
    outputs = None
    for s in range(count):
        here, before, after = s % pp, (s - 1) % pp, (s + 1) % pp
        if here != stages.stage_index:
            continue
        if s > 0 and before != here:
            hidden = torch.empty(shape, dtype=dtype, device=labels.device)
            dist.recv(hidden, group=stages.group, group_src=before)
        hidden = stages.modules[s](
            hidden, position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask")
        )
        if s == count - 1:
            outputs = stages.last.head_loss(hidden, batch)
        elif after != here:
            dist.send(hidden.contiguous(), group=stages.group, group_dst=after)
    outputs = stages.from_last_stage(outputs)
    stages.reshard()
    return outputs
