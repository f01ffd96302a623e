"""A bf16 run on a CPU without bf16 matrix kernels is named before the work (a study's plan, ``fit``'s start):
its matmuls run torch's reference GEMM, two orders of magnitude slower (docs/platform.md). Simulated both
ways: the kernels' presence is this CPU's."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ablate import cpu_half_matmuls
from lit_ablate.ablation.plan import plan_study
from lit_ablate.ablation.spec import load_study
from lit_ablate.commands.ablate import slow_bf16_line

STUDY = Path(__file__).parents[1] / "configs" / "studies" / "bf16_vs_fp8.yaml"


@pytest.mark.parametrize("kernels", [True, False])
def test_the_plan_names_the_bf16_variants_only_where_the_cpu_has_no_bf16_kernels(kernels, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_half_matmuls, "has_bf16_matmul_kernels", lambda: kernels)
    runs = plan_study(load_study(STUDY), tmp_path)
    line = slow_bf16_line(runs)
    if kernels:
        assert line is None
        return
    bf16 = list(dict.fromkeys(r.variant.name for r in runs if r.view.compute_dtype == "bfloat16" and not r.skip_reason))
    assert bf16 and line.startswith(f"variants computing in bf16 ({', '.join(bf16)})")
    assert "reference GEMM" in line and "\n" not in line


def test_only_bf16_on_a_cpu_is_slow(monkeypatch):
    monkeypatch.setattr(cpu_half_matmuls, "has_bf16_matmul_kernels", lambda: False)
    assert cpu_half_matmuls.slow_bf16_matmuls("bfloat16", "cpu")
    assert cpu_half_matmuls.slow_bf16_matmuls("float32", "cpu") is None
    assert cpu_half_matmuls.slow_bf16_matmuls("bfloat16", "cuda") is None


class Parsed(Exception):
    """Raised where the fit would build its classes: the start's checks ran."""


def test_fit_warns_when_it_starts(monkeypatch, tmp_path):
    from lit_ablate.fit_cli import LitAblateCLI

    def stop(cli):
        raise Parsed

    monkeypatch.setattr(cpu_half_matmuls, "has_bf16_matmul_kernels", lambda: False)
    monkeypatch.setattr(LitAblateCLI, "instantiate_classes", stop)
    quickstart = str(STUDY.parents[1] / "quickstart.yaml")
    arguments = ["fit", "--config", quickstart, "--trainer.default_root_dir", str(tmp_path)]
    warned = pytest.warns(UserWarning, match="trainer.precision='bf16-true': this CPU has no bf16 matrix kernels")
    with warned, pytest.raises(Parsed):
        LitAblateCLI(args=[*arguments, "--trainer.precision", "bf16-true"])
