"""Low-rank adapters (LoRA, DoRA, rsLoRA) injected into a Hugging Face model by peft.

``apply_adapters(model, AdapterOptions(r=16))`` builds peft's own ``LoraConfig`` and injects peft's
LoRA layers in place (``peft.inject_adapter_in_model``, the layer-injection half of
``get_peft_model``): every other parameter is frozen, and the model keeps its Hugging Face class.
That is deliberate: strategies find decoder layers in the HF model (``_no_split_modules``) and the
loss backends read its final hidden states and LM-head weight, which a ``PeftModel`` wrapper's
``forward`` (full logits) would hide. Export builds the ``PeftModel`` (``get_peft_model``) around
the same layers to write a peft adapter folder or merged weights (``lit_ablate.commands.export``).

With peft's default initialisation every ``lora_B`` starts at zero, so an adapted model computes
exactly its base model until the first optimizer step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from lit_ablate.errors import ConfigError

ADAPTER_KEY = "model.init_args.model.adapter"
"""Where ``AdapterOptions`` sit in a fit config (named in error messages)."""
ADAPTER_NAME = "default"
"""peft's adapter name: the one adapter a run trains."""
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
"""Submodules of peft's LoRA layers that hold adapter weights (DoRA adds the magnitude vector)."""


@dataclass
class AdapterOptions:
    """Which adapter trains on top of the frozen model, as peft's ``LoraConfig`` takes it.

    Args:
        method: ``lora`` (peft's LoRA; DoRA and rsLoRA are its flags below).
        r: rank of each adapter (trainable parameters grow linearly with it).
        alpha: scale numerator: the update is ``alpha / r * B A`` (``alpha / sqrt(r)`` with rsLoRA).
        dropout: dropout on the adapter's input (0 disables it; the base path never drops).
        target_modules: module names (or name suffixes, peft's matching) that get an adapter, e.g.
            ``[q_proj, v_proj]``, or ``all-linear`` (every linear layer but the LM head).
        modules_to_save: modules trained in full beside the adapters (peft keeps a trainable copy),
            e.g. ``[lm_head]`` when the vocabulary changed.
        use_dora: DoRA: a learned magnitude per output row on top of the low-rank direction update.
        use_rslora: rank-stabilised scaling ``alpha / sqrt(r)``, so a larger rank does not shrink
            the update.
        experts_r: LoRA on the routed experts of MoE blocks (``model.moe.experts: loop`` or ``grouped``:
            ``lit_ablate.models.adapters.expert_lora``; ``hf``: peft's ``target_parameters`` on transformers'
            stacked ``gate_up_proj``/``down_proj``): each expert's rank, or ``r/top_k``
            (``r // num_experts_per_tok``: a token's active experts together add rank ``r``, the
            same trainable capacity per token as a dense layer's adapter); null: experts stay frozen.
    """

    method: Literal["lora"] = "lora"
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    modules_to_save: list[str] = field(default_factory=list)
    use_dora: bool = False
    use_rslora: bool = False
    experts_r: int | Literal["r/top_k"] | None = None

    def __post_init__(self) -> None:
        if self.method != "lora":
            raise ConfigError(f"{ADAPTER_KEY}.method", self.method, "use lora (DoRA and rsLoRA: use_dora, use_rslora)")
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ConfigError(f"{ADAPTER_KEY}.r", self.r, "use a positive integer rank, e.g. 8")
        if not self.alpha > 0:
            raise ConfigError(f"{ADAPTER_KEY}.alpha", self.alpha, "use a positive scale, e.g. 2 * r")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{ADAPTER_KEY}.dropout", self.dropout, "use a probability in [0, 1)")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ConfigError(
                f"{ADAPTER_KEY}.target_modules",
                self.target_modules,
                "give a list of module names, e.g. [q_proj, v_proj], or all-linear",
            )
        if not self.target_modules:
            raise ConfigError(
                f"{ADAPTER_KEY}.target_modules", self.target_modules, "name at least one module, or all-linear"
            )
        if self.experts_r is not None:
            self._check_expert_options()

    def _check_expert_options(self) -> None:
        key = f"{ADAPTER_KEY}.experts_r"
        if self.experts_r != "r/top_k" and (
            not isinstance(self.experts_r, int) or isinstance(self.experts_r, bool) or self.experts_r < 1
        ):
            raise ConfigError(key, self.experts_r, "use a positive integer rank, r/top_k, or null (no expert adapters)")
        if self.dropout:
            raise ConfigError(
                f"{ADAPTER_KEY}.dropout",
                self.dropout,
                "expert adapters are added to the expert weights, "
                "where no activation can be dropped: use dropout 0 with experts_r",
            )
        if self.use_dora:
            raise ConfigError(
                f"{ADAPTER_KEY}.use_dora", True, "DoRA is not built for expert adapters: drop use_dora or experts_r"
            )

    def lora_config(self):  # peft's LoraConfig; imported lazily with peft
        """peft's ``LoraConfig`` for these options."""
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            modules_to_save=list(self.modules_to_save) or None,
            use_dora=self.use_dora,
            use_rslora=self.use_rslora,
        )


def apply_adapters(model: nn.Module, options: AdapterOptions) -> nn.Module:
    """Inject peft's adapter layers into ``model`` in place and freeze everything else; returns ``model``.

    A ``target_modules`` entry that matches nothing is refused naming the key (peft's own error
    lists the model's module names, which is the fix).
    """
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(options.lora_config(), model, adapter_name=ADAPTER_NAME)
    except ValueError as err:
        reason = str(err).strip().splitlines()[0].rstrip(".")
        linears = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
        )
        raise ConfigError(
            f"{ADAPTER_KEY}.target_modules",
            options.target_modules,
            f"peft refused it: {reason}; this model's linear layers are {linears}, or use all-linear",
        ) from err
    if options.experts_r is not None:
        apply_expert_adapters(model, options)
    return model


def apply_expert_adapters(model: nn.Module, options: AdapterOptions) -> None:
    """An ``ExpertLoRA`` on every ``RoutedExperts`` of ``model``, or peft's parameter LoRA on transformers' own
    stacked experts (``moe.experts: hf``); the experts' weights stay frozen."""
    from lit_ablate.models.adapters.expert_lora import ExpertLoRA
    from lit_ablate.models.moe.experts import RoutedExperts

    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    hf_experts = [m for m in model.modules() if not isinstance(m, RoutedExperts) and _is_stacked_experts(m)]
    if not experts and not hf_experts:
        raise ConfigError(
            f"{ADAPTER_KEY}.experts_r",
            options.experts_r,
            "the model has no MoE experts with stacked weights: use an MoE model, e.g. "
            "model.init_args.model.moe: {experts: grouped} (or loop, hf), or drop experts_r",
        )
    r = _expert_rank(model, options)
    if hf_experts:
        _apply_hf_expert_adapters(model, options, r)
    for module in experts:
        module.gate_up_proj.requires_grad_(False)
        module.down_proj.requires_grad_(False)
        module.adapters = ExpertLoRA(module.gate_up_proj, module.down_proj, r, options.alpha, options.use_rslora)


def _expert_rank(model: nn.Module, options: AdapterOptions) -> int:
    """``experts_r`` as a rank (``r/top_k`` resolved against the model's ``num_experts_per_tok``)."""
    r = options.experts_r
    if r == "r/top_k":
        top_k = model.config.num_experts_per_tok
        r = options.r // top_k
        if r < 1:
            raise ConfigError(
                f"{ADAPTER_KEY}.experts_r",
                "r/top_k",
                f"r={options.r} is below top_k={top_k}: use r >= {top_k} or an integer experts_r",
            )
    return r


def _is_stacked_experts(module: nn.Module) -> bool:
    """transformers' fused experts: 3-D ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` parameters."""
    params = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    return all(isinstance(p, nn.Parameter) and p.ndim == 3 for p in params)


def _apply_hf_expert_adapters(model: nn.Module, options: AdapterOptions, r: int) -> None:
    """peft's ``target_parameters`` LoRA (one ``A_e``, ``B_e`` of rank ``r`` per expert, ``B`` at zero) on
    transformers' stacked experts, injected as a second config under the same adapter name: peft's
    ``rank_pattern`` does not reach parameter targets, and ``experts_r`` differs from ``r``. The model's
    ``peft_config`` stays the main one (the second injection would add to it)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=r,
        lora_alpha=options.alpha,
        target_modules=[],
        use_rslora=options.use_rslora,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    main = model.__dict__.pop("peft_config", None)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    if main is not None:
        model.peft_config = main


def adapter_parameter_names(model: nn.Module) -> set[str]:
    """Names of the adapter weights: peft's LoRA parts and the trainable copies of ``modules_to_save``."""
    if "peft" not in sys.modules:  # nothing can have injected adapters (and importing peft costs seconds)
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    from lit_ablate.models.adapters.expert_lora import ExpertLoRA

    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertLoRA):
            names.update(f"{prefix}.{name}" for name, _ in module.named_parameters())
            continue
        if isinstance(module, BaseTunerLayer):
            parts = [getattr(module, part) for part in ADAPTER_PARTS if hasattr(module, part)]
        elif isinstance(module, ModulesToSaveWrapper):
            parts = [module.modules_to_save]
        else:
            continue
        for part in parts:
            names.update(f"{prefix}.{name}" for name, _ in _named_parameters_of(module, part))
    return names


def _named_parameters_of(owner: nn.Module, part: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``part``'s parameters named relative to ``owner`` (its parent)."""
    child = next(name for name, module in owner.named_children() if module is part)
    return [(f"{child}.{name}", p) for name, p in part.named_parameters()]


def has_adapters(model: nn.Module) -> bool:
    """Whether adapters (peft's layers, expert LoRA) were injected into ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from lit_ablate.models.adapters.expert_lora import ExpertLoRA

    return any(isinstance(m, (BaseTunerLayer, ExpertLoRA)) for m in model.modules())


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block ``model`` computes its frozen base alone: every peft layer's adapters are off
    (peft's ``enable_adapters(False)``, what ``PeftModel.disable_adapter`` does), and back on after.
    peft also clears the adapters' ``requires_grad`` while off and restores it when they come back."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    from lit_ablate.models.adapters.expert_lora import ExpertLoRA

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper, ExpertLoRA))]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
