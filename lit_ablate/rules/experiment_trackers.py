"""The experiment trackers a run names can be sent to from here: known names, their packages installed."""

from __future__ import annotations

from lit_ablate.errors import Refusal
from lit_ablate.rules.registry import Scope, refusal_of, rule
from lit_ablate.run_config import RunConfig
from lit_ablate.trackers import check_trackers


@rule(Scope.MACHINE, Scope.CLUSTER)
def trackers_installed(run: RunConfig) -> Refusal | None:
    """``recorder.trackers`` names trackers there are, whose packages this machine has: a fit sends its record
    from here, and a study's runner (on a cluster's login node too) sends every run's."""
    return refusal_of(check_trackers, list(run.trackers), "recorder.trackers") if run.trackers else None
