"""docs/architecture.md's extension examples run as written: the strategy step, the metric, the loss
backend and the attention backend (each Python block, in a fresh namespace, in one subprocess so
their registrations never reach this test process), and the study axis (planned by ``--dry-run``).

Each Python block asserts what it shows (the checkpointed step's gradients equal the plain ones, the
monitor records one value per step, the loss backend without smoothing equals torch's, the attention
backend equals ``sdpa_packed`` on packed documents). Seen failing with a block's import renamed
(``decoder_layer`` for ``decoder_layers``: the block's ImportError, named by its line in the page)
and with the attention block's ``position_ids`` left out of its mask (logits up to 1.08 off).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lit_ablate.commands.ablate import ablate_main
from tests.test_layers import LAYERS

REPOSITORY = Path(__file__).parents[1]
PAGE = REPOSITORY / "docs" / "architecture.md"
EXTENSIONS = (
    "A strategy step",
    "A callback: a custom metric",
    "A loss backend",
    "An attention backend",
    "A study axis",
)

RUN_BLOCKS = textwrap.dedent("""
    import re, sys, traceback
    page = open(sys.argv[1]).read()
    for match in re.finditer(r"^```python\\n(.*?)^```", page, re.MULTILINE | re.DOTALL):
        line = page[: match.start()].count("\\n") + 2
        try:
            code = compile(match.group(1), f"docs/architecture.md (block at line {line})", "exec")
            exec(code, {"__name__": "__doc_block__"})
        except BaseException:
            traceback.print_exc()
            sys.exit(f"the block at line {line} failed")
        print(f"block at line {line}: ok", flush=True)
""")


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)


def test_every_extension_point_has_its_example():
    text = PAGE.read_text()
    sections = re.split(r"^### ", text, flags=re.MULTILINE)[1:]
    for title in EXTENSIONS:
        section = next((s for s in sections if s.startswith(title + "\n")), None)
        assert section is not None, f"no section '### {title}'"
        assert "```python" in section or "```yaml" in section, f"'{title}' shows no code"


def test_the_layer_table_names_every_layer_the_layer_test_enforces():
    """The page describes the house as ``tests/test_layers.py`` holds it to (seen failing with
    ``checkpoint_model.py`` left out of the table)."""
    section = PAGE.read_text().split("## The layers", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)(?:/|\.py)?`", section))
    enforced = {prefix.removeprefix("lit_ablate.") for layer in LAYERS for prefix in layer}
    assert not enforced - named, f"docs/architecture.md's layers leave out {sorted(enforced - named)}"


# one interpreter's imports, a 3-step fit and four tiny models: ~20 s of CPU, 55 s on a loaded machine
@pytest.mark.slow
def test_every_python_block_runs(tmp_path: Path):
    python = blocks("python")
    assert len(python) == 5
    done = subprocess.run(
        [sys.executable, "-c", RUN_BLOCKS, str(PAGE)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert done.stdout.count(": ok") == len(python)


def test_the_study_axis_plans_its_variants(tmp_path: Path, capsys):
    (study,) = blocks("yaml")
    folder = tmp_path / "configs" / "studies"
    folder.mkdir(parents=True)
    shutil.copy(REPOSITORY / "configs" / "quickstart.yaml", tmp_path / "configs")
    (folder / "loss_axis.yaml").write_text(study)
    assert (
        ablate_main(["--config", str(folder / "loss_axis.yaml"), "--output_dir", str(tmp_path / "out"), "--dry-run"])
        == 0
    )
    plan = capsys.readouterr().out
    assert "2 variants" in plan and "2 would run" in plan, plan
    assert "torch seed0" in plan and "chunked seed0" in plan, plan
