"""DPO layouts and distribution train the same model: packed == padded, prefix-shared == unshared
(loss and every gradient, for every loss type), and 2-rank FSDP2 == one process over training
steps with unequal pair lengths and counts per rank.

The pairs come from ``ArithmeticPreference`` with worked examples before the question, so
prompt lengths (and with them the pair lengths) differ a lot. The policy is perturbed away from
its reference (0.02 x noise) so that log-ratios, rewards and their gradients are far from 0.

Tolerances (fp32): layouts run the same math in other shapes, so losses agree to ~1e-7 and
gradients to ~1e-6 relative (``GRAD_RTOL`` = max |diff| / max |value| per tensor). Training runs
use ``tests/test_step_objective.py``'s tolerances (Adam magnifies rounding: ~1e-4 on single
elements whose gradient is near 0).

Bugs put in on purpose, and which test saw them:
- packed rows whose rejected documents are summed into the chosen sequence (``sequence_ids``
  of the rejected doc = the chosen's): ``test_packed_equals_padded`` fails for every loss;
- ``position_ids`` counting on across the documents of a row (attention and RoPE leak across
  documents): ``test_packed_equals_padded`` fails;
- a branch mask that lets the rejected branch see the chosen one (``key_branch <= query_branch``):
  ``test_prefix_shared_equals_unshared`` fails for every loss;
- the per-micro-batch mean (each micro-batch divided by its own pairs, then averaged again):
  ``test_fsdp2_two_ranks_equal_one_process`` and ``test_accumulation_equals_one_batch`` fail.

A separate reference checkpoint (``reference_model``) is a perturbed tiny Llama saved with
``save_pretrained``: it is the frozen reference in one process, under FSDP2 and DDP, and computes the
``precomputed`` log-probs (its own cache, never another model's); each test names the bug it caught.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lit_ablate.data import ArithmeticPreference, LMDataModule, PreferencePackingCollator, PreferencePaddingCollator
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import DPO
from lit_ablate.strategies import DDPStrategy, FSDP2Strategy
from tests.distributed import run_ranks
from tests.test_step_objective import PerMicroBatchMean, StepLosses
from tests.test_step_objective import assert_same_training as step_objective_check

LOSS_TYPES = {"sigmoid": {"label_smoothing": 0.1}, "ipo": {}, "hinge": {}, "simpo": {"reference": "none"}}
GRAD_RTOL = 2e-5
SEQ_LEN = 96


def pairs(count: int = 6, seed: int = 0) -> list[dict]:
    data = LMDataModule(
        ArithmeticPreference(num_examples=count, max_operand=30, median_shots=2.0, seed=seed),
        format="preference",
        seq_len=SEQ_LEN,
        shuffle=False,
    )
    data.setup()
    return data.train_set.examples


def padded(items: list[dict]) -> dict:
    collator = PreferencePaddingCollator()
    collator.bind(256, SEQ_LEN)
    return collator(items)


def packed(items: list[dict], prefix_sharing: bool = False, max_tokens: int | None = None) -> dict:
    collator = PreferencePackingCollator(within_batch=True, prefix_sharing=prefix_sharing, max_tokens=max_tokens)
    collator.bind(256, SEQ_LEN)
    return collator(items)


def module(kind: str, attention: str) -> DPO:
    """A DPO module whose policy is the seeded tiny Llama moved 0.02 x noise away from its reference."""
    options = dict(LOSS_TYPES[kind])
    torch.manual_seed(0)
    dpo = DPO(
        ModelFactory(preset="tiny-llama", attn_implementation=attention),
        loss_type=kind,
        beta=0.5,
        reference=options.pop("reference", "frozen"),
        **options,
    )
    dpo.configure_model()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in dpo.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    return dpo


def loss_and_grads(dpo: DPO, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    result, _, _ = dpo.pair_losses(batch)
    loss = result.losses.mean()
    named = [(n, p) for n, p in dpo.model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named])
    return loss.detach(), {n: g for (n, _), g in zip(named, grads)}


def assert_same(got: tuple, want: tuple) -> None:
    assert got[0].item() == pytest.approx(want[0].item(), abs=1e-6, rel=0)
    for name, value in want[1].items():
        error = ((got[1][name] - value).abs().max() / value.abs().max().clamp(min=1e-30)).item()
        assert error <= GRAD_RTOL, f"{name}: relative gradient error {error:.1e}"


def test_pairs_have_unequal_lengths_and_packed_rows_hold_several_pairs():
    items = pairs()
    lengths = [len(p["input_ids"]) for p in items]
    assert max(lengths) > 2 * min(lengths), lengths
    batch = packed(items, max_tokens=2 * SEQ_LEN)
    assert batch["input_ids"].shape[0] < len(items) and batch["num_pairs"] == len(items)


@pytest.mark.parametrize("kind", list(LOSS_TYPES))
def test_packed_equals_padded(kind: str) -> None:
    """Several pairs per packed row (sdpa_packed) against TRL's padded layout (sdpa)."""
    items = pairs()
    want = loss_and_grads(module(kind, "sdpa"), padded(items))
    got = loss_and_grads(module(kind, "sdpa_packed"), packed(items, max_tokens=2 * SEQ_LEN))
    assert_same(got, want)


@pytest.mark.parametrize("kind", list(LOSS_TYPES))
def test_prefix_shared_equals_unshared(kind: str) -> None:
    """Each pair's prompt computed once under the branch mask (sdpa) against two full sequences."""
    items = pairs()
    want = loss_and_grads(module(kind, "sdpa_packed"), packed(items))
    shared = packed(items, prefix_sharing=True)
    assert shared["input_ids"].ne(256).sum() < packed(items)["input_ids"].ne(256).sum()  # fewer tokens computed
    assert_same(loss_and_grads(module(kind, "sdpa"), shared), want)


def test_adapter_disabled_reference_equals_a_frozen_copy() -> None:
    """With LoRA adapters, ``reference: adapter`` (the policy with its adapters switched off) is the
    frozen base, as a frozen copy taken at initialisation is (adapters start at B = 0). The
    adapters are moved away from 0 first, so the policy differs from its reference; the adapters
    must be on again afterwards (same gradients). Seen failing with the adapters left on during
    the reference forward (the reference then equals the policy: zero rewards)."""
    from lit_ablate.models.adapters.lora import AdapterOptions

    def adapted(reference: str) -> DPO:
        torch.manual_seed(0)
        dpo = DPO(ModelFactory(preset="tiny-llama", adapter=AdapterOptions(r=4)), beta=0.5, reference=reference)
        dpo.configure_model()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in dpo.model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=generator))
        return dpo

    batch = padded(pairs(4))
    frozen, adapter = adapted("frozen"), adapted("adapter")
    assert adapter.reference is None  # no second model
    assert_same(loss_and_grads(adapter, batch), loss_and_grads(frozen, batch))
    result, _, _ = adapter.pair_losses(batch)
    assert result.chosen_rewards.abs().max() > 1e-3
    assert all(p.requires_grad for n, p in adapter.model.named_parameters() if "lora_" in n)


def test_prefix_sharing_refuses_a_backend_without_its_mask() -> None:
    from lit_ablate.errors import ConfigError

    with pytest.raises(ConfigError, match="attn_implementation='sdpa_packed': prefix sharing needs"):
        module("sigmoid", "sdpa_packed").pair_losses(packed(pairs(2), prefix_sharing=True))


# --- training: accumulation and 2-rank FSDP2 against one process ------------------------------
STEPS = 4


def step_pairs() -> list[list[dict]]:
    """Per step, four pairs: three long ones then one short one (so micro-batches and ranks that
    split them 3 + 1 differ in pair count and in tokens)."""
    items = sorted(pairs(4 * STEPS, seed=3), key=lambda p: -len(p["input_ids"]))
    long, short = items[: 3 * STEPS], items[3 * STEPS :]
    return [[*long[3 * s : 3 * s + 3], short[s]] for s in range(STEPS)]


def micro_batches(variant: str, rank: int = 0) -> list[dict]:
    steps = step_pairs()
    if variant == "reference":
        return [padded(step) for step in steps]
    if variant == "accumulate":
        return [padded(part) for step in steps for part in (step[:3], step[3:])]
    if variant == "packed":
        return [packed(step) for step in steps]
    return [padded(step[:3] if rank == 0 else step[3:]) for step in steps]  # ranks: 3 pairs vs 1


def fit(
    variant: str,
    strategy="auto",
    devices: int = 1,
    rank: int = 0,
    old: bool = False,
    lora: bool = False,
    reference_model: str | None = None,
) -> dict:
    """``lora``: LoRA adapters on the policy and ``reference: adapter`` (the policy, adapters off);
    ``reference_model``: a separate frozen reference checkpoint."""
    from lit_ablate.models.adapters.lora import AdapterOptions

    pl.seed_everything(0, verbose=False)
    attention = "sdpa_packed" if variant == "packed" else "sdpa"
    factory = ModelFactory(
        preset="tiny-llama", attn_implementation=attention, adapter=AdapterOptions(r=4) if lora else None
    )
    dpo = DPO(
        factory,
        beta=0.5,
        learning_rate=1e-2,
        warmup_steps=0,
        weight_decay=0.1,
        reference="adapter" if lora else "frozen",
        reference_model=reference_model,
    )
    if old:
        dpo.objective = PerMicroBatchMean()
    losses = StepLosses()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[losses],
        accumulate_grad_batches=2 if variant == "accumulate" else 1,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(dpo, DataLoader(micro_batches(variant, rank), batch_size=None))
    weights = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
    return {"losses": losses.losses, "weights": {k: v.detach().clone() for k, v in weights.items()}}


def assert_same_training(run: dict, reference: dict, **tolerances: float) -> None:
    step_objective_check(run, reference, steps=STEPS, **tolerances)


SEPARATE_REFERENCE_TOLERANCES = {"loss_atol": 1e-4, "weight_mean_atol": 5e-6, "weight_max_atol": 2e-3}
"""A sequence's log-prob is a sum over up to ~100 tokens (|sum| ~ 400 at the start), so fp32 rounding
leaves ~3e-5 in it. Against a copy of the policy that rounding cancels in the log-ratio; against
another checkpoint it does not, and the reduction order (one process vs 2 ranks) shows. Measured
(loss / weights' mean / max): 4.2e-6 / 7.0e-7 / 5.5e-4 with AVX-512 kernels, 3.0e-5 / 1.4e-6 /
5.5e-4 with AVX2's (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``),
3.4e-5 / 6.9e-7 / 5.9e-4 with the unvectorised ones; the shared ``LOSS_ATOL`` (2e-5) failed on
AVX2. Ranks whose reference is the policy's start instead of the checkpoint: 0.14 off at step 3."""


@pytest.fixture(scope="module")
def reference() -> dict:
    run = fit("reference")
    assert run["losses"][-1] < run["losses"][0]  # it trains: the comparisons below are not of a frozen model
    return run


@pytest.mark.parametrize("variant", ["accumulate", "packed"])
def test_accumulation_and_packing_equal_one_batch(reference, variant: str) -> None:
    assert_same_training(fit(variant), reference)


def _two_ranks(rank: int, world_size: int, old: bool, lora: bool = False) -> dict:
    return fit("ranks", FSDP2Strategy(), devices=2, rank=rank, old=old, lora=lora)


def test_fsdp2_two_ranks_equal_one_process(reference) -> None:
    """Both the policy and the frozen reference are sharded; rank 0 holds three long pairs per
    step, rank 1 one short pair."""
    for run in run_ranks(_two_ranks, 2, False, init_process_group=False, timeout_s=300):
        assert_same_training(run, reference)


def test_fsdp2_two_ranks_with_adapter_reference_equal_one_process() -> None:
    """LoRA policy, reference = the same sharded model with its adapters switched off each step."""
    single = fit("reference", lora=True)
    assert single["losses"][0] == pytest.approx(0.6931472, abs=1e-6)  # step 1: policy = reference (B = 0)
    assert all(value.abs().max() > 0 for name, value in single["weights"].items() if "lora_B" in name)  # trained
    for run in run_ranks(_two_ranks, 2, False, True, init_process_group=False, timeout_s=300):
        assert_same_training(run, single)


def precomputed_reference(rank: int = 0, world_size: int = 1, reference_model: str | None = None) -> torch.Tensor:
    """The reference log-probs a ``reference: precomputed`` fit computes before its first step."""
    pl.seed_everything(0, verbose=False)
    data = LMDataModule(
        ArithmeticPreference(num_examples=23, max_operand=30, median_shots=2.0),
        format="preference",
        seq_len=SEQ_LEN,
        batch_size=2,
        val_examples=3,
    )
    dpo = DPO(ModelFactory(preset="tiny-llama"), reference="precomputed", reference_model=reference_model)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=FSDP2Strategy() if world_size > 1 else "auto",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(dpo, data)
    return dpo.reference_logps.cpu()


def _precomputed_on_ranks(rank: int, world_size: int, reference_model: str | None = None) -> torch.Tensor:
    return precomputed_reference(rank, world_size, reference_model)


def test_precomputed_reference_on_two_sharded_ranks_equals_one_process() -> None:
    """Ranks split the pairs (23: an odd count, so one rank runs an extra dummy forward to keep
    the sharded model's collectives in step), then join their shares: every rank holds every
    pair's values (training and held-out), equal to one process's. Seen failing with the join
    left out (each rank then holds only its own pairs' values, zeros elsewhere)."""
    single = precomputed_reference()
    assert single.shape == (23, 2) and (single < 0).all()
    for ranks_result in run_ranks(_precomputed_on_ranks, 2, init_process_group=False, timeout_s=300):
        torch.testing.assert_close(ranks_result, single, rtol=0, atol=1e-5)


def test_the_per_micro_batch_mean_fails_these_checks(reference) -> None:
    with pytest.raises(AssertionError):
        assert_same_training(fit("accumulate", old=True), reference)
    with pytest.raises(AssertionError):
        assert_same_training(run_ranks(_two_ranks, 2, True, init_process_group=False, timeout_s=300)[0], reference)


# --- a separate reference checkpoint (reference_model) ------------------------------------------
@pytest.fixture(scope="module")
def reference_folder(tmp_path_factory) -> str:
    """A reference checkpoint other than the policy's start (the seeded tiny Llama): that model moved
    0.02 x noise, saved as ``save_pretrained`` (and ``lit-ablate export``) writes it."""
    pl.seed_everything(0, verbose=False)
    lm = ModelFactory(preset="tiny-llama").build()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    folder = tmp_path_factory.mktemp("reference")
    lm.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def separate(reference_folder) -> dict:
    return fit("reference", reference_model=reference_folder)


def test_a_separate_reference_is_the_checkpoint_frozen(separate, reference, reference_folder) -> None:
    """Step 1 against a copy of the start is ln 2 (policy = reference); against the separate checkpoint it
    is not, and the reference's weights after training are the folder's (frozen, never stepped).
    Seen failing with the reference copied from the policy's start as before (step 1 = ln 2)."""
    assert reference["losses"][0] == pytest.approx(0.6931472, abs=1e-6)
    assert abs(separate["losses"][0] - 0.6931472) > 1e-2
    saved = ModelFactory(pretrained=reference_folder).build().state_dict()
    kept = {k.removeprefix("reference.lm."): v for k, v in separate["weights"].items() if k.startswith("reference.lm.")}
    assert kept.keys() == saved.keys()
    assert all(torch.equal(kept[k], saved[k]) for k in saved)


def _two_ranks_separate(rank: int, world_size: int, strategy: str, reference_model: str) -> dict:
    chosen = FSDP2Strategy() if strategy == "fsdp2" else DDPStrategy()
    return fit("ranks", chosen, devices=2, rank=rank, reference_model=reference_model)


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_separate_reference_on_two_ranks_equals_one_process(separate, reference_folder, strategy: str) -> None:
    """The separate reference is built where the policy is (FSDP2: on meta on rank 1, sharded, rank 0's
    weights copied in; DDP: whole on each rank): 4 steps equal one process's. Seen failing under FSDP2
    before the factory built a checkpoint's shapes alone on meta (transformers refuses from_pretrained
    under a meta device, so rank 1 crashed; a pretrained policy did too)."""
    for run in run_ranks(_two_ranks_separate, 2, strategy, reference_folder, init_process_group=False, timeout_s=300):
        assert_same_training(run, separate, **SEPARATE_REFERENCE_TOLERANCES)


def test_precomputed_from_a_separate_reference_on_two_sharded_ranks(reference_folder) -> None:
    """``precomputed`` with ``reference_model`` computes the log-probs with that checkpoint (not the
    policy's start), sharded over 2 FSDP2 ranks like the policy, equal to one process. Seen failing with
    the policy computing them (equal to ``reference_model: null``'s) and with the reference not sharded by
    the strategy (rank 1's stays on meta)."""
    single = precomputed_reference(reference_model=reference_folder)
    assert (single - precomputed_reference()).abs().max() > 1e-2
    for ranks_result in run_ranks(_precomputed_on_ranks, 2, reference_folder, init_process_group=False, timeout_s=300):
        torch.testing.assert_close(ranks_result, single, rtol=0, atol=1e-5)


def test_a_cache_from_another_model_is_refused(reference_folder, tmp_path) -> None:
    """A ``reference_cache`` written by the policy's start is refused by a run whose reference is
    another checkpoint (and the other way round); the same reference reuses its cache. Seen failing with
    the policy's start computing ``precomputed`` log-probs whatever ``reference_model`` says."""
    from lit_ablate.errors import ConfigError

    data = LMDataModule(
        ArithmeticPreference(num_examples=6, max_operand=30, median_shots=2.0),
        format="preference",
        seq_len=SEQ_LEN,
        batch_size=2,
    )
    data.setup()

    def logps(reference_model: str | None, cache: str) -> torch.Tensor:
        torch.manual_seed(0)
        dpo = DPO(
            ModelFactory(preset="tiny-llama"),
            reference="precomputed",
            reference_model=reference_model,
            reference_cache=str(tmp_path / cache),
        )
        dpo.configure_model()
        return dpo.precompute_reference(data)

    own = logps(None, "start.pt")
    separate = logps(reference_folder, "separate.pt")
    torch.testing.assert_close(logps(reference_folder, "separate.pt"), separate, rtol=0, atol=0)  # reused
    with pytest.raises(ConfigError, match=r"reference_cache=.*start\.pt'.*differ from this run's reference_model"):
        logps(reference_folder, "start.pt")
    with pytest.raises(ConfigError, match=r"reference_cache=.*separate\.pt'.*differ from this run's initial model"):
        logps(None, "separate.pt")
    assert (own - separate).abs().max() > 1e-2


@pytest.fixture(scope="module")
def wider_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("wider")
    ModelFactory(preset="tiny-llama", config={"intermediate_size": 256}).build().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"reference": "none", "loss_type": "simpo"},
            r"reference_model=.*only reference: frozen or precomputed .*\(reference is none\)",
        ),
        (
            {"reference": "adapter"},
            r"reference_model=.*only reference: frozen or precomputed .*\(reference is adapter\)",
        ),
        (
            {"reference_model": "./no/such/folder"},
            r"model\.init_args\.reference_model='\./no/such/folder': no such directory",
        ),
        (
            {"reference_model": "wider"},
            r"reference_model=.*architecture differs.*intermediate_size 256 \(the policy's: 384\)",
        ),
    ],
)
def test_a_reference_model_that_cannot_serve_is_refused_naming_the_key(
    options, message, reference_folder, wider_folder
) -> None:
    from lit_ablate.errors import ConfigError
    from lit_ablate.models.adapters.lora import AdapterOptions

    options = {"reference_model": reference_folder, **options}
    if options["reference_model"] == "wider":
        options["reference_model"] = wider_folder
    adapter = AdapterOptions(r=4) if options.get("reference") == "adapter" else None
    with pytest.raises(ConfigError, match=message):
        DPO(ModelFactory(preset="tiny-llama", adapter=adapter), **options)
