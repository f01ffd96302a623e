"""``ModelFactory``: presets, config mappings and local checkpoints (offline), with one-line errors.

Recorded mutant: loading without ``use_kernels=False`` (transformers 5.25 kernelizes every
``from_pretrained`` by default) fails the offline-checkpoint test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_ablate.errors import ConfigError
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM


def test_local_checkpoint_loads_offline_with_the_same_logits_and_the_asked_dtype(tmp_path):
    torch.manual_seed(0)
    original = ModelFactory(preset="tiny-qwen3").build()
    original.save_pretrained(tmp_path / "ckpt")
    loaded = ModelFactory(pretrained=str(tmp_path / "ckpt"), attn_implementation="sdpa_packed").build()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert loaded.config._attn_implementation == "sdpa_packed"
    # transformers 5.25 turned Hub kernels on for every from_pretrained (Liger RMSNorm and a rotary
    # kernel downloaded on a GPU): a loaded model must run the kernels its config names, as one
    # built from a config does. Seen failing without ``use_kernels=False`` in the factory.
    assert not loaded.use_kernels
    half = ModelFactory(pretrained=str(tmp_path / "ckpt"), dtype="bfloat16").build()
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_module_fine_tunes_from_a_local_checkpoint(tmp_path):
    ModelFactory(preset="tiny-llama").build().save_pretrained(tmp_path / "ckpt")
    module = CausalLM(ModelFactory(pretrained=str(tmp_path / "ckpt")), warmup_steps=0)
    module.configure_model()
    ids = torch.randint(0, 256, (2, 16))
    loss_sum, useful = module.model({"input_ids": ids, "labels": ids.roll(-1, 1)})
    (loss_sum / useful).backward()
    assert torch.isfinite(loss_sum) and int(useful) == 32
    assert all(p.grad is not None for p in module.model.parameters() if p.requires_grad)


def test_a_missing_or_unloadable_checkpoint_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.init_args\.model\.pretrained=.*no such directory"):
        ModelFactory(pretrained=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"model\.init_args\.model\.pretrained=.*transformers could not load it"):
        ModelFactory(pretrained=str(tmp_path / "empty")).build()
    with pytest.raises(ConfigError, match="either pretrained or preset/config"):
        ModelFactory(preset="tiny-llama", pretrained=str(tmp_path / "empty"))


def test_a_dotted_null_preset_switches_to_the_config():
    """``--model.init_args.model.preset null`` (to build from ``config`` instead) reaches the factory as
    the string "None" through LightningCLI's nested parsing; it must mean no preset (seen failing:
    "preset='None': choose one of [...]")."""
    from lit_ablate.fit_cli import resolve_fit_config

    config = (
        '{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
        '"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300}'
    )
    resolved = resolve_fit_config(
        [
            "--config",
            str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"),
            "--model.init_args.model.preset",
            "null",
            "--model.init_args.model.config",
            config,
        ]
    )
    options = resolved["model"]["init_args"]["model"]
    lm = ModelFactory(**{k: options[k] for k in ("preset", "config", "pretrained")}).build(device="meta")
    assert lm.config.model_type == "llama" and lm.config.hidden_size == 32


def test_config_keys_the_class_consumes_or_model_code_reads_are_kept_and_a_typo_is_refused():
    """A key a config class does not declare is a typo only if no model code reads it: ``rope_theta``
    becomes ``rope_parameters``, Qwen3-MoE reads ``head_dim`` (its preset sets it) with ``getattr``,
    RoPE code reads ``partial_rotary_factor``. Seen failing with the check on the declared keys alone
    (the tiny-qwen3-moe preset refused)."""
    kept = ModelFactory(preset="tiny-llama", config={"rope_theta": 5000.0, "partial_rotary_factor": 0.5}).hf_config()
    assert kept.rope_parameters["rope_theta"] == 5000.0
    assert ModelFactory(preset="tiny-qwen3-moe").hf_config().head_dim == 32
    with pytest.raises(
        ConfigError, match=r"config\.num_hidden_layer=2: Qwen3MoeConfig has no such key.*num_hidden_layers"
    ):
        ModelFactory(preset="tiny-qwen3-moe", config={"num_hidden_layer": 2})


ARCHITECTURE = {  # a config.json as save_pretrained writes it for a user's own shape
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 320,
}


def test_a_config_json_builds_its_architecture_with_random_weights_and_trains(tmp_path):
    """``model.init_args.model.config: path/to/config.json`` (or its folder) builds that architecture, drawn
    from the seed, and ``lit-ablate fit`` trains it. Seen failing with ``config`` typed as a mapping only
    (the parser: "Expected a <class 'dict'>. Got value: .../arch")."""
    from transformers import AutoConfig

    from lit_ablate.cli import main
    from lit_ablate.record import read_record

    AutoConfig.for_model("qwen3", **ARCHITECTURE).save_pretrained(tmp_path / "arch")
    for path in (tmp_path / "arch", tmp_path / "arch" / "config.json"):
        config = ModelFactory(config=str(path)).hf_config()
        assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen3", 64, 2)
    torch.manual_seed(0)
    first = ModelFactory(config=str(tmp_path / "arch")).build()
    torch.manual_seed(0)
    again = ModelFactory(config=str(tmp_path / "arch")).build()
    assert type(first).__name__ == "Qwen3ForCausalLM"
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))  # the seed's draw
    quickstart = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
    main(
        [
            "fit",
            "--config",
            quickstart,
            "--model.init_args.model.preset",
            "null",
            "--model.init_args.model.config",
            str(tmp_path / "arch"),
            "--trainer.max_steps",
            "3",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--recorder.path",
            str(tmp_path / "run.json"),
        ]
    )
    record = read_record(tmp_path / "run.json")
    assert record["summary"]["status"] == "ok"
    assert record["model"]["total"] == sum(p.numel() for p in first.parameters())
    losses = [step["loss"] for step in record["steps"]]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": "{tmp}/missing.json"}, "missing.json': no such file; give a Hugging Face config.json"),
        ({"config": "{tmp}"}, "no such file; give a Hugging Face config.json, or a folder holding one"),
        ({"config": "{root}/bad.json"}, "transformers could not read it"),
        ({"config": "{arch}", "preset": "tiny-llama"}, "a config file is a whole architecture"),
    ],
)
def test_a_config_file_that_builds_nothing_is_one_line_naming_the_key(tmp_path, kwargs, message):
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3", **ARCHITECTURE).save_pretrained(tmp_path / "arch")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "empty").mkdir()
    kwargs = {k: v.format(tmp=tmp_path / "empty", root=tmp_path, arch=tmp_path / "arch") for k, v in kwargs.items()}
    with pytest.raises(ConfigError, match=r"^model\.init_args\.model\.config=") as info:
        ModelFactory(**kwargs)
    assert message in str(info.value)
