"""How routed tokens reach their experts and come back: local, all-to-all (EP), all-reduce (EP).

A dispatcher is called by ``MoEBlock`` as ``dispatcher(x [N, H], routing, experts) -> [N, H]``.
Every dispatcher hands the experts their tokens *sorted by expert* with per-expert counts, so any
experts implementation (``loop``, ``grouped``) composes with any dispatch. The model holds a
``LocalDispatcher``; an expert-parallel strategy swaps in one of the distributed ones after it
has sharded the expert weights (rank ``r`` of the EP group holding experts
``[r * E / ep, (r + 1) * E / ep)``). Models stay parallelism-agnostic: they only call the
dispatcher they were given.

- ``AllToAllDispatcher``: each rank sends each token copy to the rank holding its expert
  (``all_to_all_single`` with uneven splits), the experts run once per token copy, and a second
  all-to-all brings the results back (torchtitan's EP).
- ``AllReduceDispatcher``: the naive scheme (small-ablation's "EP"): every rank gathers every
  rank's tokens, runs its local experts on all of them, and an all-reduce sums the partial
  outputs. It moves ``ep`` times more data; it exists so the two can be ablated.

Under a simulated rank (``lit_ablate.simulated_rank``: a fake process group, collectives move nothing)
the buffers whose contents set a size start as this rank's own counts and choices, so routing is
balanced: each rank receives as many token copies per expert as it sends.

Collectives come from ``torch.distributed._functional_collectives`` (autograd-aware, uneven
splits, gloo and NCCL). Each autograd collective's backward depends on the previous one's
result, and the all-reduce dispatcher gathers tokens and routing weights as *one* stacked
tensor: two independent autograd collectives in one backward may run in different orders on
different ranks and silently exchange the wrong gradients
(docs/platform.md#two-autograd-collectives-in-one-backward).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from lit_ablate.models.moe.router import Routing
from lit_ablate.torch_versions import all_gather_into


class Experts(Protocol):
    """``experts(tokens sorted by expert [M, H], counts per local expert [E_local]) -> [M, H]``."""

    def __call__(self, tokens: Tensor, counts: Tensor) -> Tensor: ...


class SortedTokens(NamedTuple):
    tokens: Tensor
    """``[N * top_k, H]``: one row per (token, choice), grouped by expert id (stable order)."""
    order: Tensor
    """``[N * top_k]``: which flattened (token, choice) pair each sorted row is."""


def sort_by_expert(x: Tensor, routing: Routing) -> SortedTokens:
    """Token copies grouped by expert: the layout grouped matmuls and all-to-all need."""
    top_k = routing.indices.shape[-1]
    order = torch.argsort(routing.indices.reshape(-1), stable=True)
    return SortedTokens(x[order // top_k], order)


def inverse_permutation(order: Tensor) -> Tensor:
    """``inverse[order[i]] = i``, without a second sort."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def combine(sorted_out: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """``[N, H]``: each token's expert outputs, back in token order, mixed by its routing weights."""
    num_tokens, top_k = weights.shape
    per_choice = sorted_out[inverse_permutation(order)].view(num_tokens, top_k, -1)
    return (per_choice * weights.unsqueeze(-1)).sum(dim=1)


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Autograd ``all_to_all_single`` with uneven splits; waited, so callers get a plain tensor."""
    return funcol.wait_tensor(funcol.all_to_all_single(x, output_splits, input_splits, group))


class LocalDispatcher:
    """All experts live on this rank: sort, run, combine. The default of every ``MoEBlock``."""

    def __call__(self, x: Tensor, routing: Routing, experts: Experts) -> Tensor:
        tokens, order = sort_by_expert(x, routing)
        return combine(experts(tokens, routing.counts), order, routing.weights)


class ExpertParallelDispatcher:
    """Shared by the EP dispatchers: the group and which experts this rank holds."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.size} EP ranks")
        self.num_local = num_experts // self.size
        self.first_local = self.rank * self.num_local

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ep={self.size}, rank={self.rank}, experts_per_rank={self.num_local})"


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Token copies travel to the ranks that hold their experts and back (real expert parallelism)."""

    def __call__(self, x: Tensor, routing: Routing, experts: Experts) -> Tensor:
        tokens, order = sort_by_expert(x, routing)
        # received[src * E_local + j]: copies that rank src sends to this rank's j-th expert. The buffer starts
        # as this rank's own counts, which the exchange overwrites: a simulated rank's fake exchange leaves
        # them (balanced routing: a rank receives as many copies per expert as it sends).
        received = routing.counts.clone()
        dist.all_to_all_single(received, routing.counts, group=self.group)
        send_splits = routing.counts.view(self.size, self.num_local).sum(dim=1).tolist()
        received = received.view(self.size, self.num_local)
        recv_splits = received.sum(dim=1).tolist()
        arrived = all_to_all(tokens, recv_splits, send_splits, self.group)
        # Arrivals are grouped by source rank, then expert; the experts want expert, then source.
        by_expert = self._source_major_to_expert_major(received, sum(recv_splits))
        out = experts(arrived[by_expert], received.sum(dim=0))
        back = all_to_all(out[inverse_permutation(by_expert)], send_splits, recv_splits, self.group)
        return combine(back, order, routing.weights)

    @staticmethod
    def _source_major_to_expert_major(received: Tensor, total: int) -> Tensor:
        sources, experts = received.shape
        chunk = torch.repeat_interleave(
            torch.arange(sources * experts, device=received.device), received.reshape(-1), output_size=total
        )
        source, expert = chunk // experts, chunk % experts
        return torch.argsort(expert * sources + source, stable=True)


class AllReduceDispatcher(ExpertParallelDispatcher):
    """Every rank computes its experts for every rank's tokens; an all-reduce sums the outputs.

    The naive scheme, kept as an ablation baseline: it moves ``ep`` times the tokens of all-to-all
    and every rank touches all tokens.
    """

    def __call__(self, x: Tensor, routing: Routing, experts: Experts) -> Tensor:
        num_tokens, top_k = routing.indices.shape
        sizes = torch.empty(self.size, dtype=torch.int64, device=x.device)
        all_gather_into(sizes, torch.tensor([num_tokens], device=x.device), self.group)
        sizes = sizes.tolist()
        # One autograd collective for tokens and weights together (trap 1); the ids carry no grad.
        payload = torch.cat([x, routing.weights.to(x.dtype)], dim=1)
        gathered = all_to_all(payload.repeat(self.size, 1), sizes, [num_tokens] * self.size, self.group)
        all_x, all_weights = gathered.split([x.shape[1], top_k], dim=1)
        # Every rank's choices arrive here; the buffer starts as this rank's own, repeated (what a simulated
        # rank's fake exchange leaves: valid expert ids, balanced routing), and the exchange overwrites it.
        all_indices = routing.indices.repeat(-(-sum(sizes) // max(num_tokens, 1)), 1)[: sum(sizes)].contiguous()
        dist.all_to_all_single(
            all_indices, routing.indices.repeat(self.size, 1), sizes, [num_tokens] * self.size, group=self.group
        )

        local = all_indices.reshape(-1) - self.first_local
        pairs = torch.nonzero((local >= 0) & (local < self.num_local)).squeeze(1)
        pairs = pairs[torch.argsort(local[pairs], stable=True)]
        counts = torch.bincount(local[pairs], minlength=self.num_local)
        out = experts(all_x[pairs // top_k], counts) * all_weights.reshape(-1)[pairs].unsqueeze(-1)
        partial = torch.zeros_like(all_x).index_add(0, pairs // top_k, out)
        total = funcol.wait_tensor(funcol.all_reduce(partial, "sum", self.group))
        start = sum(sizes[: self.rank])
        return total[start : start + num_tokens]


DISPATCH_MODES: dict[str, type[ExpertParallelDispatcher]] = {
    "all_to_all": AllToAllDispatcher,
    "all_reduce": AllReduceDispatcher,
}
"""The expert-parallel dispatch schemes a strategy may install, by config name."""
