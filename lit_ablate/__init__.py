"""lit-ablate: ablation studies of LLM training techniques on PyTorch Lightning."""

__version__ = "0.1.0"
