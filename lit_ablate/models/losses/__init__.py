"""Losses: ``cross_entropy`` (the backends a config names: torch, chunked, liger, cce),
``chunked_cross_entropy`` (the pure-torch chunked linear + CE), ``logprobs`` and ``sequence_logprobs``
(per-token and per-sequence log-probs for DPO), ``liger_dpo`` (Liger's fused linear DPO) and
``triton_interpreter`` (the Liger/CCE kernels on CPU through Triton's interpreter, opt-in)."""
