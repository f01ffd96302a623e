"""GPU-only extras are never imported just by importing lit-ablate (they degrade, never crash)."""

import subprocess
import sys

GPU_ONLY = ("flash_attn", "liger_kernel", "cut_cross_entropy")


def test_importing_every_module_imports_no_gpu_only_package():
    code = f"""
import importlib, pkgutil, sys
import lit_ablate
for info in pkgutil.walk_packages(lit_ablate.__path__, "lit_ablate."):
    importlib.import_module(info.name)
loaded = [m for m in {GPU_ONLY!r} if m in sys.modules]
print("LOADED", loaded)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LOADED []" in out.stdout


def test_no_module_is_over_600_lines():
    """One concept per file: a module past 600 lines holds more than one (issue 51 split ``compatibility.py``,
    1,400 lines, into the rule registry); ``run_config.py`` was 602 lines when this test was written."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "lit_ablate"
    long = {
        str(p.relative_to(package)): n for p in package.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}
