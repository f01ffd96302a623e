"""The ``lit-ablate`` command.

``fit``/``validate``/``test`` are a ``LightningCLI``: model, data, strategy and callbacks from
YAML (``class_path``/``init_args``), every key overridable (``--trainer.max_steps 20``). The CLI
always adds a ``RunRecorder`` (configured under ``recorder:``) so every run leaves a run record.
``ablate``, ``report``, ``estimate`` and ``generate`` are plain commands dispatched here.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from collections.abc import Callable

import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_ablate.callbacks.run_recorder import RunRecorder

# command -> "module:function" taking argv (without the command) and returning an exit code.
COMMANDS: dict[str, str] = {
    "ablate": "lit_ablate.ablation.commands:ablate_main",
    "report": "lit_ablate.ablation.commands:report_main",
    "estimate": "lit_ablate.estimate:estimate_main",
    "generate": "lit_ablate.generate:generate_main",
}


class LitAblateCLI(LightningCLI):
    """LightningCLI with lit-ablate's defaults: any LightningModule/DataModule by class_path,
    a run record for every run, and the resolved config handed to it."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(RunRecorder, "recorder")

    def after_instantiate_classes(self) -> None:
        self._dump_config()
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunRecorder):
                callback.resolved_config = self.config_dump


def resolve_fit_config(args: list[str]) -> dict:
    """The resolved config that ``lit-ablate fit <args>`` would run, without running anything."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        LitAblateCLI(args=["fit", *args, "--print_config"])
    return yaml.safe_load(out.getvalue())


def _command(spec: str) -> Callable[[list[str]], int]:
    module, function = spec.split(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in COMMANDS:
        sys.exit(_command(COMMANDS[args[0]])(args[1:]))
    LitAblateCLI(args=argv)


if __name__ == "__main__":
    main()
