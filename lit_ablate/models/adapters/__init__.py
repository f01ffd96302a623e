"""Adapters and quantised bases: ``lora`` (``AdapterOptions``, ``apply_adapters``: peft LoRA, DoRA,
rsLoRA), ``expert_lora`` (LoRA on lit-ablate's routed experts) and ``quantization``
(``QuantizationOptions``: bitsandbytes 4/8-bit frozen base layers for QLoRA)."""
