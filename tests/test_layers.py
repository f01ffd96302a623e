"""The house keeps its layers (docs/architecture.md): every import points down, and no module imports itself back.

Layers, top to bottom (a module may import its own layer and the layers below it):

- ``cli``, ``commands/``: the ``lit-ablate`` commands;
- ``ablation/``: study spec, plan, runner, report;
- ``fit_cli``: the LightningCLI of ``fit``/``validate``/``test`` (studies resolve their configs through it);
- ``rules``, ``checkpoint_model``: every check of a run, in one registry, and a checkpoint against the config's model;
- ``modules/``: the LightningModules;
- ``callbacks/``: measurement (they read FLOPs and peaks from ``estimate/``);
- ``estimate/``: the analytic model (its memory model reads how strategies shard);
- ``run_config``: the typed view of a run config, what the rules, the estimator and the
  study planner read (it reads mesh sizes and options off the strategy classes);
- ``strategies/``;
- ``data/``;
- ``models/``;
- the ground floor: ``errors``, ``record``, ``terminal``, ``import_warnings``, ``config_keys``,
  ``path_checks``, ``parse_errors``, ``command_table``, ``class_paths``, ``mesh_sizes``, ``simulated_rank``, ``extras``,
  ``torch_versions``, ``machine_load``, ``machine_cache``, ``cpu_half_matmuls``, ``subnormals``, ``trackers``,
  ``process_exit``.

Imports under ``if TYPE_CHECKING:`` count like any other: an annotation that names a module above, or
one that imports this module back, is a dependency a reader follows all the same.
Seen failing on the circles and upward imports the house had (``ablation.plan`` -> ``cli``,
``models.fp8`` <-> ``models.fp8_grouped_experts``, ``callbacks.preference_metrics`` -> ``modules.dpo``),
and, once type-only imports counted, on ``strategies.interface`` naming ``modules.step_objective``
(an arrow back up, and a circle through ``step_objective``'s import of the interface).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "lit_ablate"
GROUND = (
    "errors",
    "record",
    "terminal",
    "import_warnings",
    "config_keys",
    "path_checks",
    "parse_errors",
    "command_table",
    "class_paths",
    "mesh_sizes",
    "simulated_rank",
    "extras",
    "torch_versions",
    "machine_load",
    "machine_cache",
    "cpu_half_matmuls",
    "subnormals",
    "trackers",
    "process_exit",
    "no_profiler",
)
LAYERS: list[tuple[str, ...]] = [  # bottom first
    tuple(f"lit_ablate.{name}" for name in GROUND),
    ("lit_ablate.models",),
    ("lit_ablate.data",),
    ("lit_ablate.strategies",),
    ("lit_ablate.run_config", "lit_ablate.strategy_choice", "lit_ablate.class_choice"),
    ("lit_ablate.estimate",),
    ("lit_ablate.callbacks",),
    ("lit_ablate.modules",),
    ("lit_ablate.rules", "lit_ablate.checkpoint_model"),
    ("lit_ablate.fit_cli",),
    ("lit_ablate.ablation",),
    ("lit_ablate.cli", "lit_ablate.commands"),
]
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    (
        "lit_ablate",
        "lit_ablate.models.losses.triton_interpreter",
    ): "the package's __init__ must opt Triton into its interpreter before anything imports triton, "
    "so it runs that one switch of the losses' interpreter module first",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    if module == "lit_ablate":
        return 0
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def imports_of(path: Path) -> set[str]:
    """Every ``lit_ablate`` module ``path`` imports, at the top, inside a function or under ``if
    TYPE_CHECKING:`` (a submodule named by ``from package import name`` counts as that submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lit_ablate"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / sub.replace(".", "/")
                ).is_dir()
                found.add(sub if is_module else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("lit_ablate"))
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_points_down_or_across():
    upward = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in import_graph().items()
        for b in sorted(targets)
        if layer_of(b) > layer_of(a) and (a, b) not in ALLOWED_UPWARD
    ]
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle between modules (a package's ``__init__`` re-exporting its own modules is not one)."""

    def own_init(a: str, b: str) -> bool:
        return b.startswith(a + ".")

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if own_init(node, nxt) or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start)):
            return circle
    return None


def test_no_import_circles():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


@pytest.mark.parametrize(
    ("graph", "circle"),
    [
        ({"a": {"b"}, "b": {"a"}}, True),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"p": {"p.x"}, "p.x": set()}, False),
    ],
)
def test_the_circle_finder_finds_circles(graph, circle):
    assert (find_circle(graph) is not None) is circle


CONFIG_VIEW = "lit_ablate.run_config"
RAW_CONFIG_READERS: dict[str, str] = {
    CONFIG_VIEW: "the typed view of a run config: the one module that reads the config dict by dotted key",
    "lit_ablate.config_keys": "defines get_dotted, and TRAINER_STRATEGY_KEY, the one spelling of the strategy's key "
    "(errors about the strategy as a whole name it)",
}
"""The modules that may call ``get_dotted`` or spell ``"trainer.strategy"``, and why."""


def raw_config_reads(source: str) -> list[str]:
    """Where ``source`` calls ``get_dotted`` or spells the string ``"trainer.strategy"`` (its own literal: a
    key built around it, such as ``"trainer.strategy.init_args"``, is another key)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name == "get_dotted":
                found.append(f"line {node.lineno}: get_dotted(...)")
        elif isinstance(node, ast.Constant) and node.value == "trainer.strategy":
            found.append(f'line {node.lineno}: "trainer.strategy"')
    return found


def test_only_the_config_view_reads_the_config_dict():
    """A run config is read once, by ``lit_ablate.run_config``: the rules, the estimator
    and the study planner read its typed values, never the dict by dotted key. Seen failing on the 28
    ``get_dotted`` calls of ``compatibility.py`` and the 29 of ``estimate/from_config.py`` the house had."""
    readers = {
        module_name(path): reads
        for path in sorted(PACKAGE.rglob("*.py"))
        if (reads := raw_config_reads(path.read_text())) and module_name(path) not in RAW_CONFIG_READERS
    }
    assert not readers, "read the run config through lit_ablate.run_config.RunConfig instead:\n" + "\n".join(
        f"{module}: {', '.join(reads)}" for module, reads in readers.items()
    )


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('get_dotted(config, "trainer.devices")', 1),
        ('config_keys.get_dotted(config, "x")', 1),
        ('raise ConfigError("trainer.strategy", name, "fix")', 1),
        ('key = f"{STRATEGY_OPTIONS_KEY}.tp"; other = "trainer.strategy.init_args"', 0),
    ],
)
def test_the_raw_read_finder_finds_raw_reads(source, found):
    assert len(raw_config_reads(source)) == found
