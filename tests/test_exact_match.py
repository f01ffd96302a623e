"""``ExactMatchEvaluator``: greedy answers to held-out SFT prompts, scored whole (eos included)."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_ablate.ablation.report import write_report
from lit_ablate.callbacks import ExactMatchEvaluator, RunRecorder
from lit_ablate.callbacks.exact_match import exact_match, greedy_continuation, prompt_and_answer
from lit_ablate.data import ArithmeticSFT, LMDataModule
from lit_ablate.data.formats import build_examples
from lit_ablate.data.tokenizers import ByteTokenizer
from lit_ablate.errors import ConfigError
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import loss_backend
from lit_ablate.modules import CausalLM
from lit_ablate.record import summarize_steps, write_record

TOK = ByteTokenizer()
STEPS = 30


def _pairs(rows):
    return [prompt_and_answer(e) for e in build_examples(rows, TOK, "sft", seq_len=64, overlong="reject")]


def _answering(answers: dict[tuple[int, ...], list[int]]):
    """Logits of a fake model that continues each known prompt with ``answers[prompt]``, then pads."""

    def logits_of(ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*ids.shape, TOK.vocab_size)
        for row, seq in enumerate(ids.tolist()):
            prompt = next(tuple(seq[:k]) for k in range(len(seq), 0, -1) if tuple(seq[:k]) in answers)
            answer, done = answers[prompt], len(seq) - len(prompt)
            out[row, -1, answer[done] if done < len(answer) else TOK.pad_id] = 1.0
        return out

    return logits_of


def test_prompt_and_answer_split_an_sft_example_where_its_labels_start():
    rows = [
        {"prompt": "12+7=", "response": "19"},
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "no"},
            ]
        },
    ]
    (prompt, answer), (chat_prompt, chat_answer) = _pairs(rows)
    assert prompt == [TOK.bos_id, *TOK.encode("12+7=")] and answer == [*TOK.encode("19"), TOK.eos_id]
    assert TOK.decode(chat_prompt) == "<user>\nhi\n<assistant>\n"  # the first assistant turn only
    assert chat_answer == [*TOK.encode("yo"), TOK.eos_id]


def test_exact_match_counts_an_answer_only_when_every_token_and_the_eos_match():
    """Prompts of several lengths (several batches, one smaller than batch_size); a fake model that
    is right on some prompts and wrong in each way that matters on the others."""
    pairs = _pairs(ArithmeticSFT(num_examples=40, max_operand=20, operators="+", seed=1))
    assert len({len(p) for p, _ in pairs}) > 1
    right = {tuple(p): a for p, a in pairs}
    digit = TOK.encode("7")[0]
    wrong = {
        "wrong digit": lambda a: [TOK.encode("1")[0] if a[0] != TOK.encode("1")[0] else digit, *a[1:]],
        "no eos (keeps going)": lambda a: [*a[:-1], digit, TOK.eos_id],
        "stops one token early": lambda a: [*a[:-2], TOK.eos_id],
    }
    assert exact_match(_answering(right), pairs, batch_size=8, num_classes=TOK.vocab_size) == 1.0
    for name, spoil in wrong.items():
        spoiled = {p: spoil(a) for p, a in right.items()}
        assert exact_match(_answering(spoiled), pairs, batch_size=8, num_classes=TOK.vocab_size) == 0.0, name
    # Every third prompt answered wrongly: the score is exactly the fraction answered right.
    mixed = {p: (wrong["wrong digit"](a) if i % 3 == 0 else a) for i, (p, a) in enumerate(right.items())}
    expected = sum(1 for i in range(len(pairs)) if i % 3) / len(pairs)
    assert exact_match(_answering(mixed), pairs, batch_size=8, num_classes=TOK.vocab_size) == pytest.approx(expected)


def test_greedy_continuation_equals_transformers_greedy_generate():
    """The evaluator's decoding loop (whole sequence each step, no cache) against HF ``generate``
    (KV cache). Catches e.g. reading the logits of the first position instead of the last."""
    torch.manual_seed(0)
    lm = ModelFactory(preset="tiny-qwen3").build().eval()
    model = CausalLMWithLoss(lm, loss_backend("torch"))
    prompts = torch.randint(0, 256, (3, 6))
    ours = greedy_continuation(model.logits, prompts, new_tokens=5)
    with torch.no_grad():
        theirs = lm.generate(prompts, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=TOK.pad_id)
    assert theirs.shape == (3, 11)
    assert torch.equal(ours, theirs[:, 6:])


def test_greedy_continuation_over_rows_padded_to_a_multiple_equals_the_plain_one():
    """Sequence parallelism takes only rows of a multiple of tp tokens: each forward's rows are padded on
    the right and the next token read at the last real position, which causal attention leaves as it was.
    Seen failing with the token read at the padded row's end (another continuation) and without the
    positions given (sequence parallelism's ranks numbered their slices from 0: a shape error under TP)."""
    torch.manual_seed(0)
    model = CausalLMWithLoss(ModelFactory(preset="tiny-qwen3").build().eval(), loss_backend("torch"))
    prompts = torch.randint(0, 256, (3, 6))
    plain = greedy_continuation(model.logits, prompts, new_tokens=5)
    assert torch.equal(greedy_continuation(model.logits, prompts, new_tokens=5, multiple=4), plain)


def _fit_with_evaluator(tmp_path, steps: int, data: LMDataModule, evaluator: ExactMatchEvaluator):
    L.seed_everything(0)
    module = CausalLM(ModelFactory(preset="tiny-qwen3"), learning_rate=1e-2, warmup_steps=0)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[evaluator, RunRecorder(path=str(tmp_path / "run.json"))],
    )
    trainer.fit(module, datamodule=data)
    return json.loads((tmp_path / "run.json").read_text()), module


def _generate_accuracy(module: CausalLM, rows) -> float:
    """Independent reference: transformers' ``generate`` (KV cache, stops at eos) on each prompt
    text, the decoded answer compared as a string; it must have ended with eos."""
    correct = 0
    for row in rows:
        ids = torch.tensor([[TOK.bos_id, *TOK.encode(row["prompt"])]])
        with torch.no_grad():
            out = module.model.lm.generate(
                ids, max_new_tokens=6, do_sample=False, eos_token_id=TOK.eos_id, pad_token_id=TOK.pad_id
            )[0, ids.shape[1] :].tolist()
        correct += TOK.eos_id in out and TOK.decode(out[: out.index(TOK.eos_id)]) == row["response"]
    return correct / len(rows)


def test_evaluator_records_the_accuracy_that_generate_gives_in_the_run_record(tmp_path):
    """Scored on given rows (all problems, trained ones included, so a short run gets some right)."""
    source = ArithmeticSFT(num_examples=36, max_operand=5, operators="+", seed=0)
    data = LMDataModule(source, format="sft", seq_len=16, batch_size=8)
    evaluator = ExactMatchEvaluator(examples=source, batch_size=5)
    record, module = _fit_with_evaluator(tmp_path, STEPS, data, evaluator)
    reference = _generate_accuracy(module, list(source))
    assert 0 < reference < 1  # long enough to answer some prompts, not all: a real check
    assert record["summary"]["exact_match"] == pytest.approx(reference)
    last = record["steps"][-1]
    assert last["step"] == STEPS and last["exact_match"] == pytest.approx(reference)
    assert evaluator.summary_line().endswith(f"({round(reference * 36)}/36 prompts)")


def test_evaluator_refuses_data_it_cannot_score_before_training(tmp_path):
    def fit(data):
        trainer = L.Trainer(
            max_steps=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ExactMatchEvaluator()],
        )
        trainer.fit(CausalLM(ModelFactory(preset="tiny-qwen3")), datamodule=data)

    with pytest.raises(ConfigError, match=r"data.init_args.format='pretrain'"):
        fit(LMDataModule(ArithmeticSFT(num_examples=40), format="pretrain", seq_len=8, val_examples=4))
    with pytest.raises(ConfigError, match=r"data.init_args.val_examples=0"):
        fit(LMDataModule(ArithmeticSFT(num_examples=40), format="sft", seq_len=16))
    with pytest.raises(ConfigError, match="max_examples"):
        ExactMatchEvaluator(max_examples=0)


def test_arithmetic_held_out_problems_are_never_trained_on():
    """Held-out accuracy must measure arithmetic, not recall: drawing problems with replacement
    (as ArithmeticSFT once did) puts copies of held-out problems in the training split."""
    data = LMDataModule(
        ArithmeticSFT(num_examples=400, max_operand=19, operators="+"), format="sft", seq_len=16, val_examples=100
    )
    data.setup("fit")
    prompts = [
        {TOK.decode(prompt_and_answer(e)[0]) for e in split.examples} for split in (data.train_set, data.val_set)
    ]
    assert len(prompts[0]) == 300 and len(prompts[1]) == 100 and not prompts[0] & prompts[1]
    with pytest.raises(ConfigError, match=r"num_examples=401.*only 400 distinct problems"):
        ArithmeticSFT(num_examples=401, max_operand=19, operators="++")


def test_padded_operands_are_the_same_problems_at_fixed_digit_places():
    plain = list(ArithmeticSFT(num_examples=50, max_operand=99, operators="+-"))
    padded = list(ArithmeticSFT(num_examples=50, max_operand=99, operators="+-", pad_operands=True))
    assert [r["response"] for r in padded] == [r["response"] for r in plain]
    for p, q in zip(padded, plain):
        a, op, b = p["prompt"][:2], p["prompt"][2], p["prompt"][3:5]
        assert p["prompt"] == f"{a}{op}{b}=" and a.isdigit() and b.isdigit()
        assert q["prompt"] == f"{int(a)}{op}{int(b)}="
    assert any(r["prompt"] != q["prompt"] for r, q in zip(padded, plain))  # some operand below 10 was padded


def test_record_summary_keeps_the_accuracy_after_the_last_evaluation():
    """The model a run ends with, not a median or the best of its evaluations."""
    steps = [
        {"step": 1, "loss": 2.0, "exact_match": 0.5},
        {"step": 2, "loss": 1.5, "exact_match": 0.9},
        {"step": 3, "loss": 1.2},
        {"step": 4, "loss": 1.0, "exact_match": 0.25},
    ]
    assert summarize_steps(steps, warmup_steps=1)["exact_match"] == 0.25
    assert summarize_steps(steps[2:3], warmup_steps=0)["exact_match"] is None  # never evaluated


def _study_with_accuracy(tmp_path, accuracies: dict[str, list[float]] | None):
    """Two-variant study records; with ``accuracies``, each seed's last step carries ``exact_match``."""
    from tests.test_ablation_report import make_record

    plan = {
        "name": "acc",
        "baseline": "a",
        "variables": ["x"],
        "axes": {"x": [1, 2]},
        "seeds": [0, 1],
        "steps": 3,
        "warmup_steps": 1,
        "expect_equal_loss": None,
        "variants": [{"name": n, "axis_values": {"x": i}} for i, n in enumerate("ab")],
    }
    for name in "ab":
        for seed in (0, 1):
            record = make_record(name, seed, speed=100.0, peak_mib=100, losses=[3.0, 2.0, 1.0])
            if accuracies:
                record["steps"][-1]["exact_match"] = accuracies[name][seed]
                record["summary"] = {**summarize_steps(record["steps"], 1), "status": "ok"}
            write_record(tmp_path / "runs" / name / f"seed{seed}" / "run.json", record)
    (tmp_path / "study.json").write_text(json.dumps(plan))
    return (tmp_path / "report.md").read_text() if write_report(tmp_path) else None


def test_report_has_an_accuracy_column_only_when_runs_were_evaluated(tmp_path):
    text = _study_with_accuracy(tmp_path / "with", {"a": [0.5, 0.75], "b": [0.25, 0.25]})
    table = text[text.index("| variant") :].split("\n\n")[0]  # the variants table (other tables follow)
    header, _, row_a, row_b = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    column = header.index("exact match")
    assert row_a[column] == "62.5% [50.0%–75.0%]" and row_b[column] == "25.0%"
    summary = json.loads((tmp_path / "with" / "report.json").read_text())
    assert summary["variants"][0]["exact_match"] == {"median": 0.625, "min": 0.5, "max": 0.75, "n": 2}
    assert "exact match" not in _study_with_accuracy(tmp_path / "without", None)


def _evaluate_under_mesh_strategies(rank: int, world_size: int, root: str) -> dict:
    """FSDP2: fit with the evaluator, return its value and the full weights (rank 0). FSDP1: refused."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lit_ablate.data import PaddingCollator
    from lit_ablate.strategies import ContextParallelStrategy, FSDP1Strategy, FSDP2Strategy, TensorParallelStrategy

    source = ArithmeticSFT(num_examples=36, max_operand=5, operators="+", seed=0)

    def fit(strategy, batch_size: int = 4, collator=None) -> tuple[CausalLM, ExactMatchEvaluator]:
        L.seed_everything(0, verbose=False)
        module = CausalLM(ModelFactory(preset="tiny-qwen3"), learning_rate=1e-2, warmup_steps=0)
        evaluator = ExactMatchEvaluator(examples=source, batch_size=5)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy,
            max_steps=STEPS,
            callbacks=[evaluator],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=root,
        )
        data = LMDataModule(source, format="sft", seq_len=16, batch_size=batch_size, collator=collator)
        trainer.fit(module, datamodule=data)
        return module, evaluator

    results = {}
    # 8 examples per step either way: 4 per data-parallel rank, or all 8 shared by the cp ranks
    even = PaddingCollator(pad_to_multiple_of=world_size)  # sequence parallelism's rows: a multiple of tp
    for name, strategy, batch, collator in (
        ("fsdp2", FSDP2Strategy(), 4, None),
        ("cp", ContextParallelStrategy(cp=world_size), 8, None),
        ("tp_sp", TensorParallelStrategy(tp=world_size, sequence_parallel=True), 8, even),
    ):
        module, evaluator = fit(strategy, batch, collator)
        state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        results[name] = {"exact_match": evaluator.series["exact_match"][STEPS], "state": state if rank == 0 else None}
    try:
        fit(FSDP1Strategy())
        results["refused"] = None
    except ConfigError as err:
        results["refused"] = str(err)
    return results


@pytest.mark.slow
def test_under_fsdp2_context_and_tensor_parallel_every_rank_records_the_accuracy_of_the_gathered_model(tmp_path):
    """Both ranks generate for every prompt (each forward all-gathers the shards; under context
    parallelism with the configured attention on whole sequences, outside steps; under sequence
    parallelism over rows padded to a multiple of tp), so both record the value that the full weights give
    in one process; FSDP1 is refused with a clear line. Seen failing under TP with sequence parallelism
    before the evaluator padded its rows (a collective of mismatched sizes at the end of training)."""
    from tests.distributed import run_ranks

    results = run_ranks(_evaluate_under_mesh_strategies, 2, str(tmp_path), init_process_group=False, timeout_s=300)
    for name in ("fsdp2", "cp", "tp_sp"):
        module = CausalLM(ModelFactory(preset="tiny-qwen3"))
        module.configure_model()
        module.model.load_state_dict(results[0][name]["state"])
        rows = list(ArithmeticSFT(num_examples=36, max_operand=5, operators="+"))
        reference = _generate_accuracy(module.eval(), rows)
        assert 0 < reference < 1, name
        assert [r[name]["exact_match"] for r in results] == [pytest.approx(reference)] * 2, name
    for r in results:
        assert r["refused"].startswith("trainer.strategy='FSDP1Strategy'") and "FSDP2Strategy" in r["refused"]


@pytest.mark.slow
def test_the_sft_example_recipe_learns_addition_it_never_saw(tmp_path):
    """configs/sft_tiny.yaml's model, optimiser settings and data format, scaled down to one-digit
    addition so it runs in ~30 s: 70 problems trained, 30 held out. A guess that ignores the
    operands is right at most 10% of the time (the commonest sum, 9, is 10 of the 100 problems);
    measured at 300 steps: 63-73% over seeds 0-2. (The full example: docs/fit.md, SFT.)"""
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "sft_tiny.yaml").read_text())
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    source = {**data["source"]["init_args"], "num_examples": 100, "max_operand": 9}
    L.seed_everything(0)
    module = CausalLM(
        ModelFactory(**model["model"]), learning_rate=model["learning_rate"], warmup_steps=model["warmup_steps"]
    )
    evaluator = ExactMatchEvaluator()
    trainer = L.Trainer(
        max_steps=300,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=config["trainer"]["gradient_clip_val"],
        callbacks=[evaluator, RunRecorder(path=str(tmp_path / "run.json"))],
    )
    trainer.fit(
        module,
        datamodule=LMDataModule(
            ArithmeticSFT(**source), format="sft", seq_len=data["seq_len"], batch_size=16, val_examples=30
        ),
    )
    accuracy = json.loads((tmp_path / "run.json").read_text())["summary"]["exact_match"]
    assert accuracy >= 0.4, f"{accuracy:.0%} of 30 held-out one-digit sums: not clearly above the 10% of a guess"
