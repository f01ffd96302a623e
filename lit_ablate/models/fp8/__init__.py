"""fp8 training with torchao: ``conversion`` (``Fp8Options``, ``convert_fp8``: which linear layers and
experts compute in fp8, emulated where no fp8 kernel runs), ``matmul`` (``Fp8Matmul``, the per-expert
fp8 matmul) and ``grouped_experts`` (grouped experts through torchao's rowwise scaled grouped matmul)."""
