"""Parity with TRL's ``DPOTrainer``: the same tiny model, tokenizer and pairs give the same step-1
loss, rewards and log-probs, pair by pair, within 1e-5 in fp32.

What each side is configured with:

- model: a tiny Llama (``tiny-llama`` preset, fp32, sdpa attention). The reference is its initial
  weights ``A``; the policy is ``B = A + 0.02 * noise``, so that rewards are far from 0 (with the
  policy equal to its reference every reward is 0 and a wrong reference would go unseen).
- tokenizer: lit-ablate's byte tokenizer, handed to TRL as its Hugging Face form
  (``ByteTokenizer().hf``: the same ids, ``<bos>`` prepended, ``<eos>`` appended by TRL).
- pairs: four text rows of unequal prompt and response lengths (see ``ROWS``).
- TRL 1.16: ``DPOTrainer(model=B, ref_model=A, processing_class=tokenizer.hf)`` with
  ``DPOConfig(loss_type=[kind], beta=0.3, max_length=None, precompute_ref_log_probs=<frozen: False,
  precomputed: True>, use_cpu=True, bf16=False)`` (TRL defaults to bf16 autocast, which its
  accelerator applies to the reference model's forward: 3e-4 relative off fp32); each pair collated
  alone by TRL's own collator and passed to ``trainer.compute_loss`` (what its first training step
  runs); the per-pair values are read from ``trainer._metrics`` (means over a batch of one pair are
  that pair's values).
- lit-ablate: ``DPO(ModelFactory(pretrained=A), loss_type=kind, beta=0.3, reference=<frozen |
  precomputed>)``, ``configure_model()`` (the frozen reference is copied from ``A``;
  ``precompute_reference`` runs with ``A``), then ``B`` loaded into the policy, then
  ``pair_losses`` on each pair collated alone by ``LMDataModule(format=preference)``'s padded
  collator: the batch TRL builds, token for token. (In one padded batch of all four pairs the
  log-probs near -190 move by ~3e-5: fp32 rounding of other shapes, not a difference of method;
  ``test_dpo.py`` checks layouts against each other.)

Seen failing with bugs put in on purpose: the prompt's last label left unmasked (a wrong response
boundary) fails every log-prob; IPO not divided by response length fails ``ipo``; the reference
ignored (log-ratios against 0) fails the rewards of both reference modes.

``test_three_steps_with_a_separate_reference_equal_trl`` trains: lit-ablate's policy starts from B's
folder with ``reference_model: A`` (frozen, or precomputed from A), TRL's ``DPOTrainer(model=B,
ref_model=A)``, both with AdamW (torch), linear decay without warm-up (lit-ablate's ``lr_schedule:
linear``, ``min_lr_ratio: 0``) and gradients clipped at norm 1, all four pairs in each step. Seen
failing with the reference copied from the policy's start (frozen), computed by the policy
(precomputed), and with the linear decay halved (step 3).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_ablate.data import ByteTokenizer, LMDataModule
from lit_ablate.data.sources import DataSource
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import DPO

trl = pytest.importorskip("trl", reason="trl is in the test extra: pip install 'lit-ablate[test]'")

ATOL = 1e-5
BETA = 0.3
# Unequal prompt and response lengths; responses short enough that sequence log-probs stay near
# -30 or above: fp32 resolution at |logp| ~ 200 is 1.5e-5 (one ulp), beyond the 1e-5 tolerance,
# so two correct fp32 implementations could not agree that closely on long responses.
ROWS = [
    {"prompt": "12+7=", "chosen": "19", "rejected": "21"},
    {"prompt": "3+40=", "chosen": "43", "rejected": "4"},
    {"prompt": "a much longer prompt before the question: 5+5=", "chosen": "10", "rejected": "11!"},
    {"prompt": "x", "chosen": "abcd", "rejected": "no"},
]


class Rows(DataSource):
    """The given rows, as a source."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[dict]:
        yield from self.rows


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """``{"A": reference folder, "B": policy folder}``."""
    torch.manual_seed(0)
    reference = ModelFactory(preset="tiny-llama").build()
    folders = {"A": str(tmp_path_factory.mktemp("A")), "B": str(tmp_path_factory.mktemp("B"))}
    reference.save_pretrained(folders["A"])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    reference.save_pretrained(folders["B"])
    return folders


def trl_per_pair(models: dict[str, str], kind: str, precompute: bool, tmp_path) -> list[dict[str, float]]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path),
        loss_type=[kind],
        beta=BETA,
        max_length=None,
        use_cpu=True,
        bf16=False,
        precompute_ref_log_probs=precompute,
        per_device_train_batch_size=1,
        report_to=[],
        save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )
    reference = AutoModelForCausalLM.from_pretrained(models["A"], dtype=torch.float32)
    trainer = DPOTrainer(
        model=models["B"],
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=ByteTokenizer().hf,
    )
    trainer.model.train()
    out = []
    for i in range(len(ROWS)):
        batch = trainer.data_collator([trainer.train_dataset[i]])
        loss = trainer.compute_loss(trainer.model, batch)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        out.append(
            {
                "loss": loss.item(),
                "chosen_rewards": metrics["rewards/chosen"],
                "rejected_rewards": metrics["rewards/rejected"],
                "chosen_logps": metrics["logps/chosen"],
                "rejected_logps": metrics["logps/rejected"],
            }
        )
    return out


def lit_ablate_per_pair(models: dict[str, str], kind: str, reference: str) -> list[dict[str, float]]:
    data = LMDataModule(Rows(ROWS), format="preference", seq_len=128, batch_size=len(ROWS), shuffle=False)
    data.setup()
    module = DPO(ModelFactory(pretrained=models["A"]), loss_type=kind, beta=BETA, reference=reference)
    module.configure_model()
    if reference == "precomputed":
        module.reference_logps = module.precompute_reference(data)
    policy = ModelFactory(pretrained=models["B"]).build()
    module.model.lm.load_state_dict(policy.state_dict())
    out = []
    for i in range(len(ROWS)):
        batch = data.collator([data.train_set[i]])
        assert batch["pair_index"].tolist() == [i]
        with torch.no_grad():
            result, logps, _ = module.pair_losses(batch)
        out.append(
            {
                "loss": result.losses.item(),
                "chosen_rewards": result.chosen_rewards.item(),
                "rejected_rewards": result.rejected_rewards.item(),
                "chosen_logps": logps[0].item(),
                "rejected_logps": logps[1].item(),
            }
        )
    return out


@pytest.mark.parametrize("reference", ["frozen", "precomputed"])
@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "hinge"])
def test_step_one_equals_trl(models, kind: str, reference: str, tmp_path) -> None:
    expected = trl_per_pair(models, kind, reference == "precomputed", tmp_path)
    actual = lit_ablate_per_pair(models, kind, reference)
    assert any(abs(pair["chosen_rewards"]) > 1e-2 for pair in expected)  # the reference matters here
    for i, (got, want) in enumerate(zip(actual, expected)):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=ATOL, rel=0), f"pair {i} {key}"


def test_text_and_chat_rows_tokenize_as_trl(models, tmp_path) -> None:
    """The token ids and completion masks TRL builds (its prompt/EOS handling, its chat rendering
    with ``add_generation_prompt``) are the ids and labels lit-ablate builds, text and chat rows alike."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    chat = [
        {
            "prompt": [{"role": "user", "content": "What is 2+2?"}],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5, I think"}],
        }
    ]
    for rows in (ROWS, chat):
        args = DPOConfig(
            output_dir=str(tmp_path), max_length=None, use_cpu=True, bf16=False, report_to=[], save_strategy="no"
        )
        trainer = DPOTrainer(
            model=models["A"], args=args, train_dataset=Dataset.from_list(rows), processing_class=ByteTokenizer().hf
        )
        data = LMDataModule(Rows(rows), format="preference", seq_len=128, batch_size=len(rows), shuffle=False)
        data.setup()
        for i in range(len(rows)):
            theirs = trainer.data_collator([trainer.train_dataset[i]])
            ours = data.collator([data.train_set[i]])
            assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
            # TRL marks completion tokens; lit-ablate labels the position before each one.
            completion = theirs["completion_mask"][:, 1:].bool()
            assert (ours["labels"][:, :-1] != -100).tolist() == completion.tolist()


# --- a separate reference checkpoint (TRL's ref_model): three training steps -----------------
TRAIN_STEPS = 3
TRAIN_LR = 1e-3
STEP_KEYS = {
    "loss": "loss",
    "rewards/chosen": "reward_chosen",
    "rewards/rejected": "reward_rejected",
    "logps/chosen": "logps_chosen",
    "logps/rejected": "logps_rejected",
}
"""TRL's logged metric -> lit-ablate's ``PREFERENCE_STATS`` name (each a mean over the step's pairs)."""
TRAIN_ATOL = 1e-5
"""Per-step means over 3 steps, fp32, Adam updates in between: measured at most 1.9e-6 apart (one fp32
ulp of a log-prob near -20), losses 2.4e-7; the values move by 0.1 to 0.7 between steps."""


def trl_steps(models: dict[str, str], precompute: bool, tmp_path) -> list[dict[str, float]]:
    """TRL's per-step means: its ``DPOTrainer`` trains policy B against ``ref_model`` A, all four pairs
    per step, AdamW (torch) with linear decay from ``TRAIN_LR`` and no warm-up, gradients clipped at 1."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class Logs(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs and "loss" in logs:
                self.steps.append({key: logs[key] for key in STEP_KEYS})

    args = DPOConfig(
        output_dir=str(tmp_path),
        loss_type=["sigmoid"],
        beta=BETA,
        max_length=None,
        use_cpu=True,
        bf16=False,
        precompute_ref_log_probs=precompute,
        per_device_train_batch_size=len(ROWS),
        max_steps=TRAIN_STEPS,
        learning_rate=TRAIN_LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )
    logs = Logs()
    trainer = DPOTrainer(
        model=models["B"],
        ref_model=AutoModelForCausalLM.from_pretrained(models["A"], dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=ByteTokenizer().hf,
        callbacks=[logs],
    )
    trainer.train()
    return logs.steps


def lit_ablate_steps(models: dict[str, str], reference: str, reference_model: str) -> list[dict[str, float]]:
    """lit-ablate's per-step means (``outputs["preference"]``): policy B from its own folder, the
    separate ``reference_model``, the same optimizer, schedule (``lr_schedule: linear``) and clipping."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lit_ablate.record import PREFERENCE_STATS

    class Steps(Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sums = dict(zip(PREFERENCE_STATS, outputs["preference"].tolist()))
            self.steps.append({key: sums[name] / sums["pairs"] for key, name in STEP_KEYS.items()})

    data = LMDataModule(Rows(ROWS), format="preference", seq_len=128, batch_size=len(ROWS), shuffle=False)
    module = DPO(
        ModelFactory(pretrained=models["B"]),
        beta=BETA,
        reference=reference,
        reference_model=reference_model,
        learning_rate=TRAIN_LR,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        warmup_steps=0,
        lr_schedule="linear",
        min_lr_ratio=0.0,
    )
    steps = Steps()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=TRAIN_STEPS,
        gradient_clip_val=1.0,
        callbacks=[steps],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)
    return steps.steps


@pytest.mark.parametrize("reference", ["frozen", "precomputed"])
def test_three_steps_with_a_separate_reference_equal_trl(models, reference: str, tmp_path) -> None:
    """``reference_model: A`` with the policy starting from another checkpoint B is TRL's
    ``DPOTrainer(model=B, ref_model=A)``: the loss, rewards and log-probs of each of the first three
    training steps agree. Seen failing with the reference taken from the policy's own start (the
    copy ``reference: frozen`` made before ``reference_model`` existed): step-1 rewards 0 instead of
    TRL's, and with the precomputed log-probs computed by the policy instead of A (the same); with
    ``lr_schedule: linear`` decaying at half the rate, step 3 fails."""
    expected = trl_steps(models, reference == "precomputed", tmp_path)
    actual = lit_ablate_steps(models, reference, models["A"])
    assert len(expected) == len(actual) == TRAIN_STEPS
    assert abs(expected[0]["rewards/chosen"]) > 1e-2  # the separate reference matters from step 1
    assert expected[-1]["loss"] < expected[0]["loss"]  # it trains: steps 2 and 3 compare updated policies
    for step, (got, want) in enumerate(zip(actual, expected), start=1):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=TRAIN_ATOL, rel=0), f"step {step} {key}"
