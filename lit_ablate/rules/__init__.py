"""Every check of a run, as rules in one registry (``registry``), each module one concern."""

from lit_ablate.rules.registry import RULES, Rule, Scope, check, check_parts, check_run, first_refusal, rule, rules_for

__all__ = ["RULES", "Rule", "Scope", "check", "check_parts", "check_run", "first_refusal", "rule", "rules_for"]
