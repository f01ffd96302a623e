"""A feature whose optional package is missing is one line naming the extra that installs it.

Every optional package lit-ablate imports is listed in ``lit_ablate.extras.EXTRAS`` with its extra
(``torchao`` -> ``fp8``), and every feature that needs one checks it before anything runs: fp8 without
torchao was a 90-line ``ModuleNotFoundError`` from the model's build. Each row below makes one package
look missing (``extras.installed`` answers False for it: the one question every feature asks) and runs the
command that needs it: it must exit 2 with one stderr line naming the key, the package and
``pip install 'lit-ablate[extra]'``, and leave nothing behind.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from lit_ablate import extras
from lit_ablate.cli import EXIT_USAGE, main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
DPO_TINY = str(ROOT / "configs" / "dpo_tiny.yaml")
FIT = ["fit", "--config", QUICKSTART, "--trainer.max_steps", "1"]

BASE_IMPORTS = {
    "torch",
    "lightning",
    "transformers",
    "datasets",
    "numpy",
    "tokenizers",
    "peft",
    "bitsandbytes",
    "torchmetrics",
    "jsonargparse",
    "matplotlib",
    "rich",
    "safetensors",
    "yaml",
}
"""The import names of ``pyproject.toml``'s dependencies: always installed."""
TRANSITIVE_IMPORTS = {"huggingface_hub": "transformers", "pyarrow": "datasets", "typing_extensions": "torch"}
"""Packages lit-ablate imports that a dependency installs (and which one)."""
IMPORTED_THROUGH = {"tensorboard": "torch.utils.tensorboard"}
"""Optional packages lit-ablate uses through another package's module (which imports them)."""


def _mds_folder(tmp: Path) -> str:
    """An MDS folder whose index declares zstd-compressed shards (the reader refuses it before reading one)."""
    folder = tmp / "mds"
    folder.mkdir()
    shard = {
        "format": "mds",
        "compression": "zstd",
        "column_names": ["text"],
        "column_encodings": ["str"],
        "column_sizes": [None],
        "samples": 1,
        "raw_data": {"basename": "shard.00000.mds"},
        "zip_data": {"basename": "shard.00000.mds.zstd"},
    }
    (folder / "index.json").write_text(json.dumps({"version": 2, "shards": [shard]}))
    return str(folder)


def _slurm_study(tmp: Path) -> list[str]:
    study = {
        "name": "queued",
        "base": QUICKSTART,
        "steps": 1,
        "axes": {"data.init_args.batch_size": [2, 4]},
        "launch": {"executor": "slurm", "slurm": {"partition": "cpu"}},
    }
    (tmp / "study.yaml").write_text(yaml.safe_dump(study))
    return ["ablate", "--config", str(tmp / "study.yaml"), "--output_dir", str(tmp / "out")]


Build = Callable[[Path], list[str]]
ROWS: dict[str, tuple[str, Build, tuple[str, ...], dict[str, str]]] = {
    # name: (the missing package, the command, what its line names, environment)
    "fp8": (
        "torchao",
        lambda tmp: [*FIT, "--model.init_args.model.fp8", '{"emulate": true}'],
        ("model.init_args.model.fp8=", "fp8 training", "torchao", "pip install 'lit-ablate[fp8]'"),
        {},
    ),
    "torchao_optimizer": (
        "torchao",
        lambda tmp: [*FIT, "--model.init_args.optimizer", "torchao_adamw8bit"],
        ("model.init_args.optimizer='torchao_adamw8bit'", "pip install 'lit-ablate[optim8bit]'"),
        {},
    ),
    "liger_loss": (
        "liger_kernel",
        lambda tmp: [*FIT, "--model.init_args.loss", "liger"],
        ("model.init_args.loss='liger'", "liger-kernel", "pip install 'lit-ablate[gpu]'"),
        {},
    ),
    "cce_loss": (
        "cut_cross_entropy",
        lambda tmp: [*FIT, "--model.init_args.loss", "cce"],
        ("model.init_args.loss='cce'", "cut-cross-entropy", "pip install 'lit-ablate[gpu]'"),
        {},
    ),
    "liger_dpo": (
        "liger_kernel",
        lambda tmp: ["fit", "--config", DPO_TINY, "--model.init_args.logprobs", "liger"],
        ("model.init_args.logprobs='liger'", "pip install 'lit-ablate[gpu]'"),
        {},
    ),
    "flash_attn_varlen": (
        "flash_attn",
        lambda tmp: [*FIT, "--model.init_args.model.attn_implementation", "fa_varlen"],
        ("attn_implementation='fa_varlen'", "flash-attn", "pip install 'lit-ablate[gpu]'"),
        {},
    ),
    "triton_interpreter": (
        "triton",
        lambda tmp: [*FIT, "--model.init_args.loss", "liger"],
        ("LIT_ABLATE_TRITON_INTERPRET='1'", "pip install 'lit-ablate[kernels-cpu]'"),
        {"LIT_ABLATE_TRITON_INTERPRET": "1"},
    ),
    "zstd_shards": (
        "zstandard",
        lambda tmp: [
            *FIT,
            "--data.init_args.source",
            "lit_ablate.data.MDSShards",
            "--data.init_args.source.path",
            _mds_folder(tmp),
        ],
        ("data.init_args.source.init_args.path='zstd'", "pip install 'lit-ablate[mds]'"),
        {},
    ),
    "slurm_study": ("submitit", _slurm_study, ("launch.executor='slurm'", "pip install 'lit-ablate[slurm]'"), {}),
    "deepspeed_strategy": (
        "deepspeed",
        lambda tmp: [*FIT, "--trainer.strategy", "lit_ablate.strategies.DeepSpeedStrategy"],
        ("trainer.strategy='DeepSpeedStrategy'", "pip install 'lit-ablate[deepspeed]'"),
        {},
    ),
    **{
        f"{tracker}_tracker": (
            module,
            lambda tmp, tracker=tracker: [*FIT, "--recorder.trackers", f'["{tracker}"]'],
            ("recorder.trackers=", f"the {tracker} tracker", "pip install 'lit-ablate[trackers]'"),
            {},
        )
        for tracker, module in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow"))
    },
}

REACHED_PAST: dict[str, str] = {"triton_interpreter": "liger_kernel"}
"""Rows whose command reaches its package's check only with another optional package installed (without
liger-kernel, the interpreter's row stops at liger's own line: the ``liger_loss`` row)."""


@pytest.mark.parametrize("row", list(ROWS))
def test_a_missing_optional_package_is_one_line_naming_its_extra(row: str, tmp_path: Path, capsys, monkeypatch) -> None:
    """Seen failing for ``fp8`` with neither the fp8 rule nor the conversion asking for torchao (``ModuleNotFoundError:
    No module named 'torchao.float8'`` inside jsonargparse's error), and for ``slurm_study`` with the study asking
    for submitit only once it ran (after its progress line)."""
    if row in REACHED_PAST and not extras.installed(REACHED_PAST[row]):
        pytest.skip(
            f"{REACHED_PAST[row]} is not installed here (it comes with the kernels-cpu extra), so this "
            f"command stops at its line first"
        )
    package, build, expected, env = ROWS[row]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    real = extras.installed
    monkeypatch.setattr(extras, "installed", lambda module: module != package and real(module))
    if package == "torchao":  # the import itself fails too, as it would without the package
        monkeypatch.setitem(sys.modules, "torchao", None)
    argv = build(tmp_path)
    if argv[0] == "fit":
        argv += ["--trainer.default_root_dir", str(tmp_path / "runs")]
    before = {p for p in tmp_path.rglob("*")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == EXIT_USAGE, lines
    assert len(lines) == 1, lines
    missing = [fragment for fragment in expected if fragment not in lines[0]]
    assert not missing, f"{missing} not in: {lines[0]}"
    assert {p for p in tmp_path.rglob("*")} == before, "the refusal left files behind"


def _imported_packages() -> set[str]:
    """The top-level packages ``lit_ablate`` imports anywhere (stdlib and itself left out)."""
    found = set()
    for path in (ROOT / "lit_ablate").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "lit_ablate"}


def test_every_optional_package_has_its_extra_and_a_row():
    """Every package lit-ablate imports is a dependency (or comes with one) or an optional package with its
    extra, and every optional package has a row above: a new optional import without its one-line refusal
    fails here. Seen failing with torchao left out of ``EXTRAS`` (and with a row removed)."""
    optional = (_imported_packages() | set(IMPORTED_THROUGH)) - BASE_IMPORTS - set(TRANSITIVE_IMPORTS)
    assert optional == set(extras.EXTRAS), f"imported, not a dependency: {sorted(optional - set(extras.EXTRAS))}"
    assert {package for package, *_ in ROWS.values()} == set(extras.EXTRAS)
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in set(extras.EXTRAS.values()):
        assert f"\n{extra} = [" in pyproject, f"no [{extra}] extra in pyproject.toml"


@pytest.mark.parametrize(
    ("module", "extra", "line"),
    [
        ("torchao", None, "torchao, which is not installed here: pip install 'lit-ablate[fp8]'"),
        ("liger_kernel", None, "liger-kernel, which is not installed here: pip install 'lit-ablate[gpu]'"),
        (
            "liger_kernel",
            "kernels-cpu",
            "liger-kernel, which is not installed here: pip install 'lit-ablate[kernels-cpu]'",
        ),
    ],
)
def test_require_names_the_key_the_package_and_its_extra(monkeypatch, module: str, extra: str | None, line: str):
    """``require`` alone: a missing package is one ``ConfigError`` naming the key and value that chose the
    feature, the distribution's name and the extra (the one given, else its own); an installed one passes.
    Seen failing with ``require`` gutted (nothing raised: only 2 of the command rows above caught it), the
    extra given ignored, and the import name shown for the distribution (``liger_kernel``)."""
    monkeypatch.setattr(extras, "installed", lambda name: name != module)
    with pytest.raises(extras.ConfigError) as refused:
        extras.require(module, "model.init_args.loss", "liger", "the liger loss", extra)
    assert str(refused.value) == f"model.init_args.loss='liger': the liger loss needs {line}"
    extras.require("torch", "model.init_args.loss", "torch", "the torch loss")  # installed: nothing to say


def test_installed_asks_without_importing_and_never_raises() -> None:
    assert extras.installed("json") and not extras.installed("lit_ablate_no_such_package")
    assert not extras.installed("lit_ablate_no_such_package.sub")  # a missing parent: False, not ImportError
    assert "zstandard" in extras.EXTRAS and extras.installed("lit_ablate") and "lit_ablate.extras" in sys.modules
