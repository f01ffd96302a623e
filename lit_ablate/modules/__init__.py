"""LightningModules: what is trained and how its loss is formed."""

from lit_ablate.modules.causal_lm import CausalLM
from lit_ablate.modules.dpo import DPO
from lit_ablate.modules.step_output import StepOutput

__all__ = ["DPO", "CausalLM", "StepOutput"]
