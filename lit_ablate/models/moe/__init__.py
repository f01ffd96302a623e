"""Mixture of experts: ``blocks`` (``MoEOptions``, ``apply_moe``: lit-ablate's MoE block patched into a
Hugging Face MoE model), ``router`` (top-k routing and auxiliary losses), ``experts`` (loop, grouped and
padded-bmm implementations) and ``dispatch`` (tokens to experts: local, all-to-all or all-reduce under
expert parallelism)."""
