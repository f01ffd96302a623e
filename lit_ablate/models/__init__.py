"""Building the ``nn.Module`` a run trains, one subpackage per technique. Models know nothing of
parallelism: strategies apply it to a built model.

- ``factory``, ``presets``: Hugging Face causal LMs from a preset, a config mapping or a checkpoint;
- ``causal_lm_with_loss``: a causal LM and its loss backend as one module;
- ``attention/``: attention backends (sdpa, eager, flex, varlen), prefix-sharing masks, and context
  parallelism's ring and all-gather attention with their block kernels, masks and sequence layouts;
- ``moe/``: MoE blocks, the router, the experts implementations and token dispatch (local, all-to-all);
- ``losses/``: cross-entropy backends (torch, chunked, Liger, CCE), per-token log-probs and sequence
  log-probs for DPO, Liger's fused DPO, and Triton's interpreter for the GPU kernels on CPU;
- ``fp8/``: torchao float8 conversion, the fp8 matmul of loop experts and fp8 grouped experts;
- ``adapters/``: peft LoRA, LoRA on routed experts and bitsandbytes quantisation (QLoRA).
"""
