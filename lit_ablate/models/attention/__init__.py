"""Attention: how queries see keys, on one rank or split over context-parallel ranks.

- ``backends``: the attention implementations a config names (``sdpa``, ``eager``, ``flex``, varlen) and
  the packed-document masks; ``prefix_sharing``: the mask of a prompt shared by two DPO branches;
- context parallelism: ``sequence_layout`` (contiguous or zigzag chunks), ``chunk_masks`` (which keys
  each chunk may see), ``block_kernels`` (sdpa, flash_attn, flex per block), ``block_attention`` (blocks
  merged by log-sum-exp), ``ring`` and ``allgather`` (the two exchanges), ``context_parallel`` (both as
  transformers' attention backends).
"""
