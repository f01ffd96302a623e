"""Measurement callbacks: the only place lit-ablate times, counts and logs (docs/architecture.md)."""

from lit_ablate.callbacks.exact_match import ExactMatchEvaluator
from lit_ablate.callbacks.expert_load import ExpertLoadMonitor
from lit_ablate.callbacks.gradient_fingerprint import GradientFingerprint
from lit_ablate.callbacks.kernel_profile import KernelProfile
from lit_ablate.callbacks.memory import MemoryMonitor
from lit_ablate.callbacks.mfu import MFUMonitor
from lit_ablate.callbacks.pipeline_bubble import PipelineBubbleMonitor
from lit_ablate.callbacks.preference_metrics import PreferenceMonitor
from lit_ablate.callbacks.record_section import RecordSection
from lit_ablate.callbacks.run_recorder import RunRecorder
from lit_ablate.callbacks.step_monitor import StepMonitor
from lit_ablate.callbacks.throughput import ThroughputMonitor

__all__ = [
    "ExactMatchEvaluator",
    "ExpertLoadMonitor",
    "GradientFingerprint",
    "KernelProfile",
    "MFUMonitor",
    "MemoryMonitor",
    "PipelineBubbleMonitor",
    "PreferenceMonitor",
    "RecordSection",
    "RunRecorder",
    "StepMonitor",
    "ThroughputMonitor",
]
