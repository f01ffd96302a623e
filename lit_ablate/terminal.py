"""What a run prints: Lightning's progress bar and model summary without the lines that never inform.

Each fix sits where the noise comes from in Lightning (2.6), not in a filter over stdout:

- ``v_num: 0.000`` in the progress bar is the logger's version (``ProgressBar.get_metrics``);
  the run's folder already says it.
- ``Epoch 0/-2``: with ``max_steps`` and no ``max_epochs``, Lightning sets ``max_epochs = -1``
  and ``RichProgressBar`` prints ``max_epochs - 1``.
- ``Total FLOPs: 0`` and a FLOPs column of zeros: Lightning counts FLOPs only by running the
  module's ``example_input_array``, which lit-ablate's modules do not set (their FLOPs are
  analytic and per batch, reported by ``MFUMonitor``).
- ``💡 Tip: ... litlogger``: an advertisement Lightning logs on every ``Trainer`` through its
  rank-zero logger, with no flag to turn it off; a logging filter drops exactly those records.
- ``GPU available: False, used: False`` and ``TPU available: False, using: 0 TPU cores``: on a
  machine without that device they say nothing, and they came before any error raised during data
  set-up, turning its one line into three. The same filter drops only the ``available: False``
  lines; a machine with a GPU or TPU still prints its line.
- ``Found 60 module(s) in eval mode at the start of training``: Lightning cannot tell a module
  frozen on purpose (DPO's reference model, kept in eval mode so dropout stays off) from one left
  in eval mode by mistake. ``FrozenEvalModules`` drops it for a run whose eval-mode modules are all
  frozen models; a module with a trainable parameter, or a bare layer such as dropout, in eval mode
  still warns.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count
from torch import nn

from lit_ablate.simulated_rank import NOT_SIMULATED, current_simulation

TIP_PREFIX = "💡 Tip"
ABSENT_DEVICE_LINE = re.compile(r"^(GPU|TPU|HPU) available: False\b")
RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class QuietProgressBar(RichProgressBar):
    """Lightning's rich progress bar without the logger version and without a negative epoch count,
    redrawn ``refresh_rate`` times a second, its metrics gathered no more often than it redraws.
    Lightning's default of 100 wakes the redraw thread 100 times a second: about 1.6 ms of CPU per
    step on the quickstart, 1.5 % of its step; at 4, about 0.25-0.5 ms; at 2, the default here, about
    half that (benchmarks/README.md, overhead).

    It shows what the first callback with a ``progress_bar_items(trainer)`` method gives (lit-ablate's
    ``StepMonitor``: the loss of the newest step the step clock has read), beside Lightning's
    ``prog_bar`` metrics: a value Lightning holds on the device would be read into Python, making the
    host wait for the device, at every step."""

    def __init__(self, refresh_rate: int = 2, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self._metrics_due = 0.0
        self._final_line = False

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        source = next((c for c in trainer.callbacks if hasattr(c, "progress_bar_items")), None)
        items = {**(source.progress_bar_items(trainer, final=self._final_line) if source is not None else {}), **items}
        if current_simulation() is not None:  # its loss is no model's: the record holds none either
            items = {k: v for k, v in items.items() if k.rsplit("/", 1)[-1] not in NOT_SIMULATED}
        return items

    def _update_metrics(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning's only hook for when metrics are gathered is this private method.
        now = time.monotonic()
        if self.is_enabled and now >= self._metrics_due:
            self._metrics_due = now + 1 / self.refresh_rate
            super()._update_metrics(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._metrics_due, self._final_line = 0.0, True  # the epoch's last line shows its last step
        super().on_train_epoch_end(trainer, pl_module)
        self._final_line = False

    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning's only hook for this text is this private method.
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        return f"Epoch {current_epoch}".ljust(len(self.validation_description))


class ParameterSummary(RichModelSummary):
    """Lightning's model summary (layers, parameter counts, size, train/eval modes) without FLOPs."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(
                name, justify="right" if name == "Params" else "left", style="dim" if name == " " else None
            )
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        console.print(
            f"Parameters: {get_human_readable_count(total_parameters)} "
            f"({get_human_readable_count(trainable_parameters)} trainable), {get_formatted_model_size(model_size)} MB; "
            f"modules: {total_training_modes['train']} train, {total_training_modes['eval']} eval",
            highlight=False,
        )


def console_trainer_args(trainer_args: Mapping[str, Any], callbacks: list[Callback]) -> dict[str, Any]:
    """``Trainer`` arguments that put ``QuietProgressBar`` and ``ParameterSummary`` where Lightning
    would add its own default bar and summary (none among ``callbacks``, not turned off, not
    ``barebones``). With our summary, Lightning's is turned off: it would log that it skips its own."""
    if trainer_args.get("barebones"):
        return {"callbacks": [*callbacks, FrozenEvalModules()]}
    extra: list[Callback] = []
    args: dict[str, Any] = {}
    if trainer_args.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
        extra.append(QuietProgressBar())
    if trainer_args.get("enable_model_summary") is not False and not any(
        isinstance(c, ModelSummary) for c in callbacks
    ):
        extra.append(ParameterSummary())
        args["enable_model_summary"] = False
    return {"callbacks": callbacks + extra + [FrozenEvalModules()], **args}


EVAL_MODE_WARNING = r"Found \d+ module\(s\) in eval mode at the start of training"


def frozen_on_purpose(module: nn.Module) -> bool:
    """Whether every module in eval mode under ``module`` belongs to a frozen model: the top-most
    eval-mode modules (whose parent trains) each hold parameters, none of them trainable."""
    tops: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if child.training:
                visit(child)
            else:
                tops.append(child)

    visit(module)
    return all(
        any(True for _ in top.parameters()) and not any(p.requires_grad for p in top.parameters()) for top in tops
    )


class FrozenEvalModules(Callback):
    """Drops Lightning's "module(s) in eval mode" warning for this run when those modules are frozen
    models (``frozen_on_purpose``): installed when the fit starts, after the model is built, removed
    once training starts (the warning comes in between), so no other run or module loses it."""

    def __init__(self) -> None:
        self._filter: tuple | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if frozen_on_purpose(pl_module):
            warnings.filterwarnings("ignore", message=EVAL_MODE_WARNING)
            self._filter = warnings.filters[0]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove()

    def _remove(self) -> None:
        if self._filter is not None and self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
        self._filter = None


DISTRIBUTED_LOGGER = "lightning.fabric.utilities.distributed"
DISTRIBUTED_LINES = ("Initializing distributed: ", f"{'-' * 100}\ndistributed_backend=")
"""Lightning's per-rank "Initializing distributed" line and its rank-zero process-group banner: the
world size and backend are in the run record, and a 4-rank fit printed six lines of them."""


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (
            message.startswith(TIP_PREFIX) or ABSENT_DEVICE_LINE.match(message) or message.startswith(DISTRIBUTED_LINES)
        )


def silence_noise() -> None:
    """Drop Lightning's "💡 Tip" advertisements (litlogger, litmodels), its lines about devices the
    machine does not have and its process-group banner (``DISTRIBUTED_LINES``); idempotent."""
    for name in (RANK_ZERO_LOGGER, DISTRIBUTED_LOGGER):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
