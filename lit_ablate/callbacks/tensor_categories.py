"""``TensorCategoryTracker``: the bytes of tensors one rank holds during a training step, by what they are for.

torch's ``MemTracker`` (a ``TorchDispatchMode``) sees every storage that an operator creates or
resizes, and keeps a running total per category. Its own categories do not survive a Lightning
step or a sharding strategy, so this subclass assigns them itself:

- MemTracker marks everything created inside ``optimizer.step`` as optimizer state, and Lightning
  runs forward and backward *inside* ``optimizer.step(closure)``: activations would be counted as
  optimizer states. Here the phase (forward, backward, update) is set by the caller at the step's
  boundaries, and optimizer states are the tensors in ``optimizer.state`` (``ZeroRedundancyOptimizer``:
  its local optimizer's, so only this rank's shard).
- MemTracker registers gradient hooks on every parameter a module uses, which FSDP1's parameter
  views refuse, and it never sees FSDP2's sharded gradients (assigned after the reduce-scatter,
  not accumulated). Here roles are *claimed* from what the rank holds at each module's forward,
  after each module's backward and before the update: the storages of registered parameters, of
  their ``.grad``, of the optimizer states and of what the strategy says it holds besides
  (``StrategyInterface.held_tensors``: DeepSpeed's partitions).

A parameter storage the rank held when tracking began (its shard under FSDP, the whole tensor
under DDP) is ``params``; one that appears during the step (a layer's gathered parameters under
FSDP1 or FSDP2) is ``transient``, as are their full gradients, every buffer FSDP2's copy-in/out
operators touch, and storages made before tracking that an operator writes into (DDP's gradient
buckets). Other collectives' outputs keep the phase's category: tensor, expert and context
parallelism communicate activations. Parameters of submodules named in ``extra`` (e.g. DPO's
frozen reference model) count in their own category, gathered or not. Parameters the rank holds
that do not train (a LoRA/QLoRA base, decided once when tracking begins, so an adapter switched off
for a reference forward stays trainable) are ``frozen_params``; ``params`` holds the trainable ones
and the buffers.

Code compiled with ``torch.compile`` (CCE's vocabulary sort, torchao's 8-bit AdamW update,
``compile_layers``) runs eagerly while the tracker is on: torch refuses to compile, or to run a
compiled graph, under a dispatch mode. Eager code makes the temporaries a fused kernel would not,
so a tracked step's peak is then an upper bound of the compiled step's; ``compiled_code_ran_eager``
says whether compiled code existed in the process, for the run record's ``fallbacks``.

Checked on 2 gloo ranks (tests/test_memory_categories.py): FSDP2's DTensor shards, FSDP1's flat
parameter shards and ``ZeroRedundancyOptimizer``'s state shards are counted as the halves each
rank holds. Not seen on CPU: tensors made before tracking and never written during a step (on
CUDA the allocator's peak includes them; the difference is reported as ``untracked``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType, _WeakRefInfo
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("params", "frozen_params", "grads", "optimizer", "activations", "temporaries", "transient")
"""The built-in categories, in the order reports stack them."""
Phase = Literal["forward", "backward", "update"]
_FSDP_NAMESPACE = "fsdp"
"""FSDP2's copy-in/out operators: every tensor they touch is a communication buffer or a gathered
parameter. (Other collectives are not: tensor/expert/context parallelism send activations.)"""
_TOTAL = "Total"
_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.empty_like.default,
}
"""Operators that only allocate: their output's role is known once the next operator writes it
(FSDP's all-gather and reduce-scatter buffers are made by ``torch.empty``, then filled by FSDP's
copy-in operators, which make them ``transient``)."""


_PLAIN = (torch.Tensor, nn.Parameter)


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has made in this process so far (0: no compiled code to run eagerly)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _storages(t: torch.Tensor) -> Iterable[torch.UntypedStorage]:
    """A tensor's storages: its own one, a DTensor's local tensor's, or each inner tensor's of another
    wrapper subclass (NF4). The first two directly: torch's generic walk takes 7 us for a DTensor."""
    while type(t) is DTensor:
        t = t._local_tensor
    if type(t) in _PLAIN or not is_traceable_wrapper_subclass(t):
        return (t.untyped_storage(),)
    return get_untyped_storages(t)


def optimizer_states(optimizer: Optimizer) -> list[torch.Tensor]:
    """The state tensors this rank keeps for ``optimizer`` (a wrapper's inner optimizer included:
    ``ZeroRedundancyOptimizer`` keeps its shard's states in ``.optim``)."""
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    inner = getattr(optimizer, "optim", None)
    return states + optimizer_states(inner) if isinstance(inner, Optimizer) else states


class _DistinctNamesModTracker(ModTracker):
    """torch's module tracker, naming a module that is not a registered child by its class *and* its
    ``id`` when its class name is taken. The plain tracker names both by the class alone, so a module
    that calls another of its class outside the module tree (transformers 5.25 routes a layer's rotary
    embedding through a shared ``Func`` module into the model's own ``Func``) looks like a module
    re-entering itself: torch warns on every layer and replaces the process's warning format."""

    def _get_mod_name(self, mod: nn.Module) -> str:
        if mod not in self._known_modules:
            name = type(mod).__name__
            self._known_modules[mod] = name if name not in set(self._known_modules.values()) else f"{name}@{id(mod):x}"
        return super()._get_mod_name(mod)


class TensorCategoryTracker(MemTracker):
    """Peak tensor bytes of one step on ``device``, its composition, and each category's own maximum.

    Usage: ``enter()`` one step before the first measured step (a priming step: buffers made before
    training become known when first written), ``start_measuring()`` at each measured step's start,
    ``new_micro_batch()`` before each micro-batch, ``set_phase`` at the step's boundaries, ``exit()``
    after the last; at a measured step's end read ``peak``, ``at_peak`` (bytes per
    category at the moment of the peak; they add up to ``peak``), ``maxima`` (each category's
    largest value during the step) and ``forward_backward_max`` (activations + temporaries, the
    most they reach together during forward and backward: what an activation model predicts).

    Args:
        module: the trained module (every parameter it registers, at any moment, is claimed).
        optimizers: the step's optimizers.
        device: where the counted tensors live (a GPU run also makes small host tensors).
        extra: category name -> submodules whose parameters count there instead of ``params``.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        device: torch.device,
        extra: Mapping[str, Sequence[nn.Module]] | None = None,
        held: Callable[[], Mapping[str, Sequence[torch.Tensor]]] | None = None,
    ) -> None:
        super().__init__()
        self.held = held or dict
        self._mod_tracker = _DistinctNamesModTracker()
        extra = dict(extra or {})
        self.module, self.optimizers, self.device = module, list(optimizers), device
        self.categories: tuple[str, ...] = (*CATEGORIES, *extra)
        self._ref_class = self.categories  # MemTracker keys its running totals by these
        self._extra_of = {id(m): name for name, tops in extra.items() for top in tops for m in top.modules()}
        self._modules_and_extras: list[tuple[nn.Module, str | None]] = []
        self._own: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._frozen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._untracked_is_transient = False
        self.phase: Phase = "forward"
        self.peak = 0
        self.at_peak: dict[str, int] = dict.fromkeys(self.categories, 0)
        self.maxima: dict[str, int] = dict.fromkeys(self.categories, 0)
        self.forward_backward_max = 0
        self.compiled_code_ran_eager = False
        self._eager_stance: Any = None

    # --- the caller's interface -----------------------------------------------------------------
    def enter(self) -> None:
        """Start counting: what the rank holds now is its own state (parameters, gradients, optimizer)."""
        self._modules_and_extras = [(m, self._extra_of.get(id(m))) for m in self.module.modules()]
        for p in [*self.module.parameters(), *self.module.buffers()]:
            for storage in _storages(p):
                self._own[storage] = True
                if isinstance(p, nn.Parameter) and not p.requires_grad:
                    self._frozen[storage] = True
        self._eager_stance = torch.compiler.set_stance("force_eager")  # restored by exit()
        self.__enter__()
        self.claim()

    def exit(self) -> None:
        """Stop counting and drop every weak reference (no callbacks fire during later steps)."""
        self.__exit__(None, None, None)
        self._eager_stance.__exit__(None, None, None)
        self.compiled_code_ran_eager = compiled_graphs() > 0
        self._WINFO.clear()
        self._own.clear()
        self._frozen.clear()
        self.memory_tracking.clear()

    def start_measuring(self) -> None:
        """A measured step starts: peaks restart from what is held now. A storage that outlived the
        previous step without being a parameter, gradient or optimizer state is a buffer a strategy
        keeps (DDP's gradient buckets, allocated before training and first written in the priming
        step's backward): ``transient`` from now on. So the tracker should be entered one step early."""
        for winfo, _ in list(self._WINFO.values()):
            if winfo.reftype in ("activations", "temporaries"):
                old, winfo.reftype = winfo.reftype, "transient"
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old)
        self.claim()
        now = self._curr_mem_snap.get(self.device, {})
        self.at_peak = {c: now.get(c, 0) for c in self.categories}
        self.maxima = dict(self.at_peak)
        self.peak = now.get(_TOTAL, 0)
        self.forward_backward_max = 0

    def new_micro_batch(self) -> None:
        """A micro-batch starts: forward phase, and MemTracker's per-module records restart (it
        refuses a second call of the root module otherwise)."""
        self.reset_mod_stats()
        self.set_phase("forward")

    def set_phase(self, phase: Phase) -> None:
        """Tensors made from now on are ``activations`` (forward, or recomputed in backward) or
        ``temporaries`` (backward, update); roles are claimed again at each change."""
        self.phase = phase
        self.claim()

    def claim(self) -> None:
        """Re-categorise what the rank holds now: parameters, their gradients, optimizer states.

        Called at every module's first forward and after every module's backward, so it reads the
        modules' own parameter and buffer tables (whatever a strategy registered there now) and each
        plain tensor's one storage directly: torch's generic walk made it a third of a tracked step."""
        for module, extra in self._modules_and_extras:
            for tensors in (module._parameters.values(), module._buffers.values()):
                for p in tensors:
                    if p is None:
                        continue
                    storages = _storages(p)
                    own = any(s in self._own for s in storages)
                    frozen = own and any(s in self._frozen for s in storages)
                    self._assign(
                        storages, p.device, extra or (("frozen_params" if frozen else "params") if own else "transient")
                    )
                    grad = p.grad if p.is_leaf else None  # a non-leaf's (FSDP1's views) has none, and asking warns
                    if grad is not None:
                        self._assign(_storages(grad), grad.device, extra or ("grads" if own else "transient"))
        for optimizer in self.optimizers:
            for state in optimizer_states(optimizer):
                self._assign(_storages(state), state.device, "optimizer")
        for category, tensors in self.held().items():
            for tensor in tensors:
                self._assign(_storages(tensor), tensor.device, category)
        self._update_statistics()

    def _assign(self, storages: Iterable[torch.UntypedStorage], device: torch.device, category: str) -> None:
        """``MemTracker._update_and_maybe_create_winfos`` on storages already found: each takes ``category``."""
        for storage in storages:
            winfo, _ = self._WINFO.get(storage, (None, None))
            if winfo is None:
                winfo, ref = _WeakRefInfo.create_winfo(storage, device, category, self._delete_callback)
                self._WINFO[storage] = (winfo, ref)
                if winfo.mem_consumed > 0:
                    self._update_snap(_UpdateType.ADD, winfo)
            elif winfo.reftype != category:
                old, winfo.reftype = winfo.reftype, category
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

    # --- MemTracker overrides -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # MemTracker's signature
        # An operator that writes into or views a storage nobody tracked yet: a buffer made before
        # tracking or outside operators (DDP's gradient buckets, FSDP's gathered-parameter storages
        # grown by resize_, buffers a collective's backend allocated itself).
        self._untracked_is_transient = func._schema.is_mutable or func.is_view
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._untracked_is_transient = False
        if func.namespace == _FSDP_NAMESPACE:  # FSDP's all-gather/reduce-scatter buffers, in and out
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor):
                    self._recategorise(t, ("activations", "temporaries"), "transient")
        if func not in _ALLOCATIONS:  # an empty buffer is counted once the operator that fills it ran
            self._update_statistics()
        return out

    def _recategorise(self, t: torch.Tensor, current: tuple[str, ...], category: str) -> None:
        for storage in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(storage, (None, None))
            if winfo is not None and winfo.reftype in current:
                old, winfo.reftype = winfo.reftype, category
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        """A storage an operator produced: categorise it by the phase (MemTracker's ``reftype``
        says only whether autograd is running backward outside a recomputation)."""
        if self._untracked_is_transient:
            category = "transient"
        elif reftype is _MemRefType.ACT and (self.phase == "forward" or self._in_ac):
            category = "activations"
        else:
            category = "temporaries"
        super()._track(category, t)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        """At a module's first forward: claim roles (a sharded layer's parameters are gathered now)."""
        self.claim()
        return 0, 0

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        """A top-level module called again in one step (a pipeline stage, once per micro-batch, with
        earlier micro-batches' backward still to come): its per-module record restarts, where
        MemTracker would refuse. Per-module records are not used here; the categories go on."""
        if (
            module in self.memory_tracking
            and not self._mod_tracker.is_bw
            and not self._mod_tracker.parents - {"Global", self._mod_tracker.get_known_fqn(module)}
        ):
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        """After a module's backward: its gradients exist (FSDP2's reduce-scattered shards too)."""
        super()._post_bw_hook(module, args)
        self.claim()

    def _register_global_optimizer_hook(self) -> None:
        """No optimizer hooks: under Lightning forward and backward run inside ``optimizer.step``."""

    def _update_peak_stats(self, peak_state: Any) -> None:
        """Per-module peaks are not needed; the step's peak is kept in ``_update_snap``."""

    def _update_snap(
        self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None, old_reftype: Any = None
    ) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if u_type is _UpdateType.SIZE and old_mem_consumed is not None and winfo.mem_consumed > old_mem_consumed:
            self._update_statistics()  # a storage grown outside any operator (FSDP's resize_ to gather)

    def _update_statistics(self) -> None:
        """Peak, its composition and each category's maximum, from the running totals now."""
        now = self._curr_mem_snap.get(self.device)
        if now is None:  # nothing held on the device (MemTracker drops a device whose total is zero)
            return
        for category in self.categories:
            if now[category] > self.maxima[category]:
                self.maxima[category] = now[category]
        if self.phase != "update":
            self.forward_backward_max = max(self.forward_backward_max, now["activations"] + now["temporaries"])
        if now[_TOTAL] > self.peak:
            self.peak = now[_TOTAL]
            self.at_peak = {c: now[c] for c in self.categories}
