"""``NoProfiler``: what a run profiles when its config names no ``trainer.profiler``: nothing, at no cost per hook.

Lightning wraps every hook it calls (each callback's, the module's, the strategy's: 78 per step of
the quickstart) in ``trainer.profiler.profile(name)``. Its default, ``PassThroughProfiler``, profiles
nothing, but through ``Profiler.profile``, a generator-based context manager: a generator and a context
object made, entered and exited at every hook, ~620 Python calls per step that ``NoProfiler`` saves
(``benchmarks/overhead.py --count``). ``NoProfiler.profile`` hands back one shared ``nullcontext``
instead. A configured profiler (``trainer.profiler: simple``, ``advanced``, ``pytorch``) is used as
configured.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from lightning.pytorch.profilers import PassThroughProfiler

_NOTHING = nullcontext()


class NoProfiler(PassThroughProfiler):
    """Lightning's ``PassThroughProfiler`` without a context manager made per profiled action."""

    def profile(self, action_name: str) -> AbstractContextManager:
        return _NOTHING
