"""Preference data and the DPO module's bookkeeping: the ``preference`` format (text and chat rows,
masks, overlong handling, bad rows), multipacking that keeps pairs whole, precomputed reference
caches, FLOPs with a reference, the per-step preference metrics, and a visible learning signal.

Seen failing with a bug put in: the DPO logit with chosen and rejected swapped (the policy learns
the wrong preference) fails ``test_reward_accuracy_rises_on_arithmetic_pairs`` (accuracy 0.25 -> 0.05)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch

from lit_ablate.callbacks.preference_metrics import PreferenceMonitor
from lit_ablate.data import (
    ArithmeticPreference,
    ByteTokenizer,
    LMDataModule,
    PackingCollator,
    PreferencePackingCollator,
    PreferencePaddingCollator,
)
from lit_ablate.data.sources import DataSource
from lit_ablate.errors import ConfigError
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import DPO

BOS, EOS, PAD = 257, 258, 256


class Rows(DataSource):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[dict]:
        yield from self.rows


def build(rows: list[dict], seq_len: int = 64, overlong: str = "truncate", **kwargs) -> LMDataModule:
    data = LMDataModule(Rows(rows), format="preference", seq_len=seq_len, overlong=overlong, shuffle=False, **kwargs)
    data.setup()
    return data


def sequences(pair: dict) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of the chosen and the rejected sequence of a pair example."""
    cut = int(pair["chosen_tokens"])
    return [(pair["input_ids"][s].tolist(), pair["labels"][s].tolist()) for s in (slice(0, cut), slice(cut, None))]


def test_text_rows_mask_the_prompt_and_end_responses_with_eos():
    pair = build([{"prompt": "ab", "chosen": "c", "rejected": "de"}]).train_set.examples[0]
    a, b, c, d, e = (ord(x) for x in "abcde")
    assert sequences(pair) == [
        ([BOS, a, b, c, EOS], [-100, -100, c, EOS, -100]),
        ([BOS, a, b, d, e, EOS], [-100, -100, d, e, EOS, -100]),
    ]
    assert int(pair["prompt_tokens"]) == 3


def test_chat_rows_in_both_forms_give_the_same_pair():
    """Whole conversations sharing their prefix, and TRL's prompt + assistant-only form."""
    user = [{"role": "user", "content": "2+2?"}]
    whole = {
        "chosen": [*user, {"role": "assistant", "content": "4"}],
        "rejected": [*user, {"role": "assistant", "content": "5"}],
    }
    split = {
        "prompt": user,
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    first, second = (build([row]).train_set.examples[0] for row in (whole, split))
    assert sequences(first) == sequences(second)
    ids, labels = sequences(first)[0]
    assert ByteTokenizer().decode(ids) == "<user>\n2+2?\n<assistant>\n4"
    assert [t for t in labels if t != -100] == [ord("4"), EOS]  # only the final assistant turn (and its eos) counts


@pytest.mark.parametrize(
    "row,message",
    [
        ({"prompt": "a", "chosen": "b"}, r"row 2=.*'rejected'\] missing"),
        ({"prompt": "a", "chosen": "", "rejected": "c"}, "row 2 chosen=''.*empty response"),
        ({"prompt": "a", "chosen": "same", "rejected": "same"}, "row 2 chosen='same'.*no preference"),
        (
            {
                "chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "z"}],
            },
            "row 2.*same conversation",
        ),
        (
            {"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "y"}]},
            "row 2 chosen.*assistant",
        ),
    ],
)
def test_bad_rows_stop_setup_with_one_line_naming_the_row(row: dict, message: str):
    good = {"prompt": "p", "chosen": "c", "rejected": "r"}
    with pytest.raises(ConfigError, match=message) as error:
        build([good, row])
    assert "\n" not in str(error.value) and str(error.value).startswith("data.init_args.source row 2")


def test_overlong_pairs_cut_the_prompt_first_then_responses_or_are_rejected(caplog):
    rows = [
        {"prompt": "p" * 20, "chosen": "c" * 5, "rejected": "r" * 3},  # prompt cut from its start
        {"prompt": "q", "chosen": "x" * 30, "rejected": "y" * 30},  # responses cut
        {"prompt": "q", "chosen": "z" * 30 + "1", "rejected": "z" * 30 + "2"},  # equal once cut: dropped
        {"prompt": "ok", "chosen": "a", "rejected": "b"},
    ]
    with caplog.at_level(logging.WARNING):
        kept = build(rows, seq_len=16).train_set.examples
    chosen = sequences(kept[0])[0][0]
    assert len(kept) == 3 and len(chosen) == 16 and chosen[-6:] == [ord("c")] * 5 + [EOS]
    assert chosen[0] == ord("p")  # the prompt lost its start (and bos), kept its end next to the response
    cut = sequences(kept[1])
    assert all(len(ids) == 16 and EOS not in ids for ids, _ in cut)
    assert (
        "3 of 4 pairs had a sequence longer than seq_len=16; overlong=truncate: 3 prompts cut from the start, "
        "2 pairs' responses cut at the end, 0 pairs dropped as too long, 1 dropped because their cut responses "
        "became equal"
    ) in caplog.text
    with caplog.at_level(logging.WARNING):
        assert len(build(rows, seq_len=16, overlong="reject").train_set.examples) == 1
    assert "3 pairs dropped as too long" in caplog.text


def test_collators_must_match_the_format():
    with pytest.raises(ConfigError, match=r"data.init_args.collator='PackingCollator': format preference needs"):
        LMDataModule(Rows([]), format="preference", collator=PackingCollator())
    with pytest.raises(ConfigError, match=r"data.init_args.collator='PreferencePaddingCollator'"):
        LMDataModule(Rows([]), format="sft", collator=PreferencePaddingCollator())
    with pytest.raises(ConfigError, match="max_tokens=100: a pair of two sequences of up to seq_len=64"):
        LMDataModule(Rows([]), format="preference", seq_len=64, collator=PreferencePackingCollator(max_tokens=100))


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_multipacking_keeps_every_pair_whole_and_in_one_row(prefix_sharing: bool):
    """Each pair once per epoch; its chosen and rejected sequence in the same row; rows within capacity."""
    collator = PreferencePackingCollator(max_tokens=256, prefix_sharing=prefix_sharing)
    data = LMDataModule(
        ArithmeticPreference(num_examples=60, median_shots=3.0),
        format="preference",
        seq_len=128,
        batch_size=2,
        collator=collator,
    )
    data.setup()
    seen = []
    for batch in data.train_dataloader():
        assert batch["input_ids"].shape[1] <= 256
        pairs = batch["num_pairs"]
        for p in range(pairs):
            rows_of = [set(torch.nonzero(batch["sequence_ids"] == s)[:, 0].tolist()) for s in (p, pairs + p)]
            assert len(rows_of[1]) == 1 and rows_of[1] <= rows_of[0], "a pair split across rows"
        seen += batch["pair_index"].tolist()
    assert len(seen) == len(set(seen)) and len(seen) > 0.9 * 60  # every pair once (the last partial step dropped)


def tiny_dpo(**kwargs) -> DPO:
    factory = ModelFactory(
        preset="tiny-llama", config={"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128}
    )
    return DPO(factory, **kwargs)


def test_precomputed_reference_is_cached_reused_and_checked(tmp_path):
    data = LMDataModule(
        ArithmeticPreference(num_examples=24, max_operand=9),
        format="preference",
        seq_len=32,
        batch_size=5,
        val_examples=4,
    )
    data.setup()
    cache = tmp_path / "reference.pt"

    def precomputed(seed: int) -> tuple[DPO, torch.Tensor]:
        torch.manual_seed(seed)
        dpo = tiny_dpo(reference="precomputed", reference_cache=str(cache))
        dpo.configure_model()
        return dpo, dpo.precompute_reference(data)

    dpo, first = precomputed(0)
    assert cache.is_file() and first.shape == (24, 2) and (first < 0).all()
    batch = data.collator([data.train_set[i] for i in range(3)])
    with torch.no_grad():
        logps, _ = dpo.model(batch)  # the initial model is the reference: same values, looked up by pair_index
    assert torch.allclose(first[batch["pair_index"]].t().reshape(-1), logps, rtol=0, atol=1e-5)
    modified = cache.stat().st_mtime_ns
    assert torch.equal(precomputed(0)[1], first) and cache.stat().st_mtime_ns == modified  # reused, not rewritten
    with pytest.raises(ConfigError, match=r"reference_cache=.*differ from this run's initial model"):
        precomputed(1)
    other = LMDataModule(ArithmeticPreference(num_examples=24, max_operand=9, seed=5), format="preference", seq_len=32)
    other.setup()
    torch.manual_seed(0)
    dpo = tiny_dpo(reference="precomputed", reference_cache=str(cache))
    dpo.configure_model()
    with pytest.raises(ConfigError, match="computed for other preference pairs"):
        dpo.precompute_reference(other)


def test_flops_count_the_reference_forward():
    data = build([{"prompt": "12+7=", "chosen": "19", "rejected": "21"}])
    batch = data.collator([data.train_set[0]])
    frozen, precomputed = tiny_dpo(reference="frozen"), tiny_dpo(reference="precomputed")
    for dpo in (frozen, precomputed):
        dpo.configure_model()
    # policy: forward + backward (6N per token); frozen reference: one more forward (2N).
    assert frozen.flops_per_pair_batch(batch) == pytest.approx(precomputed.flops_per_pair_batch(batch) * 4 / 3)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"loss_type": "simpo"}, "reference='frozen': simpo uses no reference model"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, "label_smoothing=0.1: hinge has no label smoothing"),
        ({"beta": 0.0}, "beta=0.0"),
        ({"reference": "adapter"}, "reference='adapter': the adapter-disabled policy needs adapters"),
        ({"reference": "copy"}, "reference='copy': choose one of"),
        ({"reference_cache": "x.pt"}, "only reference: precomputed"),
        ({"logprobs": "fused"}, "logprobs='fused': choose one of"),
    ],
)
def test_bad_module_options_name_the_key(kwargs: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        tiny_dpo(**kwargs)


def test_reward_accuracy_rises_on_arithmetic_pairs():
    """The checkable signal: after 40 steps the policy prefers the correct answer on most training
    pairs (reward accuracy of the last steps well above the first steps' ~0.5); the monitor's
    loss is the objective's exact pair mean of each step."""
    pl.seed_everything(0, verbose=False)
    data = LMDataModule(
        ArithmeticPreference(num_examples=32, max_operand=9), format="preference", seq_len=24, batch_size=16
    )
    dpo = tiny_dpo(beta=0.5, learning_rate=2e-2, warmup_steps=2)
    monitor = PreferenceMonitor(log_to_logger=False)
    losses = []

    class StepLoss(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(pl_module.objective.last_step_loss.item())

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=40,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor, StepLoss()],
    )
    trainer.fit(dpo, data)
    accuracy = monitor.series["reward_accuracy"]
    early = sum(accuracy[s] for s in range(1, 6)) / 5
    late = sum(accuracy[s] for s in range(36, 41)) / 5
    assert late >= 0.8 and late >= early + 0.2, (early, late)
    assert list(monitor.series["dpo_loss"].values()) == pytest.approx(losses, abs=1e-6)
    margin = monitor.series["reward_margin"][40]
    assert margin == pytest.approx(monitor.series["rewards_chosen"][40] - monitor.series["rewards_rejected"][40])


def test_a_dpo_checkpoint_rebuilds_as_dpo_for_generate_and_export():
    """``CausalLM.from_hparams`` (what generate and export call) builds the class that saved the
    hyper-parameters, so a DPO checkpoint's state dict (policy and reference) loads strictly."""
    from lit_ablate.modules import CausalLM

    dpo = tiny_dpo(loss_type="ipo", beta=0.2)
    dpo.configure_model()
    rebuilt = CausalLM.from_hparams(dict(dpo.hparams), inference=True)
    assert type(rebuilt) is DPO and rebuilt.hparams.loss_type == "ipo"
    rebuilt.configure_model()
    rebuilt.load_state_dict(dpo.state_dict(), strict=True)
    with pytest.raises(ConfigError, match="not written by a lit-ablate CausalLM"):
        CausalLM.from_hparams({**dict(dpo.hparams), "_class_path": "collections.OrderedDict"})


@pytest.mark.parametrize(
    "config,extra",
    [
        ("dpo_tiny.yaml", []),
        ("dpo_multipack.yaml", ["--trainer.devices", "1"]),  # one rank here: the test process must not launch ranks
    ],
)
def test_shipped_configs_fit_and_record_preference_metrics(config: str, extra: list[str], tmp_path, monkeypatch):
    """Both DPO configs run as shipped (a few steps) and their run records hold the monitor's series."""
    from pathlib import Path

    from lit_ablate.cli import main
    from lit_ablate.record import RECORD_PATH_ENV, read_record

    record = tmp_path / "run.json"
    monkeypatch.setenv(RECORD_PATH_ENV, str(record))
    path = Path(__file__).parents[1] / "configs" / config
    main(
        [
            "fit",
            "--config",
            str(path),
            "--trainer.max_steps",
            "4",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.limit_val_batches",
            "0",
            *extra,
        ]
    )
    steps = read_record(record)["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(0 <= s["reward_accuracy"] <= 1 and s["dpo_loss"] > 0 and s["useful_tokens_per_sec"] > 0 for s in steps)
    # The record's loss is the step's pair mean (StepOutput.loss_units), the monitor's dpo_loss;
    # divided by response tokens instead it was several times smaller.
    assert [s["loss"] for s in steps] == pytest.approx([s["dpo_loss"] for s in steps], rel=1e-4)
