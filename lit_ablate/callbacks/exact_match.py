"""``ExactMatchEvaluator``: does an SFT run learn its task? Exact-match accuracy of greedy answers.

A falling loss says the model fits its training tokens; whether it can *answer* is measured by
generating. Each held-out prompt is decoded greedily, and its answer counts only when every
token, the closing end-of-sequence included, equals the reference (``12+7=`` -> ``19<eos>``;
``190`` or ``19`` followed by more text is wrong). The accuracy is recorded as the ``exact_match``
series, so it lands in ``run.json`` (``summary.exact_match``: the value after the last step)
and in the study report's accuracy column.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import groupby

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics.classification import MulticlassExactMatch

from lit_ablate.callbacks.step_monitor import StepMonitor
from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.data.formats import Example, build_examples
from lit_ablate.data.sources import DataSource
from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX
from lit_ablate.strategies.interface import interface_of

_KEY = "trainer.callbacks[ExactMatchEvaluator].init_args"
SERIES = "exact_match"

PromptAnswer = tuple[list[int], list[int]]
"""Token ids of a prompt and of the reference answer that should follow it (``eos`` included)."""


def prompt_and_answer(example: Example) -> PromptAnswer:
    """Split a tokenised SFT example at its first labelled position.

    The prompt is every token up to that position; the answer is the run of labelled tokens that
    follows (labels are already shifted: ``labels[t]`` is token ``t + 1``). For a chat, that is the
    first assistant turn with its ``eos``.
    """
    labels = example["labels"].tolist()
    first = next(t for t, label in enumerate(labels) if label != IGNORE_INDEX)
    end = first
    while end < len(labels) and labels[end] != IGNORE_INDEX:
        end += 1
    return example["input_ids"][: first + 1].tolist(), labels[first:end]


def greedy_continuation(
    logits_of: Callable[..., Tensor], prompts: Tensor, new_tokens: int, multiple: int = 1
) -> Tensor:
    """``[B, new_tokens]``: the argmax next token, appended ``new_tokens`` times.

    Under a strategy whose forward takes only rows of a ``multiple`` of tokens (sequence parallelism's
    tp), each forward's rows are padded on the right to it and the next token is read at the last real
    position: attention is causal, so what follows a position does not change its logits. The positions
    are given, as sequence parallelism needs (each rank's slice would number its own from 0).

    Written here rather than calling transformers' ``generate``: that calls the bare HF model
    (under FSDP2 the root's embedding and head stay sharded unless the call goes through the
    wrapped module's registered ``logits``) and stops when every row has ended, so ranks whose
    rows end at different times would run different numbers of sharded forwards and hang. Each
    step re-reads the whole sequence (no KV cache), so any attention backend that trains runs it.
    """
    ids = prompts
    for _ in range(new_tokens):
        length = ids.shape[1]
        padded = torch.nn.functional.pad(ids, (0, -length % multiple))
        positions = torch.arange(padded.shape[1], device=ids.device).expand_as(padded)  # a slice numbers its own
        ids = torch.cat([ids, logits_of(padded, position_ids=positions)[:, length - 1].argmax(-1, keepdim=True)], 1)
    return ids[:, prompts.shape[1] :]


def exact_match(
    logits_of: Callable[..., Tensor],
    pairs: Sequence[PromptAnswer],
    batch_size: int,
    num_classes: int,
    device: torch.device | str = "cpu",
    multiple: int = 1,
) -> float:
    """Fraction of ``pairs`` whose greedy continuation starts with the whole reference answer.

    Prompts are batched by length (no padding, so no attention mask is needed), in an order that
    depends only on ``pairs``: every rank given the same pairs runs the same forwards.
    """
    # Each rank evaluates every pair, so a sum over ranks would count each prompt world_size times.
    metric = MulticlassExactMatch(num_classes=num_classes, ignore_index=IGNORE_INDEX, sync_on_compute=False)
    by_length = sorted(pairs, key=lambda pair: len(pair[0]))
    for _, group in groupby(by_length, key=lambda pair: len(pair[0])):
        group = list(group)
        for start in range(0, len(group), batch_size):
            batch = group[start : start + batch_size]
            new_tokens = max(len(answer) for _, answer in batch)
            prompts = torch.tensor([prompt for prompt, _ in batch], device=device)
            targets = torch.tensor([answer + [IGNORE_INDEX] * (new_tokens - len(answer)) for _, answer in batch])
            metric.update(greedy_continuation(logits_of, prompts, new_tokens, multiple).cpu(), targets)
    return float(metric.compute())


class ExactMatchEvaluator(StepMonitor):
    """Exact-match accuracy of greedy answers on held-out SFT prompts, at each validation run of
    ``fit`` (``trainer.val_check_interval``: an accuracy curve) and after the last step.

    Choose it for SFT runs whose answers are checkable (``ArithmeticSFT``, your own prompt/response
    data): the report can then compare what variants *learned*, not only their loss.

    Every rank generates for every prompt, in the same batches: a sharded model (FSDP2, HSDP,
    expert parallel) gathers its parameters inside each forward, so all ranks must take part in
    each one. Context parallelism attends with its ring only inside steps, so here every rank runs
    whole sequences. FSDP1 (flattened parameters) cannot run the model outside its training
    forward and is refused at the start of fit.

    Args:
        examples: rows to evaluate on (``prompt``/``response`` or chat ``messages``), tokenised with
            the data module's tokenizer and ``seq_len``; default: the data module's held-out split
            (``data.init_args.val_examples``), which needs ``format: sft``.
        max_examples: evaluate on at most this many (the first ones); null = all.
        batch_size: prompts per forward.
    """

    def __init__(
        self, examples: DataSource | None = None, max_examples: int | None = None, batch_size: int = 64
    ) -> None:
        super().__init__(warmup_steps=0, log_to_logger=False)  # logs each evaluation itself, when it happens
        if max_examples is not None and max_examples <= 0:
            raise ConfigError(f"{_KEY}.max_examples", max_examples, "use a positive number, or null for all")
        if batch_size <= 0:
            raise ConfigError(f"{_KEY}.batch_size", batch_size, "use a positive number of prompts per forward")
        self.examples, self.max_examples, self.batch_size = examples, max_examples, batch_size
        self.pairs: list[PromptAnswer] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _check_can_generate(trainer, pl_module)
        self.pairs = [prompt_and_answer(e) for e in self._examples(trainer)][: self.max_examples]

    def _examples(self, trainer: Trainer) -> Sequence[Example]:
        data = trainer.datamodule
        tokenizer = getattr(data, "tokenizer", None)
        if tokenizer is None:
            raise ConfigError(
                "data",
                type(data).__name__,
                "ExactMatchEvaluator needs a data module with a tokenizer: use LMDataModule",
            )
        if self.examples is not None:
            return build_examples(self.examples, tokenizer, "sft", data.seq_len, data.overlong)
        if data.format != "sft":
            raise ConfigError(
                "data.init_args.format",
                data.format,
                f"ExactMatchEvaluator scores answers to prompts: use format sft, or give {_KEY}.examples",
            )
        if not data.val_set:
            raise ConfigError(
                "data.init_args.val_examples",
                data.val_examples,
                f"hold out examples to evaluate on (e.g. 128), or give {_KEY}.examples",
            )
        return data.val_set.examples

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Inside a validation run, whose time the step clock leaves out of the training steps."""
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.evaluate(trainer, pl_module, trainer.global_step)

    def finalize(self, trainer: Trainer) -> None:
        if trainer.global_step not in self.series.get(SERIES, {}):
            self.evaluate(trainer, trainer.lightning_module, trainer.global_step)

    def evaluate(self, trainer: Trainer, pl_module: LightningModule, step: int) -> float:
        """Score the model as it is now; record, log and return the accuracy (on every rank)."""
        was_training = pl_module.training
        pl_module.eval()
        try:
            model = pl_module.model
            multiple = interface_of(trainer.strategy).sequence_multiple  # sequence parallelism's tp
            value = exact_match(
                model.logits, self.pairs, self.batch_size, model.lm.config.vocab_size, pl_module.device, multiple
            )
        finally:
            pl_module.train(was_training)
        self.record(SERIES, step, value)
        for logger in trainer.loggers:
            logger.log_metrics({f"{self.log_prefix}/{SERIES}": value}, step)
        rank_zero_info(f"{self.summary_line()} (step {step})")
        return value

    def summary_line(self) -> str:
        values = self.series.get(SERIES, {})
        if not values:
            return f"{self.log_prefix}: not evaluated"
        value = values[max(values)]
        return (
            f"{self.log_prefix}: exact_match={value:.4g} ({round(value * len(self.pairs))}/{len(self.pairs)} prompts)"
        )


def _check_can_generate(trainer: Trainer, pl_module: LightningModule) -> None:
    """The module must expose ``CausalLMWithLoss.logits`` as ``model.logits``; FSDP1 keeps
    parameters in flattened shards that only its own wrapped forward gathers."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not callable(getattr(getattr(pl_module, "model", None), "logits", None)):
        raise ConfigError(
            "model",
            type(pl_module).__name__,
            "ExactMatchEvaluator generates with a causal LM module: use lit_ablate.modules.CausalLM",
        )
    if any(isinstance(m, FullyShardedDataParallel) for m in trainer.strategy.model.modules()):
        raise ConfigError(
            TRAINER_STRATEGY_KEY,
            type(trainer.strategy).__name__,
            "ExactMatchEvaluator cannot generate under FSDP1; use FSDP2Strategy, DDP or one process",
        )
