"""The data layer: tokenizers, sources, formats, padding, sharding over ranks and exact resume."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from unittest.mock import Mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ParallelStrategy

from lit_ablate.data import (
    ArithmeticSFT,
    ByteTokenizer,
    LMDataModule,
    LocalFiles,
    PackingCollator,
    PaddingCollator,
    SyntheticText,
    build_examples,
    load_tokenizer,
)
from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX


def _fake_trainer(num_replicas: int, rank: int, training: bool = True, epoch: int = 0) -> SimpleNamespace:
    strategy = Mock(spec=ParallelStrategy, distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank})
    return SimpleNamespace(strategy=strategy, training=training, current_epoch=epoch, accumulate_grad_batches=1)


def _targets(example: dict[str, torch.Tensor]) -> list[int]:
    labels = example["labels"]
    return labels[labels != IGNORE_INDEX].tolist()


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode_and_reserves_specials():
    tok = load_tokenizer("byte")
    text = "héllo, wörld 🚀\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == text
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)


def test_byte_chat_template_trains_only_on_assistant_turns():
    tok = ByteTokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    ids, trainable = tok.chat(messages)
    assert len(ids) == len(trainable)
    trained = [i for i, t in zip(ids, trainable) if t]
    assert trained == [*tok.encode("4"), tok.eos_id, *tok.encode("6"), tok.eos_id]
    assert "be brief" in tok.decode(ids) and "and 3+3?" in tok.decode(ids)


def _tiny_hf_tokenizer(path) -> str:
    """A word-level tokenizer with a chat template, trained in milliseconds and saved locally."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["what is two plus two", "four", "and three plus three", "six", "user assistant system"]
    raw.train_from_iterator(
        corpus, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>", "<|im|>"])
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = (
        "{% for m in messages %}<|im|> {{ m['role'] }} {{ m['content'] }} "
        "{% if m['role'] == 'assistant' %}</s> {% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im|> assistant {% endif %}"
    )
    hf.save_pretrained(path)
    return str(path)


def test_hf_tokenizer_loads_offline_and_masks_chat_by_its_template(tmp_path):
    tok = load_tokenizer(_tiny_hf_tokenizer(tmp_path / "tok"))
    assert tok.vocab_size == len(tok.hf) and tok.eos_id == tok.hf.convert_tokens_to_ids("</s>")
    assert tok.decode(tok.encode("two plus two")) == "two plus two"
    messages = [
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "and three plus three"},
        {"role": "assistant", "content": "six"},
    ]
    ids, trainable = tok.chat(messages)
    trained = [i for i, t in zip(ids, trainable) if t]
    assert tok.hf.convert_ids_to_tokens(trained) == ["four", "</s>", "six", "</s>"]


def test_unknown_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"data.init_args.tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))


# --- formats ------------------------------------------------------------------------------------


def test_pretrain_windows_label_the_next_token_of_the_stream():
    tok = ByteTokenizer()
    rows = [{"text": "abc"}, {"text": "defgh"}, {"text": "ij"}]
    stream = []
    for row in rows:
        stream += [*tok.encode(row["text"]), tok.eos_id]
    examples = build_examples(rows, tok, "pretrain", seq_len=4, overlong="truncate")
    assert len(examples) == (len(stream) - 1) // 4
    for k, e in enumerate(examples):
        assert e["input_ids"].tolist() == stream[4 * k : 4 * k + 4]
        assert e["labels"].tolist() == stream[4 * k + 1 : 4 * k + 5]  # every position counts


def test_sft_labels_only_the_response_and_eos():
    tok = ByteTokenizer()
    rows = list(ArithmeticSFT(num_examples=20, seed=3))
    examples = build_examples(rows, tok, "sft", seq_len=64, overlong="truncate")
    assert len(examples) == len(rows)
    for row, e in zip(rows, examples):
        response = [*tok.encode(row["response"]), tok.eos_id]
        assert _targets(e) == response
        assert int((e["labels"] != IGNORE_INDEX).sum()) == len(response)
        # shifted: the label at t is the input at t+1; the prompt's positions (bar the last) have none
        prompt_len = 1 + len(tok.encode(row["prompt"]))
        assert (e["labels"][: prompt_len - 1] == IGNORE_INDEX).all()
        assert e["labels"][prompt_len - 1 : -1].tolist() == e["input_ids"][prompt_len:].tolist()
        assert e["labels"][-1] == IGNORE_INDEX


def test_overlong_truncate_keeps_a_prefix_and_reject_drops_with_a_logged_count(caplog):
    tok = ByteTokenizer()
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "long prompt: ", "response": "a much longer answer"}]
    with caplog.at_level(logging.WARNING, logger="lit_ablate.data.formats"):
        truncated = build_examples(rows, tok, "sft", seq_len=16, overlong="truncate")
    assert "(format=sft): 1 of 2 examples were longer than seq_len=16" in caplog.text
    assert [len(e["input_ids"]) for e in truncated] == [7, 16]
    full = build_examples(rows, tok, "sft", seq_len=64, overlong="truncate")[1]
    assert truncated[1]["input_ids"].tolist() == full["input_ids"][:16].tolist()
    assert (
        truncated[1]["labels"][:15].tolist() == full["labels"][:15].tolist()
        and truncated[1]["labels"][15] == IGNORE_INDEX
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_ablate.data.formats"):
        rejected = build_examples(rows, tok, "sft", seq_len=16, overlong="reject")
    assert "overlong=reject dropped" in caplog.text
    assert [e["input_ids"].tolist() for e in rejected] == [truncated[0]["input_ids"].tolist()]
    # a prompt that alone fills seq_len leaves no label: it is dropped rather than trained on nothing
    assert build_examples([*rows[:1], {"prompt": "x" * 40, "response": "y"}], tok, "sft", 16, "truncate")[1:] == []


def test_documents_format_keeps_each_document_whole_with_bos_and_eos():
    tok = ByteTokenizer()
    rows = list(SyntheticText(num_documents=30, seed=1))
    examples = build_examples(rows, tok, "documents", seq_len=10_000, overlong="truncate")
    for row, e in zip(rows, examples):
        ids = [tok.bos_id, *tok.encode(row["text"]), tok.eos_id]
        assert e["input_ids"].tolist() == ids and _targets(e) == ids[1:]
    lengths = sorted(len(e["input_ids"]) for e in examples)
    assert lengths[-1] > 2 * lengths[len(lengths) // 2]  # log-normal: a tail well past the median


def test_synthetic_sources_are_deterministic_per_seed():
    assert list(SyntheticText(num_documents=5, seed=2)) == list(SyntheticText(num_documents=5, seed=2))
    assert list(SyntheticText(num_documents=5, seed=2)) != list(SyntheticText(num_documents=5, seed=3))
    for row in ArithmeticSFT(num_examples=50, operators="+-*"):
        assert str(eval(row["prompt"][:-1])) == row["response"]


# --- collation ----------------------------------------------------------------------------------


def _example(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + n)
    return {"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])}


@pytest.mark.parametrize(
    ("collator", "expected_len"),
    [(PaddingCollator(), 5), (PaddingCollator(pad_to_multiple_of=4), 8), (PaddingCollator(static_length=True), 12)],
)
def test_padding_collator_pads_right_with_mask_and_ignored_labels(collator, expected_len):
    collator.bind(pad_id=99, seq_len=12)
    examples = [_example(3), _example(5, 10)]
    batch = collator(examples)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, expected_len)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == e["input_ids"].tolist()
        assert batch["labels"][row, :n].tolist() == e["labels"].tolist()
        assert (batch["input_ids"][row, n:] == 99).all() and (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (expected_len - n)


# --- sources on local files ---------------------------------------------------------------------


def test_local_files_read_jsonl_parquet_and_txt(tmp_path):
    texts = ["first document", "second one", "third"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    parquet_dir = tmp_path / "pq"
    parquet_dir.mkdir()
    import datasets

    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(parquet_dir / "b.parquet"))
    assert [r["text"] for r in LocalFiles(str(tmp_path / "a.jsonl"), text_field="body")] == texts
    assert [r["text"] for r in LocalFiles(str(parquet_dir))] == texts
    assert [r["text"] for r in LocalFiles(str(tmp_path / "c.txt"), max_rows=2)] == texts[:2]


def test_local_files_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"source\.init_args\.path.*no such file"):
        LocalFiles(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"source\.init_args\.path.*no rows"):
        LocalFiles(str(tmp_path / "empty.jsonl"))
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "hi"}) + "\n")
    with pytest.raises(ConfigError, match=r"text_field.*'text'"):
        list(LocalFiles(str(tmp_path / "x.jsonl")))


@pytest.mark.parametrize(("key", "value"), [("seq_len", 0), ("batch_size", -1)])
def test_datamodule_rejects_nonpositive_sizes(key, value):
    with pytest.raises(ConfigError, match=rf"data\.init_args\.{key}={value}"):
        LMDataModule(SyntheticText(num_documents=4), **{key: value})


# --- sharding and resume ------------------------------------------------------------------------


def _datamodule(**kwargs) -> LMDataModule:
    kwargs = {"source": SyntheticText(num_documents=60, seed=4), "seq_len": 16, "batch_size": 4, **kwargs}
    dm = LMDataModule(**kwargs)
    dm.setup("fit")
    return dm


def _rows(batch: dict[str, torch.Tensor]) -> set[tuple[int, ...]]:
    return {tuple(r) for r in batch["input_ids"].tolist()}


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_of_micro_batch_two_see_one_process_batch_of_four(shuffle):
    single = _datamodule(batch_size=4, shuffle=shuffle)
    single.trainer = _fake_trainer(1, 0)
    ranks = []
    for rank in range(2):
        dm = _datamodule(batch_size=2, shuffle=shuffle)
        dm.trainer = _fake_trainer(2, rank)
        ranks.append(list(dm.train_dataloader()))
    steps = list(single.train_dataloader())
    assert len(steps) == len(ranks[0]) == len(ranks[1]) >= 5
    for step, (b0, b1) in enumerate(zip(*ranks)):
        assert _rows(b0) | _rows(b1) == _rows(steps[step]) and not _rows(b0) & _rows(b1)
    if not shuffle:  # rank r reads items r, r+W, r+2W, ...
        items = single.train_set.examples
        assert ranks[1][0]["input_ids"].tolist() == [items[1]["input_ids"].tolist(), items[3]["input_ids"].tolist()]


def test_epochs_reshuffle_deterministically_per_seed():
    def first_batch(seed: int, epoch: int) -> list[list[int]]:
        loader = _datamodule(seed=seed).train_dataloader()
        loader.sampler.set_epoch(epoch)
        return next(iter(loader))["input_ids"].tolist()

    assert first_batch(0, 0) == first_batch(0, 0)
    assert first_batch(0, 0) != first_batch(0, 1) and first_batch(0, 0) != first_batch(1, 0)


def test_resume_skips_exactly_the_consumed_batches_without_loading_them():
    reference = [b["input_ids"] for b in _datamodule().train_dataloader()]
    dm = _datamodule()
    dm.trainer = _fake_trainer(1, 0, epoch=0)
    for batch in list(dm.train_dataloader())[:3]:
        dm.on_before_batch_transfer(batch, 0)
    dm.trainer.training = False  # validation batches are not training progress
    dm.on_before_batch_transfer(batch, 0)
    state = dm.state_dict()
    assert state == {
        "epoch": 0,
        "items_consumed": 12,
        "global_batch": 4,
        "data_parallel_size": 1,
        "tokenizer": "byte",
        "seed": 0,
        "format": "pretrain",
    }

    resumed = _datamodule()
    resumed.load_state_dict(state)
    loaded: list[int] = []

    class CountingList(list):
        def __getitem__(self, i):
            loaded.append(i)
            return super().__getitem__(i)

    resumed.train_set.examples = CountingList(resumed.train_set.examples)
    after = [b["input_ids"] for b in resumed.train_dataloader()]
    assert len(after) == len(reference) - 3
    assert all(torch.equal(a, r) for a, r in zip(after, reference[3:]))
    assert len(loaded) == len(after) * 4  # nothing skipped was read
    # the skip applies once: the next epoch starts from its beginning
    assert len(list(resumed.train_dataloader())) == len(reference)


@pytest.mark.parametrize("collator", [None, PackingCollator(max_tokens=32)], ids=["padded", "packed"])
def test_a_position_saved_on_two_ranks_continues_on_one_with_the_same_items(collator):
    """Two ranks of batch 2 stop after 3 micro-batches; one process of batch 4 continues with exactly the
    items the two ranks would have read next (per step, as a set), and a batch that changes the global
    batch is refused naming the batch size that keeps it. Seen failing with the position saved per rank
    (items of one rank, as the old ``batches_consumed`` counted: 6 items saved for the 12 consumed)."""
    ranks = [_datamodule(batch_size=2, collator=collator) for _ in range(2)]
    batches = []
    for rank, dm in enumerate(ranks):
        dm.trainer = _fake_trainer(2, rank)
        batches.append(list(dm.train_dataloader()))
        for batch in batches[rank][:3]:
            dm.on_before_batch_transfer(batch, 0)
    state = ranks[0].state_dict()
    assert (state["items_consumed"], state["global_batch"]) == (12, 4)

    one = _datamodule(batch_size=4, collator=collator)
    one.load_state_dict(state)
    continued = [_rows(b) for b in one.train_dataloader()]
    two_ranks = [_rows(b0) | _rows(b1) for b0, b1 in zip(batches[0][3:], batches[1][3:])]
    assert continued == two_ranks and continued

    with pytest.raises(ConfigError, match=r"data\.init_args\.batch_size=2: use 4 to keep the checkpoint's global"):
        _datamodule(batch_size=2, collator=collator).load_state_dict(state)


def test_a_position_saved_per_rank_before_it_was_global_resumes_on_its_own_layout():
    """A checkpoint written before the position was global (``batches_consumed``: one rank's micro-batches)
    continues where it stopped on the layout that saved it."""
    reference = [b["input_ids"] for b in _datamodule().train_dataloader()]
    resumed = _datamodule()
    resumed.load_state_dict({"epoch": 0, "batches_consumed": 3, "tokenizer": "byte", "seed": 0, "format": "pretrain"})
    after = [b["input_ids"] for b in resumed.train_dataloader()]
    assert len(after) == len(reference) - 3 and all(torch.equal(a, r) for a, r in zip(after, reference[3:]))


def test_resume_rejects_a_different_tokenizer(tmp_path):
    dm = _datamodule(tokenizer=_tiny_hf_tokenizer(tmp_path / "tok"), source=SyntheticText(num_documents=400))
    with pytest.raises(ConfigError, match="trained with 'byte'"):
        dm.load_state_dict({"epoch": 0, "items_consumed": 4, "global_batch": 4, "tokenizer": "byte", "seed": 0})


class _BatchRecorder(pl.LightningModule):
    """Trains one parameter and records every training batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return self.weight * batch["input_ids"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(tmp_path, max_steps: int, ckpt_path: str | None = None) -> list[torch.Tensor]:
    module = _BatchRecorder()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=_datamodule(batch_size=2, val_examples=4), ckpt_path=ckpt_path)
    return module.seen


def test_lightning_resume_mid_epoch_continues_with_the_next_batch(tmp_path):
    uninterrupted = _fit(tmp_path / "a", max_steps=7)
    _fit(tmp_path / "b", max_steps=3)
    (checkpoint,) = (tmp_path / "b").glob("*.ckpt")
    assert torch.load(checkpoint, weights_only=False)["LMDataModule"]["items_consumed"] == 6
    resumed = _fit(tmp_path / "c", max_steps=7, ckpt_path=str(checkpoint))
    assert len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[3:]))
