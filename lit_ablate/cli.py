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
import re
import sys
import warnings
from collections.abc import Callable

import yaml
from jsonargparse import ArgumentError
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_ablate.callbacks.run_recorder import RunRecorder
from lit_ablate.compatibility import check_cpu_ranks
from lit_ablate.errors import ConfigError

# command -> "module:function" taking argv (without the command) and returning an exit code.
COMMANDS: dict[str, str] = {
    "ablate": "lit_ablate.ablation.commands:ablate_main",
    "report": "lit_ablate.ablation.commands:report_main",
    "estimate": "lit_ablate.estimate:estimate_main",
    "generate": "lit_ablate.generate:generate_main",
    "export": "lit_ablate.strategies.export:export_main",
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
            # Raise instead of exiting so main() can print one line instead of a usage dump.
            parser_kwargs={"exit_on_error": False, **{c: {"exit_on_error": False} for c in ("fit", "validate", "test")}},
            args=args,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(RunRecorder, "recorder")

    def before_instantiate_classes(self) -> None:
        """Refuse a run this machine cannot start (far more CPU ranks than cores) before any rank launches."""
        if self.subcommand is not None:
            check_cpu_ranks(self.config[self.subcommand].trainer)

    def after_instantiate_classes(self) -> None:
        self._dump_config()
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunRecorder):
                callback.resolved_config = self.config_dump


def resolve_fit_config(args: list[str]) -> dict:
    """The resolved config that ``lit-ablate fit <args>`` would run, without running anything."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args.*sys.argv.*")  # intentional: args are explicit
        LitAblateCLI(args=["fit", *args, "--print_config"])
    return yaml.safe_load(out.getvalue())


def _command(spec: str) -> Callable[[list[str]], int]:
    module, function = spec.split(":")
    return getattr(importlib.import_module(module), function)


_CONFIG_ERROR_LINE = re.compile(r"^\s*-?\s*([\w.\[\]/-]+=.*?: .+)$", re.MULTILINE)
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_PROBLEM = re.compile(r"Problem with given class_path '([^']+)':\s*\n\s*(.+)")


def concise_error(message: str) -> str:
    """One line from a jsonargparse error: our ConfigError text if it is inside, else the key
    and the first concrete problem (jsonargparse lists every Union alternative it tried)."""
    if found := _CONFIG_ERROR_LINE.search(message):
        return found.group(1).strip()
    key = _PARSER_KEY.search(message)
    problem = _PROBLEM.search(message)
    if key and problem:
        return f"{key.group(1)}: cannot import {problem.group(1)!r} ({problem.group(2).strip()}); check the class_path"
    return " ".join(line.strip() for line in message.strip().splitlines()[:3])


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in COMMANDS:
        sys.exit(_command(COMMANDS[args[0]])(args[1:]))
    try:
        LitAblateCLI(args=argv)
    except ArgumentError as err:
        sys.exit(f"lit-ablate: error: {concise_error(str(err))}")
    except ValueError as err:  # jsonargparse wraps errors raised while instantiating classes
        cause = _config_error_in(err)
        if cause is None:
            raise
        sys.exit(f"lit-ablate: error: {cause}")


def _config_error_in(error: BaseException | None) -> ConfigError | None:
    while error is not None and not isinstance(error, ConfigError):
        error = error.__cause__ or error.__context__
    return error


if __name__ == "__main__":
    main()
