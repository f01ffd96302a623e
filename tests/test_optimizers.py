"""Optimizers chosen in YAML: 8-bit AdamW (bitsandbytes, torchao) against torch's AdamW, and the
refusals of what cannot run under a strategy.

Full fine-tuning of the tiny Llama (its matrices are large enough for 8-bit states: both libraries
keep tensors under 4096 elements in fp32), 5 steps at lr 1e-2 on ``test_step_objective``'s data,
through a Lightning ``Trainer``. Measured against AdamW after 5 steps: bitsandbytes' AdamW8bit
moves the step losses by 1.1e-3 and its total update has cosine 0.99994 with AdamW's; torchao's
AdamW8bit by 1.7e-2 and cosine 0.906 (its quantised moments lose more of the small early
gradients). The tolerances below are those with ~3x margin. They can fail: AdamW with ``eps`` 1e-3
instead of 1e-8 (a different optimizer) moves the losses by 0.96, cosine 0.69.
"""

from __future__ import annotations

import importlib.util

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lit_ablate.errors import ConfigError
from lit_ablate.estimate.flops import SMALL_TENSOR_ELEMENTS
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from lit_ablate.modules.optim import check_optimizer, optimizer_refusal
from lit_ablate.strategies import DDPStrategy, FSDP1Strategy, FSDP2Strategy, HSDPStrategy
from tests.distributed import run_ranks
from tests.test_step_objective import STEPS, StepLosses, micro_batches

# name: (step-loss tolerance, least cosine of the total update with AdamW's)
TOLERANCES = {"bnb_adamw8bit": (5e-3, 0.999), "torchao_adamw8bit": (0.05, 0.8)}
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (pip install torchao; CI installs it)")  # fmt: skip


def fit(optimizer: str, options: dict | None = None, strategy="auto", devices: int = 1, rank: int = 0) -> dict:
    pl.seed_everything(0, verbose=False)
    module = CausalLM(ModelFactory(preset="tiny-llama"), learning_rate=1e-2, warmup_steps=0, weight_decay=0.1,
                      optimizer=optimizer, optimizer_options=options)  # fmt: skip
    losses = StepLosses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, callbacks=[losses],
        gradient_clip_val=1.0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(micro_batches("reference" if devices == 1 else "ranks", rank), batch_size=None))
    weights = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
    states = [s for o in trainer.optimizers for s in o.state.values()]
    return {"losses": losses.losses, "weights": {k: v.detach().clone() for k, v in weights.items()}, "states": states}


@pytest.fixture(scope="module")
def start() -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    module = CausalLM(ModelFactory(preset="tiny-llama"))
    module.configure_model()
    return {f"model.{k}": v.detach().clone() for k, v in module.model.state_dict().items()}


@pytest.fixture(scope="module")
def adamw() -> dict:
    return fit("adamw")


def update_cosine(run: dict, reference: dict, start: dict) -> float:
    ours = torch.cat([(run["weights"][k] - start[k]).flatten() for k in start])
    theirs = torch.cat([(reference["weights"][k] - start[k]).flatten() for k in start])
    return float(ours @ theirs / ours.norm() / theirs.norm())


def assert_close_to_adamw(run: dict, reference: dict, start: dict, loss_atol: float, least_cosine: float) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=loss_atol)
    assert update_cosine(run, reference, start) >= least_cosine


@pytest.mark.parametrize("name", ["bnb_adamw8bit", pytest.param("torchao_adamw8bit", marks=needs_torchao)])
def test_8bit_adamw_stays_within_the_stated_tolerance_of_adamw(name, adamw, start):
    run = fit(name)
    assert_close_to_adamw(run, adamw, start, *TOLERANCES[name])
    # The states of the large matrices really are 8-bit (bitsandbytes: uint8 tensors; torchao: 8-bit codes).
    firsts = [t for s in run["states"] for t in (s.get("state1"), getattr(s.get("exp_avg"), "codes", None)) if t is not None]
    large = [t for t in firsts if t.numel() >= SMALL_TENSOR_ELEMENTS]
    assert large and all(t.dtype == torch.uint8 for t in large)


def test_a_different_optimizer_fails_the_tolerance(adamw, start):
    with pytest.raises(AssertionError):
        assert_close_to_adamw(fit("adamw", {"eps": 1e-3}), adamw, start, *TOLERANCES["torchao_adamw8bit"])


def _torchao_two_ranks(rank: int, world_size: int) -> dict:
    run = fit("torchao_adamw8bit", strategy=FSDP2Strategy(), devices=2, rank=rank)
    return {"losses": run["losses"], "weights": run["weights"]}


@needs_torchao
def test_torchao_adamw8bit_trains_under_fsdp2_like_adamw(adamw, start):
    """Under FSDP2 each rank quantises the moments of its own shard (other blocks than one process):
    the same tolerance against AdamW holds."""
    for run in run_ranks(_torchao_two_ranks, 2, init_process_group=False, timeout_s=300):
        assert_close_to_adamw(run, adamw, start, *TOLERANCES["torchao_adamw8bit"])


@pytest.mark.parametrize(("name", "strategy", "device", "reason"), [
    ("bnb_adamw8bit", FSDP2Strategy, "cpu", "cannot update the DTensor parameters of FSDP2Strategy"),
    ("bnb_adamw8bit", HSDPStrategy, "cpu", "use torchao_adamw8bit"),
    ("bnb_paged_adamw8bit", DDPStrategy, "cpu", "paged optimizers need CUDA unified memory"),
    ("adam8", None, None, "choose one of"),
])  # fmt: skip
def test_an_optimizer_that_cannot_run_is_refused_naming_the_key(name, strategy, device, reason):
    with pytest.raises(ConfigError, match=rf"model\.init_args\.optimizer='{name}': .*{reason}"):
        check_optimizer(name, strategy, device)


@pytest.mark.parametrize(("name", "strategy"), [("bnb_adamw8bit", DDPStrategy), ("bnb_adamw8bit", FSDP1Strategy),
                                                ("bnb_paged_adamw8bit", None), ("adamw", FSDP2Strategy)])  # fmt: skip
def test_what_runs_is_not_refused(name, strategy):
    assert optimizer_refusal(name, strategy, "cpu" if strategy else "cuda") is None


def test_a_missing_library_is_refused_before_the_model_is_built(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"model\.init_args\.optimizer='torchao_adamw8bit': torchao is not installed"):
        CausalLM(ModelFactory(preset="tiny-llama"), optimizer="torchao_adamw8bit")


def test_fit_refuses_bnb_under_fsdp2_before_building_the_model():
    module = CausalLM(ModelFactory(preset="tiny-llama"), optimizer="bnb_adamw8bit")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(), max_steps=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    with pytest.raises(ConfigError, match=r"model\.init_args\.optimizer='bnb_adamw8bit'"):
        trainer.fit(module, DataLoader(micro_batches("reference"), batch_size=None))
    assert module.model is None


def test_unknown_optimizer_options_name_their_key():
    with pytest.raises(ConfigError, match=r"model\.init_args\.optimizer_options=\{'min_8bit': 0\}"):
        fit("bnb_adamw8bit", {"min_8bit": 0})


@pytest.mark.parametrize(("config", "reason"), [
    ({"model": {"init_args": {"optimizer": "bnb_adamw8bit"}},
      "trainer": {"strategy": {"class_path": "lit_ablate.strategies.FSDP2Strategy"}}}, "cannot update the DTensor"),
    ({"model": {"init_args": {"optimizer": "bnb_paged_adamw8bit"}}, "trainer": {"strategy": "ddp"}}, "paged optimizers"),
    ({"model": {"init_args": {"model": {"adapter": {}, "quantization": {"bits": 4}}}}, "trainer": {"strategy": "fsdp"}},
     "packed weights are stored as uint8; set quant_storage: float32"),
    ({"model": {"init_args": {"model": {"adapter": {}, "quantization": {"bits": 8}}}},
      "trainer": {"strategy": {"class_path": "lit_ablate.strategies.HSDPStrategy"}}}, "8-bit layers cannot be sharded"),
])  # fmt: skip
def test_studies_skip_optimizers_and_quantization_the_strategy_cannot_run(config, reason):
    from lit_ablate import compatibility
    from lit_ablate.ablation.spec import Launch

    rules = {k: compatibility.RULES[k] for k in ("optimizer_runs_here", "quantization_runs_under_strategy")}
    assert reason in compatibility.incompatibility(config, Launch(accelerator="cpu"), rules)
    if "paged" not in reason:  # the others run under DDP (paged ones need a GPU whatever the strategy)
        config["trainer"]["strategy"] = "ddp"
        assert compatibility.incompatibility(config, Launch(accelerator="cpu"), rules) is None


@needs_torchao
def test_torchao_8bit_states_count_their_stored_bytes_not_their_fp32_shape():
    """torchao's ``OptimState8bit`` has the fp32 shape and element size 4 but stores 1-byte codes and
    per-block scales: the memory breakdown counts storages. Catches the old ``numel * element_size``
    count, which reported 8-bit AdamW's states as large as AdamW's (seen failing: 262144 vs 67584)."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from lit_ablate.callbacks.memory import _tensor_bytes

    state = OptimState8bit.zeros((256, 256), block_size=256)
    codes, scales, code_table = 256 * 256, 256 * 4, 256 * 4
    assert _tensor_bytes([state]) == codes + scales + code_table
    plain = torch.zeros(256, 256)
    assert _tensor_bytes([plain, plain.view(-1), plain[:8]]) == plain.numel() * 4  # one storage, counted once
