"""One line from a jsonargparse error: the dotted key, the value and what to do, never the parser's dump."""

from __future__ import annotations

import ast
import contextlib
import re

from lit_ablate.class_paths import import_class
from lit_ablate.errors import quoted_refusal

_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":\s*(.*)$')
_CLASS_PATH = re.compile(r"^Problem with given class_path '([^']+)':$")
_EXPECTED = re.compile(r"^Expected an? (.+?)(?:\. Got value: (.*))?$")
_GIVEN_VALUE = re.compile(r"^\s*Given value: (?!NestedArg\()(.*)$", re.MULTILINE)
_UNION_ALTERNATIVE = re.compile(r"^\s*- Expected an? (.+?)(?:\. Got value: .*)?$", re.MULTILINE)
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
    if refusal := quoted_refusal(message):
        return str(refusal)
    if message.startswith("Problems parsing config"):
        where = re.sub(r'\s*in "<unicode string>",', "", " ".join(message.split(":", 1)[1].split()))
        return f"--config: not valid YAML ({where}); fix the file"
    keys, class_path, problem = _innermost_problem(message)
    if problem is None:
        return " ".join(line.strip() for line in message.strip().splitlines()[:3])
    key = ".".join(keys)
    if expected := _EXPECTED.match(problem):
        value = (
            expected.group(2)
            if expected.group(2) is not None
            else (given := _GIVEN_VALUE.search(message)) and given.group(1)
        )
        return (
            f"{key}{f'={value!r}' if value else ''}: expected {_union_name(message) or _type_name(expected.group(1))}"
        )
    if unknown := _NOT_ACCEPTED.match(problem):
        return f"{key}.{unknown.group(1)}: {_unknown_key_fix(unknown.group(1), class_path)}"
    if unknown := _UNRECOGNIZED.match(problem):
        name = ".".join([*keys, unknown.group(1)])
        value = f"={unknown.group(2)!r}" if unknown.group(2) else ""
        return f"{name}{value}: {_unknown_key_fix(unknown.group(1), class_path)}"
    if class_path and any(p in problem for p in _IMPORT_PROBLEMS):
        return f"{'.'.join(keys[:-1])}: cannot import {class_path!r} ({problem}); check the class_path"
    if keys == ["config"] and "does not exist" in problem:
        return missing_config(problem)
    return f"{key}: {problem}" if key else problem


def missing_config(problem: str) -> str:
    """The line for a ``--config`` that names no file (jsonargparse's ``problem``, or the CLI's own check)."""
    return f"--config: {problem}; give the path of a YAML config"


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
            if not _written_flat(class_path):
                keys.append("init_args")
        elif not (line.startswith(_NOT_A_PROBLEM) or (has_class_path and class_path is None)):
            return keys, class_path, line
    return keys, class_path, None


def _written_flat(class_path: str) -> bool:
    """A dataclass (``Fp8Options``, ``AdapterOptions``): its keys sit right under its own key in a
    config (``model.init_args.model.fp8.recipe``), with no ``init_args`` level as a class_path has."""
    import dataclasses

    try:
        return dataclasses.is_dataclass(import_class(class_path))
    except ImportError:  # a class_path that does not import keeps the class_path layout
        return False


def _type_name(expected: str) -> str:
    """jsonargparse's type text in a user's words: ``<class 'int'>`` -> ``int``, a Literal -> its choices."""
    expected = re.sub(r"<class '(?:builtins\.)?([\w.]+)'>", r"\1", expected)
    if literal := re.fullmatch(r"typing\.Literal\[(.*)\]", expected):
        return f"one of [{literal.group(1)}]"
    return expected


def _union_name(message: str) -> str | None:
    """Every alternative of a Union of plain types that a value matched none of, in a user's words:
    ``Literal[64, 32] | Literal['bf16-mixed', ...] | None`` -> ``one of [64, 32, 'bf16-mixed', ...] or null``
    (None for a Union with a class among its alternatives: its own problem line says more)."""
    if "Union subtypes" not in message or "Problem with given class_path" in message:
        return None
    choices: list[object] = []
    others: list[str] = []
    for alternative in _UNION_ALTERNATIVE.findall(message):
        if literal := re.fullmatch(r"typing\.Literal\[(.*)\]", alternative):
            values = ast.literal_eval(f"[{literal.group(1)}]")
            choices += [v for v in values if str(v) not in {str(c) for c in choices}]  # 64 and '64' read alike
        else:
            name = _type_name(alternative)
            others.append("null" if name == "NoneType" else name)
    if not choices and len(others) < 2:
        return None
    named = ([f"one of {choices!r}"] if choices else []) + others
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"


def _unknown_key_fix(name: str, class_path: str | None) -> str:
    """What to do about an unknown key: the closest parameter of its class, or where keys are listed.

    The parameters are read as the parser reads them (jsonargparse's resolver): a class's ``**kwargs``
    handed on to its base class (``DPO``'s optimizer options, ``CausalLM``'s) count as its own."""
    import difflib

    from jsonargparse._parameter_resolvers import get_signature_parameters

    known: list[str] = []
    class_path = class_path or ("lightning.pytorch.Trainer" if name.startswith("trainer.") else None)
    if class_path:
        with contextlib.suppress(ImportError, TypeError, ValueError):  # only a hint: the key is unknown anyway
            known = [
                p.name
                for p in get_signature_parameters(import_class(class_path))
                if p.name not in ("self", "args", "kwargs")
            ]
    close = difflib.get_close_matches(name.split(".")[-1], known, n=1)
    where = f"not a parameter of {class_path}" if class_path else "unknown key"
    if close:
        return f"{where}; did you mean {close[0]}?"
    return f"{where}; its parameters are {known}" if known else f"{where}; `lit-ablate fit --help` lists the keys"
