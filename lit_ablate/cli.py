"""The ``lit-ablate`` command: dispatches to ``fit``/``validate``/``test`` (``LitAblateCLI``) and to the
plain commands of ``lit_ablate.commands`` (``COMMANDS``); ``lit-ablate --help`` lists them all.

No parser accepts an abbreviated option (``--trainer.max_step`` is an error, not ``max_steps``).

Exit status, the same for every command: 0 done; ``EXIT_USAGE`` (2) a usage or config error, refused
in one line on stderr before the run (or, for what only a rank can see, as the run starts: then
rank 0 alone prints it); ``EXIT_FAILURE`` (1) a failure during a run (its traceback), or a study with
a failed run or check (docs/studies.md, "Exit codes"). ``ablate`` also returns 130 when interrupted
(it resumes).

``--help`` and ``--version`` import neither torch, Lightning nor jsonargparse (seconds at start-up): the
command table has no imports, and the commands' modules load only once a command runs.

Like ``python -m``, the command puts the working directory first on ``sys.path``, so a class of the
user's own code in the directory they run from is found by its dotted path
(``--trainer.callbacks+=examples.custom_metric.GradNormMonitor`` from the repository root). A console
script's ``sys.path`` starts with its own ``bin/`` folder instead, which finds nothing of theirs.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from lit_ablate import __version__
from lit_ablate.command_table import COMMANDS, SUMMARIES
from lit_ablate.errors import ConfigError, quoted_refusal
from lit_ablate.parse_errors import concise_error, missing_config
from lit_ablate.process_exit import exit_without_finalization
from lit_ablate.subnormals import flush_subnormals

FIT_CONFIG_COMMANDS = ("fit", "validate", "test", "estimate")
"""The commands whose ``--config`` is a run config, a path that ``_config_file_refusal`` checks first."""
EXIT_USAGE = 2
"""A usage or config error: nothing ran (or the run stopped as it started), one line on stderr."""
EXIT_FAILURE = 1
"""A failure during a run: Python's own status for an uncaught exception, with its traceback."""


def _command(spec: str) -> Callable[[list[str]], int]:
    module, function = spec.split(":")
    return getattr(importlib.import_module(module), function)


def _top_level_parser() -> argparse.ArgumentParser:
    """``lit-ablate --help`` (every command, one line each) and ``--version``."""
    parser = argparse.ArgumentParser(
        prog="lit-ablate",
        description="Ablation studies of LLM training techniques on PyTorch Lightning.",
        epilog="`lit-ablate COMMAND --help` lists a command's options. Exit status: 0 done, 2 a usage or "
        "config error (one line naming the key), 1 a failure during a run.",
        allow_abbrev=False,
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
    if refusal := _config_file_refusal(args):
        _refuse(f"lit-ablate {args[0]}" if args[0] in COMMANDS else "lit-ablate", refusal)
    _import_from_working_directory()
    # Only now the heavy imports (torch, Lightning, jsonargparse): --help and --version never need them.
    from jsonargparse import ArgumentError

    if args and args[0] in COMMANDS:
        try:
            sys.exit(_command(COMMANDS[args[0]])(args[1:]))
        except ArgumentError as err:
            _refuse(f"lit-ablate {args[0]}", concise_error(str(err)))
        except ConfigError as err:
            _refuse(f"lit-ablate {args[0]}", str(err))
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lit_ablate.fit_cli import LitAblateCLI

    if argv is None:  # this process's own command line: it trains, and nothing computed yet
        flush_subnormals()
    try:
        cli = LitAblateCLI(args=argv)
    except ArgumentError as err:
        _refuse("lit-ablate", concise_error(str(err)))
    except MisconfigurationException as err:  # Lightning's own "this trainer setting cannot work"
        _refuse("lit-ablate", " ".join(str(err).split()))
    except ValueError as err:  # jsonargparse wraps errors raised while instantiating classes
        cause = _config_error_in(err)
        # A class inside a Union (a strategy under ``trainer.strategy``) that refused its arguments reaches
        # here as jsonargparse's list of the alternatives it tried, with the refusal's text among them.
        line = cause if cause is not None else quoted_refusal(str(err))
        if line is None:
            raise
        _refuse("lit-ablate", str(line))
    if argv is None and cli.left_process_group:  # this process's own run, done: see lit_ablate.process_exit
        exit_without_finalization(0)


def _refuse(command: str, message: str) -> NoReturn:
    """Print ``message`` once (rank 0 of a run whose ranks all refuse alike) and exit with ``EXIT_USAGE``.
    The rank is Lightning's (``rank_zero_only``) once Lightning is imported; a refusal made before the
    imports reads it from the launcher's environment as Lightning does, without importing it."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    rank = getattr(rank_zero.rank_zero_only, "rank", 0) if rank_zero else _launcher_rank()
    if rank == 0:
        print(f"{command}: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _launcher_rank() -> int:
    """This process's rank as torchrun, Lightning's launcher or SLURM set it (0 when none did), read in
    Lightning's order: ``LOCAL_RANK`` before ``SLURM_PROCID``, which a SLURM shell sets without ranks."""
    return next(
        (
            int(os.environ[key])
            for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
            if os.environ.get(key) is not None
        ),
        0,
    )


def _config_file_refusal(args: list[str]) -> str | None:
    """The line for a run config (``fit``, ``validate``, ``test``, ``estimate``) given by a path that
    names no file, or that holds a study (jsonargparse would blame its first key, ``axes`` or
    ``variants``, as an option ``fit`` does not take), found before the ~8 s of imports that parsing
    needs. A value that may be a config written inline (``{...}``, ``key: value``) is left to the parser."""
    if args[0] not in FIT_CONFIG_COMMANDS:
        return None
    values = [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    values += [after for before, after in itertools.pairwise(args) if before == "--config"]
    for value in values:
        if any(c in value for c in "{:\n"):
            continue
        if not os.path.exists(value):
            return missing_config(f"File does not exist: {os.path.abspath(value)!r}")
        if _is_study_file(value):
            return (
                f"--config={value!r}: a study file (base with variants or axes), not a run config; "
                f"run it with lit-ablate ablate --config {value}"
            )
    return None


def _is_study_file(path: str) -> bool:
    import yaml

    try:
        with open(path) as f:
            content = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # the parser's own words for these
        return False
    return isinstance(content, dict) and "base" in content and ("variants" in content or "axes" in content)


def _import_from_working_directory() -> None:
    """The working directory first on ``sys.path``, as ``python -m`` has it (see the module docstring)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def _config_error_in(error: BaseException | None) -> ConfigError | None:
    while error is not None and not isinstance(error, ConfigError):
        error = error.__cause__ or error.__context__
    return error


if __name__ == "__main__":
    main()
