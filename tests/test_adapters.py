"""Adapters (peft LoRA) and quantised bases (bitsandbytes) in one process: what they compute, what
trains, what is refused. Multi-rank equivalence is in ``test_adapters_strategies.py``."""

from __future__ import annotations

import bitsandbytes as bnb
import lightning.pytorch as pl
import pytest
import torch
from bitsandbytes.functional import dequantize_4bit, get_4bit_type
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

from lit_ablate.errors import ConfigError
from lit_ablate.estimate.flops import count_parameters
from lit_ablate.models.adapters.lora import AdapterOptions, adapter_parameter_names
from lit_ablate.models.adapters.quantization import QuantizationOptions
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from lit_ablate.rules import sharded_weights
from lit_ablate.rules.sharded_weights import check_quantization, quantization_runs_under_strategy
from lit_ablate.strategies import DDPStrategy, FSDP1Strategy, FSDP2Strategy
from tests.test_step_objective import micro_batches

IDS = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(3))
NF4 = get_4bit_type("nf4", device="cpu")
NF4_HALF_GAP = float((NF4[1:] - NF4[:-1]).max()) / 2
"""No weight moves further than half the widest gap between neighbouring NF4 codes (-1 -> -0.6962:
0.152) times its block's absolute maximum: the stated NF4 error bound."""
DOUBLE_QUANT_SLACK = 0.01
"""Double quantisation stores each block's maximum in 8 bits: measured up to 0.6% of it lost."""
QLORA_LOGITS_RELATIVE_ERROR = 0.25
"""||logits_nf4 - logits_fp32|| / ||logits_fp32|| on the random tiny Llama (measured 0.18: every
layer's ~10% weight error compounds over 4 layers of random weights)."""


def build(seed: int = 0, **options) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ModelFactory(preset="tiny-llama", **options).build()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_lora_with_b_at_zero_computes_the_base_model_exactly():
    base, adapted = build(), build(adapter=AdapterOptions(r=8))
    torch.testing.assert_close(logits(adapted), logits(base), rtol=0, atol=0)
    # The check can fail: one non-zero B (as a random B initialisation would give) changes the logits.
    adapted.model.layers[0].self_attn.q_proj.lora_B["default"].weight.data.fill_(0.01)
    assert (logits(adapted) - logits(base)).abs().max() > 1e-4


def test_all_linear_adapts_every_decoder_linear_layer_and_freezes_the_rest():
    model = build(adapter=AdapterOptions(r=4))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == adapter_parameter_names(model)
    assert len(trainable) == 4 * 7 * 2  # lora_A and lora_B on q,k,v,o,gate,up,down of 4 layers; not the LM head
    # r x (in + out) per layer: q and o 128->128, k and v 128->64, gate/up/down 128<->384; x 4 layers
    assert sum(model.get_parameter(n).numel() for n in trainable) == 4 * 4 * (2 * 256 + 2 * 192 + 3 * 512)


def test_dora_rslora_and_modules_to_save_reach_peft():
    model = build(
        adapter=AdapterOptions(
            r=4, alpha=8.0, target_modules=["q_proj"], use_dora=True, use_rslora=True, modules_to_save=["lm_head"]
        )
    )
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.use_dora["default"] and q_proj.scaling["default"] == pytest.approx(8.0 / 4**0.5)
    assert "lora_magnitude_vector" in str(sorted(adapter_parameter_names(model)))
    assert model.lm_head.modules_to_save["default"].weight.requires_grad
    assert not model.lm_head.original_module.weight.requires_grad


def _fit(module: CausalLM, steps: int = 5) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(micro_batches("reference"), batch_size=None))


@pytest.mark.parametrize("quantization", [None, {"bits": 4}], ids=["lora", "qlora"])
def test_only_adapter_parameters_change_in_training(quantization):
    pl.seed_everything(0, verbose=False)
    module = CausalLM(
        ModelFactory(preset="tiny-llama", adapter={"r": 8}, quantization=quantization),
        learning_rate=1e-2,
        warmup_steps=0,
        weight_decay=0.1,
    )
    module.configure_model()
    before = {k: v.clone() for k, v in module.model.lm.state_dict().items()}
    adapters = adapter_parameter_names(module.model.lm)
    _fit(module)
    after = module.model.lm.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == adapters  # every adapter moved (B from zero), nothing else did (weight decay included)


def test_a_trainable_base_fails_the_only_adapters_check():
    """The check above can fail: a base weight left trainable changes, and is named."""
    pl.seed_everything(0, verbose=False)
    module = CausalLM(ModelFactory(preset="tiny-llama", adapter={"r": 8}), learning_rate=1e-2, warmup_steps=0)
    module.configure_model()
    leaked = module.model.lm.model.layers[0].mlp.down_proj.base_layer.weight
    leaked.requires_grad_(True)
    before = leaked.detach().clone()
    _fit(module, steps=2)
    assert not torch.equal(before, leaked.detach())


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_weights_are_within_the_stated_error_and_the_forward_is_the_dequantized_model(double_quant):
    fp = build()
    qlora = build(adapter={"r": 4}, quantization=QuantizationOptions(bits=4, double_quant=double_quant))
    dequantized = build()  # the fp model with each quantised weight replaced by its dequantised value
    layers = [(n, m) for n, m in qlora.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 4 * 7
    for name, layer in layers:
        plain = name.replace(".base_layer", "")
        original = fp.get_submodule(plain).weight.detach()
        restored = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        blocks = original.reshape(-1, 64)
        error = (blocks - restored.reshape(-1, 64)).abs() / blocks.abs().amax(1, keepdim=True)
        assert error.max() <= NF4_HALF_GAP * (1 + 1e-6) + (DOUBLE_QUANT_SLACK if double_quant else 0.0), name
        dequantized.get_submodule(plain).weight.data.copy_(restored)
    torch.testing.assert_close(logits(qlora), logits(dequantized), rtol=0, atol=1e-5)
    reference = logits(fp)
    assert (logits(qlora) - reference).norm() / reference.norm() < QLORA_LOGITS_RELATIVE_ERROR


def test_an_eval_forward_leaves_the_4bit_weights_untouched():
    """bitsandbytes repacks a 4-bit weight in place on the first no-grad eval forward on AVX-512-BF16
    CPUs, which FSDP2 then trains on stale (docs/platform.md); lit-ablate turns that off."""
    model = build(adapter={"r": 4}, quantization={"bits": 4})
    layer = model.model.layers[0].self_attn.q_proj.base_layer
    packed, scales = layer.weight.data.clone(), layer.weight.quant_state.absmax.clone()
    model.eval()
    logits(model)
    assert torch.equal(layer.weight.data, packed) and torch.equal(layer.weight.quant_state.absmax, scales)


@pytest.mark.skipif(not bnb.functional.has_avx512bf16(), reason="the in-place repack only happens on AVX-512-BF16 CPUs")
def test_bitsandbytes_default_repacks_in_place_on_this_cpu():
    """The test above can fail: with bitsandbytes' default, the same forward rewrites the weight."""
    model = build(adapter={"r": 4}, quantization={"bits": 4})
    layer = model.model.layers[0].self_attn.q_proj.base_layer
    layer.support_avx512bf16_for_cpu = True
    packed = layer.weight.data.clone()
    model.eval()
    logits(model)
    assert layer.weight.data.shape != packed.shape or not torch.equal(layer.weight.data, packed)


def test_a_4bit_state_dict_loads_back_with_its_scales():
    """bitsandbytes saves each 4-bit weight's scales beside it but loads none back; the copy of rank 0's
    weights that sharding strategies load into every rank depends on it (without the pre-hook: unexpected keys)."""
    source, target = (
        build(seed=0, adapter={"r": 4}, quantization={"bits": 4}),
        build(seed=1, adapter={"r": 4}, quantization={"bits": 4}),
    )
    assert not torch.equal(logits(source), logits(target))
    target.load_state_dict(source.state_dict(), strict=True)
    torch.testing.assert_close(logits(target), logits(source), rtol=0, atol=0)


def test_int8_base_trains_its_adapters():
    pl.seed_everything(0, verbose=False)
    module = CausalLM(
        ModelFactory(preset="tiny-llama", adapter={"r": 8}, quantization={"bits": 8}),
        learning_rate=1e-2,
        warmup_steps=0,
    )
    module.configure_model()
    batch = micro_batches("reference")[0]
    losses = []
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(5):
        loss_sum, useful = module.model(batch)
        (loss_sum / useful).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss_sum / useful))
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.parametrize(
    ("options", "key", "fix"),
    [
        ({"adapter": {"r": 0}}, "adapter.r", "positive integer rank"),
        ({"adapter": {"target_modules": "q_proj"}}, "adapter.target_modules", "list of module names"),
        ({"adapter": {"dropout": 1.0}}, "adapter.dropout", r"\[0, 1\)"),
        ({"adapter": {"method": "ia3"}}, "adapter.method", "use lora"),
        ({"quantization": {"bits": 4}}, "quantization", "add an model.init_args.model.adapter section"),
        ({"adapter": {}, "quantization": {"bits": 3}}, "quantization.bits", "use 4"),
        ({"adapter": {}, "quantization": {"quant_type": "int4"}}, "quantization.quant_type", "nf4"),
    ],
)
def test_bad_adapter_and_quantization_options_name_the_key(options, key, fix):
    with pytest.raises(ConfigError, match=rf"model\.init_args\.model\.{key}=.*{fix}"):
        ModelFactory(preset="tiny-llama", **options)


def test_a_target_module_that_matches_nothing_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"model\.init_args\.model\.adapter\.target_modules=\['qkv'\]: peft refused"):
        build(adapter={"target_modules": ["qkv"]})


@pytest.mark.parametrize(
    ("bits", "storage", "model_dtype", "strategy", "reason"),
    [
        (4, "uint8", "float32", FSDP1Strategy, "packed weights are stored as uint8; set quant_storage: float32"),
        (4, "bfloat16", "float32", FSDP1Strategy, "stored as bfloat16; set quant_storage: float32"),
        (8, "uint8", "bfloat16", FSDP1Strategy, "stored as uint8; set quant_storage: bfloat16"),
        (8, "uint8", "float32", FSDP2Strategy, "8-bit layers cannot be sharded"),
        (8, "uint8", "float32", ModelParallelStrategy, "8-bit layers cannot be sharded"),
    ],
)
def test_quantization_a_strategy_cannot_shard_is_refused(bits, storage, model_dtype, strategy, reason):
    with pytest.raises(ConfigError, match=rf"model\.init_args\.model\.quantization=.*{reason}"):
        check_quantization(QuantizationOptions(bits=bits, quant_storage=storage), strategy, model_dtype)
    check_quantization(QuantizationOptions(bits=4, quant_storage="bfloat16"), FSDP1Strategy, "bfloat16")  # FSDP-QLoRA


@pytest.mark.parametrize("shards_integers", [True, False])
def test_packed_uint8_weights_under_fsdp2_are_refused_where_torch_cannot_shard_them(monkeypatch, shards_integers):
    """torch 2.11's ``fully_shard`` fails on a uint8 parameter ("only Tensors of floating point dtype can
    require gradients", seen in every FSDP2 QLoRA test under 2.11): refused there before any work, with
    the fix that works on every torch (the model's dtype as storage); QLoRA under FSDP2 is fine otherwise."""
    monkeypatch.setattr(sharded_weights, "FSDP2_SHARDS_INTEGER_WEIGHTS", shards_integers)
    if shards_integers:
        check_quantization(QuantizationOptions(bits=4), FSDP2Strategy)
    else:
        with pytest.raises(
            ConfigError,
            match=r"model\.init_args\.model\.quantization=.*cannot hold the packed uint8 "
            r"weights \(torch >= 2\.12 can\); set quant_storage: bfloat16, or upgrade",
        ):
            check_quantization(QuantizationOptions(bits=4), FSDP2Strategy, "bfloat16")
    check_quantization(QuantizationOptions(bits=4, quant_storage="bfloat16"), FSDP2Strategy, "bfloat16")
    check_quantization(QuantizationOptions(bits=4), DDPStrategy)  # DDP shards nothing


@pytest.mark.parametrize(
    ("dtype", "storage", "refused"),
    [
        ("bfloat16", "bfloat16", False),
        ("float32", "bfloat16", True),
        ("float32", "uint8", True),
        ("float32", "float32", False),
    ],
)
def test_the_study_rule_reads_the_model_dtype_for_fsdp1_qlora(dtype, storage, refused):
    """A study's config-level rule (``quantization_runs_under_strategy``) judges quant_storage against
    the config's ``model.init_args.model.dtype``, as the run's own check does (seen failing with the
    rule not passing the dtype on: bfloat16 storage in a bfloat16 model refused)."""
    config = {
        "model": {"init_args": {"model": {"dtype": dtype, "quantization": {"bits": 4, "quant_storage": storage}}}},
        "trainer": {"strategy": {"class_path": "lit_ablate.strategies.FSDP1Strategy"}},
    }
    reason = quantization_runs_under_strategy(config)
    assert (reason is not None) == refused, reason
    if refused:
        assert f"set quant_storage: {dtype}" in reason


def test_quant_storage_is_a_view_of_the_same_packed_bytes():
    """A float ``quant_storage`` (for FSDP1) holds the bytes uint8 storage holds: the same forward and
    counts. Seen failing with ``is_quantized`` knowing packed weights by their uint8 dtype only (the
    float32-stored ones counted as plain weights, one per float32 element: 8 packed weights each)."""
    adapter = AdapterOptions(r=4)
    packed = build(quantization=QuantizationOptions(bits=4), adapter=adapter)
    as_float = build(quantization=QuantizationOptions(bits=4, quant_storage="float32"), adapter=adapter)
    weight = as_float.model.layers[0].self_attn.q_proj.base_layer.weight
    assert weight.dtype == torch.float32
    stored = packed.model.layers[0].self_attn.q_proj.base_layer.weight
    assert torch.equal(weight.data.view(torch.uint8).flatten(), stored.data.flatten())
    assert torch.equal(logits(as_float), logits(packed))
    # counted as the same quantised weights and bytes (the estimate and the run record)
    assert count_parameters(as_float, as_float.config) == count_parameters(packed, packed.config)


@pytest.mark.parametrize(
    ("options", "key"),
    [({"quant_storage": "int4"}, "quant_storage"), ({"bits": 8, "quant_storage": "bfloat16"}, "quant_storage")],
)
def test_bad_quant_storage_is_refused_naming_the_key(options, key):
    with pytest.raises(ConfigError, match=rf"model\.init_args\.model\.quantization\.{key}="):
        QuantizationOptions(**options)


@pytest.mark.parametrize(
    ("study", "skipped"),
    [
        ("fsdp1_peft_vs_fsdp2_lora", set()),
        ("lora_rank_targets", set()),
        ("lora_vs_qlora_vs_full", set()),
        ("optimizer_states", {"fsdp2_bnb_adamw8bit"}),
    ],
)
def test_the_adapter_studies_plan_on_cpu(study, skipped, tmp_path):
    """Every variant resolves as ``fit`` would; only bitsandbytes under FSDP2 is skipped (and torchao's
    variants where torchao is not installed), with the reason."""
    from pathlib import Path

    from lit_ablate.ablation.plan import plan_study
    from lit_ablate.ablation.spec import load_study

    runs = plan_study(load_study(Path(__file__).parents[1] / "configs" / "studies" / f"{study}.yaml"), tmp_path)
    assert [r.variant.name for r in runs if r.invalid] == []
    found = {
        r.variant.name for r in runs if r.skip_reason and "needs torchao, which is not installed" not in r.skip_reason
    }
    assert found == skipped
