"""LoRA on MoE experts (``AdapterOptions.experts_r``, ``lit_ablate.models.adapters.expert_lora``).

- With every ``B`` at zero the adapted model's logits are the base model's, bit for bit.
- With random ``B`` the experts compute, per expert ``e`` and row ``x``, the LoRA formula on the
  activations: ``x W_e^T + s (x A_e^T) B_e^T`` (a reference written independently of the
  weight-merging implementation), within fp32 rounding (1e-5), for ``loop`` and ``grouped``; and
  loop == grouped in outputs and adapter gradients. Seen failing with the scaling left out, and
  with ``r/top_k`` silently using ``r``.
- ``experts: hf`` (transformers' stacked experts) gets peft's ``target_parameters`` LoRA: B = 0 is the
  base exactly, random B equals the base with every ``W_e + s B_e A_e`` (1e-5), a step moves only adapters.
- Expert parallelism (EP=2, all-to-all) on 2 ranks, each with its own rows (unequal tokens), trains
  the same expert adapters as one process on all rows: equal step losses (the global token mean)
  over 3 steps within ``LOSS_ATOL``. With the adapters left unsliced under EP it fails (a shape
  mismatch on every rank).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lit_ablate.errors import ConfigError
from lit_ablate.models.adapters.expert_lora import ExpertLoRA
from lit_ablate.models.adapters.lora import AdapterOptions, adapter_parameter_names, adapters_disabled
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.moe.blocks import MoEOptions, moe_blocks
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import ExpertParallelStrategy
from tests.distributed import run_ranks
from tests.test_step_objective import StepLosses, micro_batches

LOSS_ATOL = 2e-5
"""Step losses of 2 EP ranks vs one process: the same arithmetic in another reduction order (fp32)."""

IDS = torch.arange(48).reshape(2, 24) % 250
ADAPTER = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj"], "experts_r": "r/top_k"}


def build(experts: str, adapter: dict | None = ADAPTER, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ModelFactory(preset="tiny-qwen3-moe", moe=MoEOptions(experts=experts), adapter=adapter).build()


def test_expert_adapters_start_at_the_base_model():
    base, adapted = build("grouped", adapter=None), build("grouped")
    torch.manual_seed(1)
    assert torch.equal(base(IDS).logits, adapted(IDS).logits)
    lora = [m for m in adapted.modules() if isinstance(m, ExpertLoRA)]
    assert len(lora) == adapted.config.num_hidden_layers and lora[0].gate_up_A.shape[1] == 4 // 2  # r / top_k
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == adapter_parameter_names(adapted) and any(".experts.adapters." in n for n in trainable)


def _random_b(model: torch.nn.Module) -> None:
    torch.manual_seed(2)
    with torch.no_grad():
        for lora in (m for m in model.modules() if isinstance(m, ExpertLoRA)):
            lora.gate_up_B.normal_(0, 0.05)
            lora.down_B.normal_(0, 0.05)


def _reference(experts, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The LoRA formula on activations, one expert at a time."""
    lora, out = experts.adapters, []
    for e, rows in enumerate(tokens.split(counts.tolist())):
        gate_up = (
            F.linear(rows, experts.gate_up_proj[e]) + lora.scaling * (rows @ lora.gate_up_A[e].T) @ lora.gate_up_B[e].T
        )
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = experts.act_fn(gate) * up
        out.append(
            F.linear(hidden, experts.down_proj[e]) + lora.scaling * (hidden @ lora.down_A[e].T) @ lora.down_B[e].T
        )
    return torch.cat(out)


@pytest.mark.parametrize("implementation", ["loop", "grouped"])
def test_expert_adapters_compute_lora_per_expert(implementation):
    model = build(implementation)
    _random_b(model)
    experts = moe_blocks(model)[0].experts
    torch.manual_seed(3)
    counts = torch.tensor([3, 0, 5, 1, 2, 0, 4, 1])  # an expert without tokens too
    tokens = torch.randn(int(counts.sum()), model.config.hidden_size)
    torch.testing.assert_close(experts(tokens, counts), _reference(experts, tokens, counts), rtol=1e-5, atol=1e-5)
    with adapters_disabled(model):  # DPO's reference forward: the base experts alone
        base = experts(tokens, counts)
    experts.adapters = None
    assert torch.equal(base, experts(tokens, counts))


def test_loop_and_grouped_expert_adapters_agree_in_values_and_gradients():
    results = {}
    for implementation in ("loop", "grouped"):
        model = build(implementation)
        _random_b(model)
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if ".experts.adapters." in n}
        results[implementation] = (loss.detach(), grads)
    torch.testing.assert_close(results["loop"][0], results["grouped"][0], rtol=1e-6, atol=1e-6)
    assert results["loop"][1].keys() == results["grouped"][1].keys()
    for name, grad in results["loop"][1].items():
        torch.testing.assert_close(grad, results["grouped"][1][name], rtol=1e-4, atol=1e-6, msg=name)


def _hf_reference_weights(adapted: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every HF expert weight plus its LoRA update, ``W_e + s B_e A_e``, one expert at a time from peft's
    stacked factors (``A`` ``[E * r, in]`` holds expert ``e`` in rows ``e*r .. e*r+r``, ``B`` ``[out, r * E]``
    in columns ``e, e+E, ..``): a reference written without peft's own delta-weight code."""
    from peft.tuners.lora.layer import ParamWrapper

    weights = {}
    for name, wrapper in adapted.named_modules():
        if not isinstance(wrapper, ParamWrapper):
            continue
        base, experts = wrapper.get_param(), wrapper.num_experts
        a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        r = a.shape[0] // experts
        updated = base.detach().clone()
        for e in range(experts):
            updated[e] += wrapper.scaling["default"] * b[:, e::experts] @ a[e * r : (e + 1) * r]
        block = name.replace(".base_layer", "")
        weights[f"{block}.{wrapper.parameter_name}"] = updated
    return weights


def test_hf_expert_adapters_are_peft_parameter_lora_per_expert():
    """``experts: hf`` (transformers' stacked experts) with ``experts_r``: peft's ``target_parameters`` LoRA.
    B = 0 gives the base logits bit for bit; with random B the logits equal the base model with every expert
    weight replaced by ``W_e + s B_e A_e`` (within 1e-5, fp32); a training step moves only adapter weights.
    Seen failing with the scale left out of the reference (logits 0.21 off), with ``B_e`` read as contiguous
    columns (0.35 off: the reference checks peft's per-expert layout), and with ``r/top_k`` resolved to ``r``."""
    from peft.tuners.lora.layer import ParamWrapper

    base, adapted = build("hf", adapter=None), build("hf")
    base_logits = base(IDS).logits
    assert torch.equal(adapted(IDS).logits, base_logits)
    wrappers = [m for m in adapted.modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 2 * adapted.config.num_hidden_layers  # gate_up_proj and down_proj per layer
    assert all(w.lora_A["default"].weight.shape[0] == w.num_experts * 4 // 2 for w in wrappers)  # r / top_k
    assert all(w.scaling["default"] == 8.0 / 2 for w in wrappers)  # alpha / experts_r
    torch.manual_seed(2)
    with torch.no_grad():
        for wrapper in wrappers:
            wrapper.lora_B["default"].weight.normal_(0, 0.05)
        assert not base.load_state_dict(_hf_reference_weights(adapted), strict=False).unexpected_keys
    torch.testing.assert_close(adapted(IDS).logits, base(IDS).logits, rtol=1e-5, atol=1e-5)
    with adapters_disabled(adapted):  # DPO's reference forward: the base experts alone
        assert torch.equal(adapted(IDS).logits, base_logits)

    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == adapter_parameter_names(adapted) and any(".experts." in n and "lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in adapted.named_parameters()}
    optimizer = torch.optim.SGD([p for p in adapted.parameters() if p.requires_grad], lr=0.1)
    adapted(IDS, labels=IDS).loss.backward()
    optimizer.step()
    changed = {n for n, p in adapted.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable and any(".experts." in n for n in changed)


def test_expert_adapter_options_are_checked():
    with pytest.raises(ConfigError, match="experts_r"):
        AdapterOptions(experts_r=0)
    with pytest.raises(ConfigError, match="dropout"):
        AdapterOptions(experts_r=2, dropout=0.1)
    with pytest.raises(ConfigError, match="no MoE experts"):
        ModelFactory(preset="tiny-llama", adapter={"experts_r": 2}).build()


def _fit(strategy: pl.strategies.Strategy | str, root: Path, devices: int, batches: list[dict]) -> dict:
    pl.seed_everything(0, verbose=False)
    moe = MoEOptions(experts="grouped", load_balance_weight=0.0, z_loss_weight=0.0)  # router losses are per rank
    module = CausalLM(
        ModelFactory(preset="tiny-qwen3-moe", moe=moe, adapter=ADAPTER), learning_rate=1e-2, warmup_steps=0
    )
    losses = StepLosses()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=3,
        callbacks=[losses],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    lora = moe_blocks(module.model)[0].experts.adapters
    return {
        "losses": losses.losses,
        "mesh": getattr(getattr(lora.gate_up_A, "device_mesh", None), "mesh_dim_names", ()),
        "moved": float(_full(lora.gate_up_B).abs().max()),
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _ep(rank: int, world_size: int, root: str) -> dict:
    return _fit(ExpertParallelStrategy(ep=2, dispatch="all_to_all"), Path(root) / "ep", 2, micro_batches("ranks", rank))


@pytest.mark.slow  # 15-40 s on the loaded 2-core machine (two forked ranks + one process, 3 steps each)
def test_expert_parallel_trains_the_same_expert_adapters_as_one_process(tmp_path):
    runs = run_ranks(_ep, 2, str(tmp_path), init_process_group=False, timeout_s=300)
    reference = _fit("auto", tmp_path / "one", 1, micro_batches("reference"))
    assert len(reference["losses"]) == 3 and reference["moved"] > 0  # the expert adapters trained
    for run in runs:
        assert "ep" in run["mesh"]  # the adapters were sliced with their experts
        torch.testing.assert_close(run["losses"], reference["losses"], rtol=0, atol=LOSS_ATOL)


def test_expert_adapter_counts_and_flops():
    """Expert LoRA merges into the expert weights once per step, so its matrices are not per-token matmuls,
    and the adapted active experts get a full weight gradient (6 N, not a frozen 4 N); the estimator's meta
    build (MoE blocks, then adapters) counts the same as the built model."""
    from lit_ablate.estimate.flops import count_parameters
    from lit_ablate.estimate.from_config import model_of

    model = build("grouped")
    counts, plain = (
        count_parameters(model, model.config),
        count_parameters(build("grouped", adapter=None), model.config),
    )
    expert_lora = sum(p.numel() for n, p in model.named_parameters() if ".experts.adapters." in n)
    attention_lora = counts.adapter - expert_lora
    assert expert_lora > 0 and counts.trainable == counts.adapter
    assert counts.matmul == plain.matmul + attention_lora  # q_proj's LoRA is per token; expert LoRA is not
    active_experts = plain.experts * model.config.num_experts_per_tok // model.config.num_experts
    assert counts.trainable_matmul == attention_lora + active_experts
    config = {
        "model": {
            "init_args": {"model": {"preset": "tiny-qwen3-moe", "moe": {"experts": "grouped"}, "adapter": ADAPTER}}
        }
    }
    assert model_of(config)[0] == counts
    # transformers' own experts with peft's parameter LoRA (merged per forward through a parametrization)
    # count the same; seen failing when only ExpertLoRA was recognised (trainable_matmul without the experts).
    hf = build("hf")
    assert count_parameters(hf, hf.config) == counts
    assert (
        model_of(
            {"model": {"init_args": {"model": {**config["model"]["init_args"]["model"], "moe": {"experts": "hf"}}}}}
        )[0]
        == counts
    )
