"""The ``lit-ablate`` command.

``fit``/``validate``/``test`` are a ``LightningCLI``: model, data, strategy and callbacks from
YAML (``class_path``/``init_args``), every key overridable (``--trainer.max_steps 20``). The CLI
always adds a ``RunRecorder`` (configured under ``recorder:``) so every run leaves a run record.
``ablate``, ``report``, ``estimate``, ``peak``, ``generate`` and ``export`` are plain commands dispatched
here; ``lit-ablate --help`` lists them all (``SUMMARIES``). No parser accepts an abbreviated option
(``--trainer.max_step`` is an error, not ``max_steps``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import yaml
from jsonargparse import ArgumentError
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger

from lit_ablate import __version__
from lit_ablate.callbacks.run_recorder import RunRecorder
from lit_ablate.checkpoint_model import check_same_model, checkpoint_model_section
from lit_ablate.compatibility import check_cpu_ranks
from lit_ablate.console import console_trainer_args, silence_noise
from lit_ablate.errors import ConfigError
from lit_ablate.preflight import check_ckpt_path, check_run_config

# command -> "module:function" taking argv (without the command) and returning an exit code.
COMMANDS: dict[str, str] = {
    "ablate": "lit_ablate.ablation.commands:ablate_main",
    "report": "lit_ablate.ablation.commands:report_main",
    "estimate": "lit_ablate.estimate:estimate_main",
    "peak": "lit_ablate.matmul_ceiling:peak_main",
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
    "peak": "this device's spec peak and measured matmul ceiling",
    "export": "a checkpoint as a Hugging Face folder (weights, tokenizer)",
}


SEED_LOGGER = "lightning.fabric.utilities.seed"
"""The logger of Lightning's ``seed_everything`` (its "Seed set to N" line)."""
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

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, printing and writing only what informs (``lit_ablate.console``).

        Where the config leaves ``trainer.logger`` unset: fit logs CSV under ``default_root_dir``
        (Lightning's own choice without TensorBoard, made explicit so it does not warn about it);
        validate and test print their metrics and write nothing (no logger, no saved config), so
        evaluating a checkpoint adds no ``lightning_logs/version_N`` beside the run that wrote it.
        """
        silence_noise()
        trainer_args = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        configured = trainer_args.get("callbacks") or []
        callbacks = list(configured) if isinstance(configured, list) else [configured]
        if self.subcommand in ("validate", "test"):
            self.save_config_callback = None
            if trainer_args.get("logger") is None:
                kwargs["logger"] = False
        elif trainer_args.get("logger") is None:
            kwargs["logger"] = CSVLogger(save_dir=trainer_args.get("default_root_dir") or os.getcwd())
        kwargs.update(console_trainer_args(trainer_args, callbacks))
        return super().instantiate_trainer(**kwargs)

    def _set_seed(self) -> None:
        """Lightning's seeding without its "Seed set to N" log line: the seed is in the config and the
        run record, and a config refused right after (``before_instantiate_classes``, a model shape)
        would otherwise print two lines instead of its one."""
        seed_log = logging.getLogger(SEED_LOGGER)
        level = seed_log.level
        seed_log.setLevel(logging.WARNING)
        try:
            super()._set_seed()
        finally:
            seed_log.setLevel(level)

    def _parse_ckpt_path(self) -> None:
        """Replaces LightningCLI's, which lets a checkpoint's hyper-parameters override the config's
        model section without a word: here a checkpoint (file or sharded folder) whose model differs
        from the config's is refused naming every differing key, and a matching one leaves the config
        as parsed (``lit_ablate.checkpoint_model``)."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        check_ckpt_path(ckpt_path)
        section = checkpoint_model_section(ckpt_path) if ckpt_path else None
        if section is not None:
            theirs = self.parser.parse_object({subcommand: {"model": section}}, self.config)[subcommand].model
            check_same_model(self.config[subcommand].model.as_dict(), theirs.as_dict(), ckpt_path)

    def before_instantiate_classes(self) -> None:
        """Refuse a run this machine cannot start (far more CPU ranks than cores) before any rank launches,
        and values or paths that cannot run (``check_run_config``) before anything is built."""
        if self.subcommand is not None:
            check_cpu_ranks(self.config[self.subcommand].trainer)
            check_run_config(self.subcommand, self.config[self.subcommand])

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
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":\s*(.*)$')
_CLASS_PATH = re.compile(r"^Problem with given class_path '([^']+)':$")
_EXPECTED = re.compile(r"^Expected an? (.+?)(?:\. Got value: (.*))?$")
_GIVEN_VALUE = re.compile(r"^\s*Given value: (?!NestedArg\()(.*)$", re.MULTILINE)
_NOT_ACCEPTED = re.compile(r"^Option '([^']+)' is not accepted$")
_UNRECOGNIZED = re.compile(r"^unrecognized arguments: --([^\s=]+)(?:[=\s]+(\S*))?")
_IMPORT_PROBLEMS = ("has no attribute", "No module named", "cannot import", "Import failed")
_NOT_A_PROBLEM = ("Does not validate against", "Subtypes:", "Errors:", "Given value", "Expected a path but")
"""jsonargparse's bookkeeping lines, and the "maybe it is a config file path" alternative it always tries."""


def concise_error(message: str) -> str:
    """One line from a jsonargparse error: our ConfigError text if it is inside, else the full
    dotted key (``data.init_args.batch_size``) and its problem in words: the expected type and the
    value, an unknown key with the closest known one, or a class_path that does not import.
    jsonargparse nests one block per class and lists every Union alternative it tried; the
    problem is the first line under the innermost key (of the class_path alternative, if any)."""
    if found := _CONFIG_ERROR_LINE.search(message):
        return found.group(1).strip()
    if message.startswith("Problems parsing config"):
        where = re.sub(r'\s*in "<unicode string>",', "", " ".join(message.split(":", 1)[1].split()))
        return f"--config: not valid YAML ({where}); fix the file"
    keys, class_path, problem = _innermost_problem(message)
    if problem is None:
        return " ".join(line.strip() for line in message.strip().splitlines()[:3])
    key = ".".join(keys)
    if expected := _EXPECTED.match(problem):
        value = expected.group(2) if expected.group(2) is not None else (given := _GIVEN_VALUE.search(message)) and given.group(1)
        return f"{key}{f'={value!r}' if value else ''}: expected {_type_name(expected.group(1))}"
    if unknown := _NOT_ACCEPTED.match(problem):
        return f"{key}.{unknown.group(1)}: {_unknown_key_fix(unknown.group(1), class_path)}"
    if unknown := _UNRECOGNIZED.match(problem):
        name = ".".join([*keys, unknown.group(1)])
        value = f"={unknown.group(2)!r}" if unknown.group(2) else ""
        return f"{name}{value}: {_unknown_key_fix(unknown.group(1), class_path)}"
    if class_path and any(p in problem for p in _IMPORT_PROBLEMS):
        return f"{'.'.join(keys[:-1])}: cannot import {class_path!r} ({problem}); check the class_path"
    if keys == ["config"] and "does not exist" in problem:
        return f"--config: {problem}; give the path of a YAML config"
    return f"{key}: {problem}" if key else problem


def _innermost_problem(message: str) -> tuple[list[str], str | None, str | None]:
    """``(dotted key parts, innermost class_path, first problem line)`` of a jsonargparse error."""
    keys: list[str] = []
    class_path = None
    has_class_path = "Problem with given class_path" in message
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if not line:
            continue
        if parser_key := _PARSER_KEY.match(line):
            keys.append(parser_key.group(1))
            if parser_key.group(2):
                return keys, class_path, parser_key.group(2)
        elif problem := _CLASS_PATH.match(line):
            class_path = problem.group(1)
            keys.append("init_args")
        elif not (line.startswith(_NOT_A_PROBLEM) or (has_class_path and class_path is None)):
            return keys, class_path, line
    return keys, class_path, None


def _type_name(expected: str) -> str:
    """jsonargparse's type text in a user's words: ``<class 'int'>`` -> ``int``, a Literal -> its choices."""
    expected = re.sub(r"<class '(?:builtins\.)?([\w.]+)'>", r"\1", expected)
    if literal := re.fullmatch(r"typing\.Literal\[(.*)\]", expected):
        return f"one of [{literal.group(1)}]"
    return expected


def _unknown_key_fix(name: str, class_path: str | None) -> str:
    """What to do about an unknown key: the closest parameter of its class, or where keys are listed."""
    import difflib
    import inspect

    known: list[str] = []
    class_path = class_path or ("lightning.pytorch.Trainer" if name.startswith("trainer.") else None)
    if class_path:
        module, _, attribute = class_path.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError, ValueError, TypeError):  # only a hint: the key is unknown anyway
            known = [p for p in inspect.signature(getattr(importlib.import_module(module), attribute)).parameters
                     if p not in ("self", "args", "kwargs")]
    close = difflib.get_close_matches(name.split(".")[-1], known, n=1)
    where = f"not a parameter of {class_path}" if class_path else "unknown key"
    if close:
        return f"{where}; did you mean {close[0]}?"
    return f"{where}; its parameters are {known}" if known else f"{where}; `lit-ablate fit --help` lists the keys"


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
        try:
            sys.exit(_command(COMMANDS[args[0]])(args[1:]))
        except ArgumentError as err:
            sys.exit(f"lit-ablate {args[0]}: error: {concise_error(str(err))}")
        except ConfigError as err:
            sys.exit(f"lit-ablate {args[0]}: error: {err}")
    try:
        LitAblateCLI(args=argv)
    except ArgumentError as err:
        sys.exit(f"lit-ablate: error: {concise_error(str(err))}")
    except MisconfigurationException as err:  # Lightning's own "this trainer setting cannot work"
        sys.exit(f"lit-ablate: error: {' '.join(str(err).split())}")
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
