"""The ``lit-ablate`` command.

``fit``/``validate``/``test`` are a ``LightningCLI``: model, data, strategy and callbacks from
YAML (``class_path``/``init_args``), every key overridable (``--trainer.max_steps 20``). The CLI
always adds a ``RunRecorder`` (configured under ``recorder:``) so every run leaves a run record.
``ablate``, ``report``, ``estimate``, ``generate`` and ``export`` are plain commands dispatched
here; ``lit-ablate --help`` lists them all (``SUMMARIES``). No parser accepts an abbreviated option
(``--trainer.max_step`` is an error, not ``max_steps``).
"""

from __future__ import annotations

import argparse
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

from lit_ablate import __version__
from lit_ablate.callbacks.run_recorder import RunRecorder
from lit_ablate.checkpoint_model import check_same_model, checkpoint_model_section
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
# Every command's one line, in the order ``lit-ablate --help`` lists them.
SUMMARIES: dict[str, str] = {
    "fit": "train from a YAML config (any key: --trainer.max_steps 20)",
    "validate": "held-out loss of a checkpoint (--ckpt_path)",
    "test": "held-out loss of a checkpoint, as test/loss (--ckpt_path)",
    "generate": "sample text from a fit checkpoint",
    "ablate": "run a study (variants x seeds, resumable), write its report",
    "report": "re-render a study's report from its run records",
    "estimate": "parameters and per-rank memory of a config, per sharding",
    "export": "a checkpoint as a Hugging Face folder (weights, tokenizer)",
}


PARSER_KWARGS = {"exit_on_error": False, "allow_abbrev": False}
"""Every parser raises instead of exiting (``main`` prints one line, not a usage dump) and takes
options only by their full name."""


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
            parser_kwargs={**PARSER_KWARGS,
                           **{c: {**PARSER_KWARGS, "description": SUMMARIES[c]} for c in self.subcommands()}},
            args=args,
            run=run,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test``; not ``predict``. Lightning's predict runs a
        ``predict_step`` over a prediction dataloader and returns its outputs in memory: for a causal
        LM that means a second, batch-shaped inference path (prompts as a data set, a decoding
        loop, a writer) beside ``generate``, which already turns a prompt into text with the run's
        tokenizer, and ``export``, which hands the model to Hugging Face tooling for batch
        inference. A command that only crashes (``Trainer.predict requires forward method``) or
        duplicates those is worse than none, so the CLI does not offer it."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(RunRecorder, "recorder")

    def _parse_ckpt_path(self) -> None:
        """Replaces LightningCLI's, which lets a checkpoint's hyper-parameters override the config's
        model section without a word: here a checkpoint (file or sharded folder) whose model differs
        from the config's is refused naming every differing key, and a matching one leaves the config
        as parsed (``lit_ablate.checkpoint_model``)."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        section = checkpoint_model_section(ckpt_path) if ckpt_path else None
        if section is not None:
            theirs = self.parser.parse_object({subcommand: {"model": section}}, self.config)[subcommand].model
            check_same_model(self.config[subcommand].model.as_dict(), theirs.as_dict(), ckpt_path)

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


def _top_level_parser() -> argparse.ArgumentParser:
    """``lit-ablate --help`` (every command, one line each) and ``--version``."""
    parser = argparse.ArgumentParser(
        prog="lit-ablate", description="Ablation studies of LLM training techniques on PyTorch Lightning.",
        epilog="`lit-ablate COMMAND --help` lists a command's options.", allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, summary in SUMMARIES.items():
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "--version"):
        parser = _top_level_parser()
        parser.parse_args(args[:1])  # prints the help or the version and exits
        parser.print_help(sys.stderr)
        sys.exit(2)
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
