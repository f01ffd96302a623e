"""The rule of DPO's parts (``lit_ablate.rules.part_pairs.preference_parts_fit``): the
shipped DPO configs pass it, and each invalid combination is refused with the key and the fix
(prefix sharing under an attention backend that cannot take its branch mask, Liger's fused DPO on
packed rows, DPO on token data and a token model on preference data); DPO is known by its type, so a
subclass under another name is DPO and a token model named DPO is not."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from lit_ablate.modules import DPO, CausalLM
from lit_ablate.rules import Scope, rules_for
from lit_ablate.rules.part_pairs import preference_parts_fit

CONFIGS = Path(__file__).parent.parent / "configs"


def config(name: str, **changes: object) -> dict:
    tree = yaml.safe_load((CONFIGS / name).read_text())
    for key, value in changes.items():
        node = tree
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = copy.deepcopy(value)
    return tree


def test_shipped_dpo_configs_pass() -> None:
    assert "preference_parts_fit" in {registered.name for registered in rules_for(Scope.CONFIG)}
    for name in ("dpo_tiny.yaml", "dpo_multipack.yaml"):
        assert preference_parts_fit(config(name)) is None, name


@pytest.mark.parametrize(
    "name,changes,expected",
    [
        (
            "dpo_multipack.yaml",
            {"data.init_args.collator.init_args.prefix_sharing": True},
            r"attn_implementation=sdpa_packed: prefix sharing .*\('sdpa', 'eager'\)",
        ),
        ("dpo_multipack.yaml", {"model.init_args.logprobs": "liger"}, r"logprobs=liger: .*PreferencePaddingCollator"),
        ("dpo_tiny.yaml", {"data.init_args.format": "sft"}, r"format=sft: DPO trains on preference pairs"),
        ("dpo_tiny.yaml", {"model.class_path": "lit_ablate.modules.CausalLM"}, r"format=preference: .*DPO"),
    ],
)
def test_invalid_dpo_combinations_are_refused(name: str, changes: dict, expected: str) -> None:
    reason = preference_parts_fit(config(name, **changes))
    assert reason is not None
    assert re.search(expected, reason), reason


def test_prefix_sharing_under_sdpa_passes() -> None:
    tree = config(
        "dpo_multipack.yaml",
        **{
            "data.init_args.collator.init_args.prefix_sharing": True,
            "model.init_args.model.attn_implementation": "sdpa",
        },
    )
    assert preference_parts_fit(tree) is None


def test_fit_refuses_them_in_one_line_naming_the_rule_s_own_key(tmp_path: Path, capsys) -> None:
    """``fit`` runs the same rule before any rank starts; the key comes from the reason
    (before, prefix sharing under sdpa_packed failed at the first training step)."""
    from tests.test_bad_inputs import _stderr_lines

    code, lines = _stderr_lines(
        [
            "fit",
            "--config",
            str(CONFIGS / "dpo_multipack.yaml"),
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--data.init_args.collator.init_args.prefix_sharing",
            "true",
        ],
        capsys,
    )
    assert code not in (0, None) and len(lines) == 1, lines
    assert lines[0].startswith("lit-ablate: error: model.init_args.model.attn_implementation='sdpa_packed': "), lines[0]
    assert "prefix_sharing: false" in lines[0] and not any(tmp_path.iterdir())


class PairwiseTuner(DPO):
    """Research code's DPO variant under a name of its own (the design card's subclassing)."""


class TokenModelNamedDPO(CausalLM):
    """A token model that research code calls ``DPO`` (served below as ``research_code.DPO``)."""


@pytest.mark.parametrize(
    ("class_path", "data_format", "expected"),
    [
        (f"{__name__}.PairwiseTuner", "preference", None),
        (f"{__name__}.PairwiseTuner", "sft", r"format=sft: DPO trains on preference pairs"),
        ("research_code.DPO", "preference", r"format=preference: research_code\.DPO trains on tokens.*or a subclass"),
        ("research_code.DPO", "sft", None),
        ("lit_ablate.modules.NoSuchModule", "preference", None),  # does not import: the run says so itself
    ],
)
def test_the_rule_knows_dpo_by_type_not_by_name(
    class_path: str, data_format: str, expected: str | None, monkeypatch
) -> None:
    """Seen failing with the rule matching the class name (``rpartition('.')[2] == 'DPO'``): the subclass
    on preference pairs was refused as training on tokens, and the token model named DPO was let through."""
    monkeypatch.setitem(sys.modules, "research_code", SimpleNamespace(DPO=TokenModelNamedDPO))
    reason = preference_parts_fit(
        config("dpo_tiny.yaml", **{"model.class_path": class_path, "data.init_args.format": data_format})
    )
    assert (reason is None) if expected is None else re.search(expected, reason or ""), reason
