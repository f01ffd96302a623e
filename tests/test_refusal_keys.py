"""Every key a refusal names exists: the key it refuses, and every config key its fix tells the user to set.

The keys are collected from the sources, not from a list: the first argument of every ``ConfigError(...)``,
``Refusal(...)`` and ``PairedKey(...)`` in ``lit_ablate/`` (a string, or an f-string or sum of the module's
constants; what a variable fills in stands for any segment), and every dotted config key written in a fix's
text. Each is resolved against the schema the parser reads: a run config's keys through the classes'
signatures as jsonargparse reads them (``init_args`` of a class chosen by ``class_path``: any lit-ablate class
of that kind), a study file's through its keys and launch settings, a command's options through its parser,
an environment variable through the sources that read it. A fix once named ``data pad_to_multiple_of``
(sequence parallelism on padded SFT batches), which no config has.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from jsonargparse._parameter_resolvers import get_signature_parameters
from lightning.pytorch import LightningDataModule, LightningModule, Trainer

from lit_ablate.ablation.slurm_settings import SlurmSettings
from lit_ablate.ablation.spec import STUDY_KEYS, VARIANT_KEYS, GradientAgreement, Launch, LossAgreement
from lit_ablate.callbacks.run_recorder import RunRecorder

PACKAGE = Path(__file__).resolve().parents[1] / "lit_ablate"
KEY_CALLS = {"ConfigError", "Refusal", "PairedKey"}
CONFIG_ROOTS = ("trainer", "model", "data", "recorder")
CONFIG_KEY_IN_TEXT = re.compile(r"(?<![\w.])((?:trainer|model|data|recorder)\.[A-Za-z_][\w.]*[A-Za-z_\d])")
"""A dotted config key written in a fix's prose (``model.init_args.model.adapter``), trailing dot excluded."""
ANY = "*"
ROOT: dict[str, object] = {
    "trainer": Trainer,
    "model": LightningModule,
    "data": LightningDataModule,
    "recorder": RunRecorder,
    "ckpt_path": None,
    "seed_everything": None,
    "config": None,
    "optimizer": None,
    "lr_scheduler": None,
    "simulate": None,
    "simulate_rank": None,
}
"""The fit subcommand's top-level keys: a class whose arguments are keys below it, or a leaf."""
SUBCLASS_PACKAGES = ("lit_ablate.modules", "lit_ablate.data", "lit_ablate.strategies", "lit_ablate.callbacks")
"""Where the classes a ``class_path`` may choose are exported."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _rendered(node: ast.AST, module: types.ModuleType) -> str | None:
    """The string ``node`` builds, its module's constants filled in and anything else as ``*``; None when
    it is not built from strings."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return "".join(_rendered(part, module) or ANY for part in node.values)
    if isinstance(node, ast.FormattedValue):
        return _rendered(node.value, module)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _rendered(node.left, module), _rendered(node.right, module)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Name):
        value = getattr(module, node.id, None)
        return value if isinstance(value, str) and node.id.isupper() else ANY
    return ANY


def _text_of(node: ast.AST) -> str:
    """The literal prose of a fix (its constants), for the keys it names."""
    return " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def refusal_keys() -> Iterator[tuple[str, str]]:
    """``(where, key)`` for every key a refusal names in the sources."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = importlib.import_module(_module_name(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name not in KEY_CALLS or not node.args:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            named = [node.args[1]] if name == "PairedKey" and len(node.args) > 1 else []
            for argument in (node.args[0], *named):
                key = _rendered(argument, module)
                if key and key != ANY:
                    yield where, key
            for argument in node.args[1:]:
                for key in CONFIG_KEY_IN_TEXT.findall(_text_of(argument)):
                    yield where, key


@functools.cache
def _exported_subclasses(base: type) -> list[type]:
    """The classes of ``SUBCLASS_PACKAGES`` (any of their modules: a config names a class by its module's
    path too) that a ``class_path`` choosing a ``base`` may name."""
    found = []
    for package in SUBCLASS_PACKAGES:
        root = importlib.import_module(package)
        modules = [
            root,
            *(importlib.import_module(info.name) for info in pkgutil.walk_packages(root.__path__, f"{package}.")),
        ]
        for module in modules:
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, base) and value not in found:
                    found.append(value)
    return found or [base]


def _classes_in(annotation: object) -> list[type]:
    """The classes a parameter's type names (through ``X | None``, ``Union``, ``list[X]``)."""
    if isinstance(annotation, type):
        return [annotation]
    return [cls for arg in typing.get_args(annotation) for cls in _classes_in(arg)]


def _parameters(cls: type) -> dict[str, object]:
    if dataclasses.is_dataclass(cls):
        return {f.name: typing.get_type_hints(cls).get(f.name) for f in dataclasses.fields(cls)}
    return {p.name: p.annotation for p in get_signature_parameters(cls)}


def _is_mapping(annotation: object) -> bool:
    """A ``dict`` (or ``Any``) argument, possibly optional: any key below it is the user's."""
    options = (
        [annotation, *typing.get_args(annotation)]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else [annotation]
    )
    return any(a in (dict, typing.Any) or typing.get_origin(a) is dict for a in options)


def _is_list(annotation: object) -> bool:
    options = [annotation, *typing.get_args(annotation)]
    return any(typing.get_origin(a) is list for a in options)


def _resolves(segments: list[str], node: object) -> bool:
    """Whether ``segments`` name a key below ``node``: a class's arguments (a dataclass's fields directly;
    another class is chosen by ``class_path`` and takes its arguments under ``init_args``), anything under a
    mapping, nothing under a leaf. ``*`` matches any segment; ``[Name]`` is the list element of class ``Name``
    (``trainer.callbacks[MemoryMonitor].init_args.tracked_steps``)."""
    if not segments:
        return True
    if node is None:
        return False
    if _is_mapping(node):
        return True
    classes = [cls for cls in _classes_in(node) if cls.__module__ != "builtins" and cls is not type(None)]
    plain = [cls for cls in classes if dataclasses.is_dataclass(cls) or cls in (Trainer, RunRecorder)]
    head, rest = segments[0], segments[1:]
    if head.startswith("[") and _is_list(node):  # a list element, by its class's name
        named = [cls for base in classes for cls in _exported_subclasses(base) if cls.__name__ == head[1:-1]]
        return any(not rest or (rest[0] == "init_args" and _in_parameters(rest[1:], cls)) for cls in named)
    if head == ANY and _is_list(node):
        return any(_resolves(rest, base) for base in classes)
    for cls in plain:
        if head == ANY or _in_parameters(segments, cls):
            return True
    for base in (cls for cls in classes if cls not in plain):
        if head == "class_path" and not rest:
            return True
        if head in ("init_args", ANY) and any(_in_parameters(rest, cls) for cls in _exported_subclasses(base)):
            return True
    return False


def _in_parameters(segments: list[str], cls: type) -> bool:
    """Whether ``segments`` start with an argument of ``cls`` and name a key below it."""
    if not segments or segments[0] == ANY:
        return True
    parameters = _parameters(cls)
    return segments[0] in parameters and _resolves(segments[1:], parameters[segments[0]])


def _command_options() -> set[str]:
    """Every ``--option`` a command's parser declares (``generate``'s are its function's arguments), and the
    fit CLI's own."""
    from lit_ablate.commands.generate import generate

    found = {
        "--config",
        "--ckpt_path",
        "--print_config",
        *(f"--{name}" for name in inspect.signature(generate).parameters),
    }
    for path in (PACKAGE / "commands").glob("*.py"):
        found |= set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', path.read_text()))
    return found


def _environment_variables() -> set[str]:
    return {name for path in PACKAGE.rglob("*.py") for name in re.findall(r'"(LIT_ABLATE_[A-Z_]+)"', path.read_text())}


def _study_key_exists(segments: list[str]) -> bool:
    head, rest = segments[0], segments[1:]
    if head == "launch" or (head == "variants" and rest[1:2] == ["launch"]):
        launch = rest if head == "launch" else rest[2:]
        fields = {f.name for f in dataclasses.fields(Launch)}
        return not launch or (
            launch[0] in (ANY, *fields)
            and (
                launch[0] != "slurm"
                or len(launch) < 2
                or launch[1] in (ANY, *(f.name for f in dataclasses.fields(SlurmSettings)))
            )
        )
    if head == "variants":
        return not rest or rest[0] == ANY or rest[1:2] in ([], [ANY], *([k] for k in VARIANT_KEYS))
    if head in ("expect_equal_loss", "expect_equal_gradients"):
        check = LossAgreement if head == "expect_equal_loss" else GradientAgreement
        return not rest or rest[0] in (ANY, *(f.name for f in dataclasses.fields(check)))
    return head in (*STUDY_KEYS, "study", "overrides", "axes")


def _segments(key: str) -> list[str]:
    """``trainer.callbacks[MemoryMonitor].init_args.x`` -> ``[trainer, callbacks, [MemoryMonitor], init_args,
    x]``; a list index (``variants[0]``, ``.0.``) is ``*``."""
    key = re.sub(r"\[(\d+|\*)\]", ".*", key)
    key = re.sub(r"\[(\w+)\]", r".[\1]", key)
    return [ANY if part.isdigit() else part for part in key.split(".") if part]


def key_exists(key: str) -> bool:
    """Whether ``key`` names a run config key, a study key, a command's option or an environment variable (a
    key followed by where in it, ``data.init_args.source row 3``, by the key)."""
    key = key.split(" ")[0]
    if key.startswith("--"):
        return key.split("=")[0] in _command_options()
    if re.fullmatch(r"LIT_ABLATE_[A-Z_]+", key):
        return key in _environment_variables()
    segments = _segments(key)
    if segments[0] in ROOT:
        return _resolves(segments[1:], ROOT[segments[0]])
    return _study_key_exists(segments)


def _decidable(key: str) -> bool:
    """A key whose first segment the sources spell (not one a variable fills in, as ``f"{key}.cluster"``)."""
    return not key.startswith((ANY, f"--{ANY}"))


KEYS = sorted({(where, key) for where, key in refusal_keys() if _decidable(key)})


def test_the_sources_name_refusal_keys():
    """The walk finds what it must: the keys of the house's refusals (a walk that finds nothing passes)."""
    keys = {key for _, key in KEYS}
    assert len(KEYS) > 150
    assert {
        "trainer.strategy.init_args.ep",
        "model.init_args.model.fp8",
        "launch.slurm",
        "--ckpt_path",
        "data.init_args.collator.init_args.pad_to_multiple_of",
    } <= keys


@pytest.mark.parametrize(
    ("key", "exists"),
    [
        ("trainer.strategy.init_args.cp_layout", True),
        ("data.init_args.collator.init_args.pad_to_multiple_of", True),
        ("model.init_args.model.quantization.bits", True),
        ("model.init_args.model.config.num_key_value_heads", True),
        ("launch.slurm.partition", True),
        ("variants[2].launch.executor", True),
        ("--no-wait", True),
        ("trainer.callbacks[MemoryMonitor].init_args.tracked_steps", True),
        ("data.init_args.source row 3", True),
        ("trainer.callbacks[MemoryMonitor].init_args.tracked_step", False),
        ("MemoryMonitor.tracked_steps", False),
        ("data.pad_to_multiple_of", False),
        ("data.init_args.pad_to_multiple_of", False),
        ("trainer.strategy.init_args.cp_layuot", False),
        ("model.init_args.model.quantization.bitz", False),
        ("launch.slurm.partitions", False),
        ("--merged", False),
        ("LIT_ABLATE_NO_SUCH", False),
    ],
)
def test_the_schema_tells_a_key_from_a_typo(key, exists):
    assert key_exists(key) is exists


def test_every_key_a_refusal_names_exists():
    """Seen failing on the keys the house had: callbacks' options named ``MemoryMonitor.tracked_steps``,
    ``KernelProfile.<option>``, ``MFUMonitor.<option>``, ``trainer.callbacks.AdapterCheckpoint`` (now
    ``trainer.callbacks[MemoryMonitor].init_args.tracked_steps``, as ``ExactMatchEvaluator`` had them),
    ``num_nodes``, ``model attention_dropout``, ``activation_checkpointing``,
    ``data.init_args.num_workers/val_examples``; and with the sequence-parallel fix naming
    ``data.pad_to_multiple_of``, and a refusal keyed ``trainer.num_node``. A key a loop variable completes
    (``f"{STRATEGY_OPTIONS}.{name}"``) is checked up to the variable only."""
    missing = [f"{where}: {key}" for where, key in KEYS if not key_exists(key)]
    assert not missing, "refusals name keys that do not exist:\n" + "\n".join(missing)
