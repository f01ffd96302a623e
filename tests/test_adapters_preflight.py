"""``lit-ablate fit`` runs the rules about a run's own parts before any rank starts (``lit_ablate.rules``,
the same a study judges its variants by): an adapter/optimizer/strategy combination that
cannot run is one stderr line naming the key and the fix, not a traceback at step 1 (before this
check, torchao's AdamW8bit under the default MemoryMonitor crashed inside torch.compile at the first
step, and an FSDP1 QLoRA run failed in FSDP's flattening after the ranks had started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bad_inputs import CONFIGS, _stderr_lines

SFT_LORA = ["fit", "--config", str(CONFIGS / "sft_lora_tiny.yaml"), "--trainer.max_steps", "1"]
FSDP1 = '{"class_path": "lit_ablate.strategies.FSDP1Strategy"}'
FSDP2 = '{"class_path": "lit_ablate.strategies.FSDP2Strategy"}'
QLORA = '{"bits": 4}'

ROWS = {
    "bitsandbytes_optimizer_under_fsdp2": (
        ["--model.init_args.optimizer", "bnb_adamw8bit", "--trainer.strategy", FSDP2, "--trainer.devices", "2"],
        ("model.init_args.optimizer", "torchao_adamw8bit"),
    ),
    "qlora_under_fsdp1": (
        ["--model.init_args.model.quantization", QLORA, "--trainer.strategy", FSDP1, "--trainer.devices", "2"],
        ("model.init_args.model.quantization", "set quant_storage: float32"),
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_incompatible_parts_are_refused_in_one_line_before_fit_starts(row, tmp_path: Path, capsys) -> None:
    args, expected = ROWS[row]
    code, lines = _stderr_lines([*SFT_LORA, "--trainer.default_root_dir", str(tmp_path), *args], capsys)
    assert code not in (0, None) and len(lines) == 1, lines
    assert all(fragment in lines[0] for fragment in expected), lines[0]
    assert not any(tmp_path.iterdir())  # refused before the run wrote anything
