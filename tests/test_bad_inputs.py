"""Every bad input is one line on stderr that names the key: a table of them, run in-process.

Each row is a command line (files it needs are written to ``tmp_path``); the CLI must exit with a
non-zero code and write exactly one non-empty line to stderr (what it printed plus the exit message
Python prints), containing every expected fragment: the key, the value, and for some the fix. Rows
fail before anything heavy is built (data rows read a two-line file), so the table runs in seconds.
Before this table existed, 27 of these rows ended in a traceback, several were accepted (``max_steps
0``, zero decoder layers, ``--world_size 0``) and the jsonargparse rows blamed the class_path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from lit_ablate.cli import EXIT_FAILURE, EXIT_USAGE, main
from lit_ablate.command_table import SUMMARIES
from lit_ablate.data import LocalFiles, build_examples, load_tokenizer
from lit_ablate.errors import ConfigError
from lit_ablate.record import read_record
from lit_ablate.rules.devices import NODE_LAUNCH_ENV

CONFIGS = Path(__file__).parents[1] / "configs"
QUICKSTART = str(CONFIGS / "quickstart.yaml")
SFT = str(CONFIGS / "sft_tiny.yaml")
FSDP2 = str(CONFIGS / "fsdp2_tiny.yaml")
DPO_TINY = str(CONFIGS / "dpo_tiny.yaml")
FIT = ["fit", "--config", QUICKSTART, "--trainer.max_steps", "1"]

Build = Callable[[Path], list[str]]


def _file(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _model(**config) -> Build:
    """fit with the quickstart's tiny-llama and ``config`` over its sizes."""

    def build(tmp: Path) -> list[str]:
        model = {"class_path": "lit_ablate.modules.CausalLM", "init_args": {"model": {"config": config}}}
        return [
            *FIT,
            "--trainer.default_root_dir",
            str(tmp),
            "--config",
            _file(tmp, "model.yaml", yaml.safe_dump({"model": model})),
        ]

    return build


def _estimate_model(**config) -> Build:
    return lambda tmp: ["estimate", "--config", QUICKSTART, "--model.init_args.model.config", json.dumps(config)]


def _sft_file(*rows: object) -> Build:
    """fit on a local JSONL of ``rows`` (a str row is written as it is: a malformed line)."""

    def build(tmp: Path) -> list[str]:
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        path = _file(tmp, "rows.jsonl", "\n".join(lines) + "\n")
        return [
            "fit",
            "--config",
            SFT,
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp),
            "--data.init_args.val_examples",
            "0",
            "--data.init_args.source",
            "lit_ablate.data.LocalFiles",
            "--data.init_args.source.path",
            path,
        ]

    return build


def _fit(*args: str) -> Build:
    return lambda tmp: [*FIT, "--trainer.default_root_dir", str(tmp), *[a.replace("{tmp}", str(tmp)) for a in args]]


def _args(*args: str) -> Build:
    return lambda tmp: [a.replace("{tmp}", str(tmp)) for a in args]


def _text_file(tmp: Path) -> str:
    return _file(tmp, "notes.ckpt", "not a checkpoint\n")


def _fake_checkpoint(tmp: Path, hyper_parameters: bool = True) -> str:
    """A real torch.save archive (with hyper-parameters, or none for ``fit`` to compare): passes the
    checkpoint checks, so a row can reach the next argument's check without training anything."""
    path = tmp / "fake.ckpt"
    torch.save(
        {"hyper_parameters": {"model": {"preset": "tiny-llama"}} if hyper_parameters else {}, "state_dict": {}}, path
    )
    return str(path)


def _sharded_folder(tmp: Path, **metadata: Any) -> str:
    """A folder in the layout of a sharded checkpoint (``meta.pt`` beside the shards), no hyper-parameters,
    with ``metadata`` in its ``meta.pt``."""
    folder = tmp / "last.ckpt"
    folder.mkdir()
    torch.save({"state_dict": {}, **metadata}, folder / "meta.pt")
    return str(folder)


def _deepspeed_folder(tmp: Path) -> str:
    """A folder in DeepSpeed's own checkpoint layout (its ``latest`` tag beside the per-rank partitions)."""
    folder = tmp / "ds.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    torch.save({}, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    return str(folder)


def _unsafe_pickle(tmp: Path) -> str:
    """A torch.save archive holding an object ``weights_only`` loading refuses (torch's UnpicklingError)."""
    path = tmp / "ref.pt"
    torch.save({"pairs_sha256": "0", "logps": logging.getLogger("a pickled object")}, path)
    return str(path)


def _study(study: dict) -> Build:
    def build(tmp: Path) -> list[str]:
        return [
            "ablate",
            "--config",
            _file(tmp, "study.yaml", yaml.safe_dump(study)),
            "--output_dir",
            str(tmp / "study"),
        ]

    return build


GENERATE = ["generate", "--ckpt_path", "{tmp}/missing.ckpt", "--prompt", "12+7="]
CHAT = [{"role": "user", "content": "1+1="}]

ROWS: dict[str, tuple[Build, tuple[str, ...]]] = {
    # --- model shape: refused when ModelFactory is made, before anything is built -----------------
    "hidden_not_divisible_by_heads": (
        _model(hidden_size=130),
        ("model.init_args.model.config.hidden_size=130", "num_attention_heads=4"),
    ),
    "kv_heads_not_dividing_heads": (_model(num_key_value_heads=3), ("config.num_key_value_heads=3", "[1, 2, 4]")),
    "negative_hidden_size": (_model(hidden_size=-8), ("config.hidden_size=-8", "positive")),
    # transformers keeps an unknown key as an attribute no model reads: this trained the default size
    "model_config_key_typo": (
        _model(hidden_sise=64),
        ("model.init_args.model.config.hidden_sise=64", "did you mean hidden_size"),
    ),
    "zero_heads": (_model(num_attention_heads=0), ("config.num_attention_heads=0",)),
    "zero_vocab": (_model(vocab_size=0), ("config.vocab_size=0",)),
    "zero_intermediate_size": (_model(intermediate_size=0), ("config.intermediate_size=0",)),
    "zero_decoder_layers": (_model(num_hidden_layers=0), ("config.num_hidden_layers=0", "decoder layer")),
    "more_experts_per_token_than_experts": (
        _fit(
            "--model.init_args.model.preset",
            "tiny-qwen3-moe",
            "--model.init_args.model.config",
            '{"num_experts_per_tok": 9}',
        ),
        ("config.num_experts_per_tok=9", "8 experts"),
    ),
    "estimate_hidden_not_divisible": (_estimate_model(hidden_size=130), ("config.hidden_size=130",)),
    "estimate_zero_decoder_layers": (_estimate_model(num_hidden_layers=0), ("config.num_hidden_layers=0",)),
    # --- data: the file and line, the row and message -------------------------------------------
    "malformed_jsonl_line": (
        _sft_file({"prompt": "1+1=", "response": "2"}, '{"prompt": "2+2=", "respo'),
        ("data.init_args.source.init_args.path", "line 2 of", "rows.jsonl", "not valid JSON"),
    ),
    "truncated_jsonl_line": (
        _sft_file({"prompt": "1+1=", "response": "2"}, '{"prompt": "1+1=", "response": {'),
        ("data.init_args.source.init_args.path", "line 2 of", "rows.jsonl", "cut short"),
    ),
    "chat_message_without_content": (
        _sft_file({"messages": [*CHAT, {"role": "assistant"}]}),
        ("data.init_args.source row 1 messages[1]", "'content'"),
    ),
    "chat_message_with_null_content": (
        _sft_file({"messages": [{"role": "user", "content": None}]}),
        ("data.init_args.source row 1 messages[0]", "None", "'content'"),
    ),
    "sft_row_without_response": (
        _sft_file({"prompt": "1+1=", "response": "2"}, {"prompt": "2+2="}),
        ("data.init_args.source row 2", "'prompt'", "'response'"),
    ),
    # --- jsonargparse: the key, the expected type and the value, not "cannot import" ---------------
    "wrong_type_in_init_args": (
        _fit("--data.init_args.batch_size", "abc"),
        ("data.init_args.batch_size='abc'", "expected int"),
    ),
    "unknown_key_in_init_args_yaml": (
        lambda tmp: [*FIT, "--config", _file(tmp, "unknown.yaml", "data:\n  init_args:\n    batch_sizee: 4\n")],
        ("data.init_args.batch_sizee", "did you mean batch_size"),
    ),
    "wrong_type_in_model_init_args": (
        _fit("--model.init_args.learning_rate", "fast"),
        ("model.init_args.learning_rate='fast'", "expected float"),
    ),
    "wrong_type_two_classes_deep": (
        _fit("--data.init_args.source.init_args.num_documents", "many"),
        ("data.init_args.source.init_args.num_documents='many'", "expected int"),
    ),
    "unknown_key_two_classes_deep": (
        _fit("--data.init_args.source.init_args.num_docs", "3"),
        ("data.init_args.source.init_args.num_docs", "did you mean num_documents"),
    ),
    # a dataclass section's keys have no init_args level: the line named a key path the config cannot have
    # refused by peft once the model was built, after the trainer and its run record existed
    "lora_target_that_matches_nothing": (
        _args(
            "fit",
            "--config",
            str(CONFIGS / "sft_lora_tiny.yaml"),
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            "{tmp}",
            "--model.init_args.model.adapter.target_modules",
            "[q_projj]",
        ),
        ("adapter.target_modules=['q_projj']", "linear layers are ['down_proj'", "all-linear"),
    ),
    "wrong_value_in_a_dataclass_section": (
        _fit("--model.init_args.model.fp8", '{"recipe": "rowwis"}'),
        ("model.init_args.model.fp8.recipe='rowwis'", "'tensorwise'"),
    ),
    "value_outside_a_literal": (
        _fit("--data.init_args.format", "sftt"),
        ("data.init_args.format='sftt'", "one of ['pretrain', 'documents', 'sft']"),
    ),
    "precision_outside_its_choices": (
        _fit("--trainer.precision", "17"),
        ("trainer.precision='17'", "'bf16-mixed'", "'32-true'", "16", "or null"),
    ),
    "unknown_trainer_key": (_fit("--trainer.max_stepz", "3"), ("trainer.max_stepz", "did you mean max_steps")),
    # DPO hands its optimizer options on to CausalLM as **kwargs: the hint reads them as the parser does
    # (seen failing with inspect.signature: "its parameters are [..., 'optimization']", no warmup_steps)
    "unknown_dpo_optimizer_key": (
        _args("fit", "--config", DPO_TINY, "--model.init_args.warmup_step", "3"),
        ("model.init_args.warmup_step", "did you mean warmup_steps"),
    ),
    "unknown_class_path": (
        _fit("--data.init_args.source", "lit_ablate.data.NoSuchSource"),
        ("data.init_args.source", "cannot import 'lit_ablate.data.NoSuchSource'"),
    ),
    "missing_fit_config": (_args("fit", "--config", "{tmp}/missing.yaml"), ("--config", "missing.yaml")),
    "fit_config_not_yaml": (
        lambda tmp: ["fit", "--config", _file(tmp, "bad.yaml", "trainer: [a\n")],
        ("--config", "not valid YAML", "line 2"),
    ),
    # --- files ------------------------------------------------------------------------------------
    "unwritable_default_root_dir": (
        lambda tmp: [*FIT, "--trainer.default_root_dir", _text_file(tmp) + "/runs"],
        ("trainer.default_root_dir=", "notes.ckpt/runs", "cannot write"),
    ),
    "unwritable_recorder_path": (
        lambda tmp: [*FIT, "--trainer.default_root_dir", str(tmp), "--recorder.path", _text_file(tmp) + "/run.json"],
        ("recorder.path=", "cannot write"),
    ),
    "recorder_path_is_a_folder": (_fit("--recorder.path", "{tmp}"), ("recorder.path=", "is a folder")),
    "fit_missing_checkpoint": (
        _fit("--ckpt_path", "{tmp}/missing.ckpt"),
        ("--ckpt_path=", "missing.ckpt", "no such file"),
    ),
    "fit_text_file_as_checkpoint": (
        lambda tmp: [*FIT, "--ckpt_path", _text_file(tmp)],
        ("--ckpt_path=", "notes.ckpt", "not a checkpoint"),
    ),
    "validate_missing_checkpoint": (
        _args("validate", "--config", QUICKSTART, "--ckpt_path", "{tmp}/missing.ckpt"),
        ("--ckpt_path=", "no such file"),
    ),
    "test_text_file_as_checkpoint": (
        lambda tmp: ["test", "--config", QUICKSTART, "--ckpt_path", _text_file(tmp)],
        ("--ckpt_path=", "not a checkpoint"),
    ),
    "generate_missing_checkpoint": (_args(*GENERATE), ("--ckpt_path=", "missing.ckpt", "no such file")),
    "generate_text_file_as_checkpoint": (
        lambda tmp: ["generate", "--ckpt_path", _text_file(tmp), "--prompt", "hi"],
        ("--ckpt_path=", "not a checkpoint"),
    ),
    "generate_archive_without_hyperparameters": (
        lambda tmp: (
            torch.save({"weights": torch.zeros(1)}, tmp / "w.pt"),
            ["generate", "--ckpt_path", str(tmp / "w.pt"), "--prompt", "hi"],
        )[1],
        ("--ckpt_path=", "no hyper_parameters"),
    ),
    "generate_empty_folder": (
        lambda tmp: ["generate", "--ckpt_path", str(tmp), "--prompt", "hi"],
        ("--ckpt_path=", "a folder without meta.pt is not a sharded checkpoint"),
    ),
    "export_empty_folder": (
        lambda tmp: ["export", "--ckpt_path", str(tmp), "--output_dir", str(tmp / "hf")],
        ("lit-ablate export: error: --ckpt_path=", "a folder without meta.pt is not a sharded checkpoint"),
    ),
    "export_missing_checkpoint": (
        _args("export", "--ckpt_path", "{tmp}/missing.ckpt", "--output_dir", "{tmp}/hf"),
        ("--ckpt_path=", "no such file"),
    ),
    "export_text_file_as_checkpoint": (
        lambda tmp: ["export", "--ckpt_path", _text_file(tmp), "--output_dir", str(tmp / "hf")],
        ("--ckpt_path=", "not a checkpoint"),
    ),
    "export_onto_an_existing_file": (
        lambda tmp: ["export", "--ckpt_path", _fake_checkpoint(tmp), "--output_dir", _text_file(tmp)],
        ("--output_dir=", "notes.ckpt", "is a file"),
    ),
    "export_unwritable_output_dir": (
        lambda tmp: ["export", "--ckpt_path", _fake_checkpoint(tmp), "--output_dir", _text_file(tmp) + "/hf"],
        ("--output_dir=", "cannot write"),
    ),
    # paths the run reads or writes once it runs: refused before any rank starts, naming the key and what to do
    "data_cache_dir_under_a_file": (
        lambda tmp: [
            *FIT,
            "--trainer.default_root_dir",
            str(tmp),
            "--data.init_args.storage",
            "cache",
            "--data.init_args.cache_dir",
            _text_file(tmp) + "/cache",
        ],
        ("data.init_args.cache_dir=", "notes.ckpt/cache", "notes.ckpt is a file, not a folder"),
    ),
    "corrupt_reference_cache": (
        lambda tmp: [
            "fit",
            "--config",
            DPO_TINY,
            "--trainer.default_root_dir",
            str(tmp),
            "--model.init_args.reference",
            "precomputed",
            "--model.init_args.reference_cache",
            _unsafe_pickle(tmp),
        ],
        ("model.init_args.reference_cache=", "ref.pt", "does not load as plain tensors", "delete it"),
    ),
    # a sharded checkpoint resumes on any layout (tests/test_resume_any_layout.py), with its global batch
    "sharded_folder_resumed_with_another_global_batch": (
        lambda tmp: [
            *FIT,
            "--trainer.default_root_dir",
            str(tmp),
            "--ckpt_path",
            _sharded_folder(tmp, LMDataModule={"epoch": 0, "items_consumed": 48, "global_batch": 16}),
        ],
        ("data.init_args.batch_size=8: use 16 to keep the checkpoint's global batch of 16 items per optimizer step",),
    ),
    "stream_resumed_on_other_ranks": (
        lambda tmp: [
            *FIT,
            "--trainer.default_root_dir",
            str(tmp),
            "--data.init_args.storage",
            "stream",
            "--data.init_args.val_examples",
            "0",
            "--ckpt_path",
            _sharded_folder(
                tmp, LMDataModule={"epoch": 0, "items_consumed": 16, "global_batch": 8, "data_parallel_size": 2}
            ),
        ],
        ("data.init_args.storage='stream': a stream resumes each rank's own position, saved on 2",),
    ),
    "quantised_base_resumed_on_another_mesh": (
        lambda tmp: [
            *FIT,
            "--trainer.default_root_dir",
            str(tmp),
            "--model.init_args.model.quantization",
            "{bits: 4}",
            "--ckpt_path",
            _sharded_folder(tmp, mesh_sizes={"pp": 1, "dp_replicate": 1, "dp_shard": 2, "ep": 1, "cp": 1, "tp": 1}),
        ],
        ("--ckpt_path=", "a sharded checkpoint of a quantised base", "do not reshard; resume on the mesh"),
    ),
    "deepspeed_folder": (
        lambda tmp: [*FIT, "--trainer.default_root_dir", str(tmp), "--ckpt_path", _deepspeed_folder(tmp)],
        ("--ckpt_path=", "a DeepSpeed checkpoint", "does not reshard", "only lit_ablate.strategies.DeepSpeedStrategy"),
    ),
    "pipeline_resumed_from_a_file": (
        lambda tmp: [
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            str(tmp),
            "--trainer.strategy",
            "PipelineParallelStrategy",
            "--ckpt_path",
            _fake_checkpoint(tmp, hyper_parameters=False),
        ],
        ("--ckpt_path=", "fake.ckpt", "resumes from the sharded checkpoint folder"),
    ),
    # an existing folder or file that holds no tokenizer was a 94-line traceback from transformers
    "tokenizer_folder_without_a_tokenizer": (
        _fit("--data.init_args.tokenizer", "{tmp}"),
        ("data.init_args.tokenizer=", "the folder holds no tokenizer", "save_pretrained"),
    ),
    "tokenizer_that_is_a_file": (
        lambda tmp: _fit("--data.init_args.tokenizer", _file(tmp, "tok.json", "{}"))(tmp),
        ("data.init_args.tokenizer=", "a file, not a tokenizer folder"),
    ),
    "cache_dir_with_memory_storage": (
        _fit("--data.init_args.storage", "memory", "--data.init_args.cache_dir", "{tmp}/c"),
        ("data.init_args.cache_dir=", "acts only when data.init_args.storage is cache or auto"),
    ),
    # --- trainer ----------------------------------------------------------------------------------
    "accumulate_zero_batches": (_fit("--trainer.accumulate_grad_batches", "0"), ("trainer.accumulate_grad_batches=0",)),
    "zero_max_steps": (_fit("--trainer.max_steps", "0"), ("trainer.max_steps=0", "at least 1 step")),
    # Lightning raised both from inside Trainer (a stack trace), the second at the fit's start
    "barebones_with_logging": (
        _fit("--trainer.barebones", "true"),
        ("trainer.log_every_n_steps=5", "trainer.barebones turns it off: set it to 0"),
    ),
    "barebones_with_a_checkpoint_callback": (
        _fit("--trainer.barebones", "true", "--trainer.log_every_n_steps", "0"),  # the row above's fix
        ("trainer.callbacks='lightning.pytorch.callbacks.ModelCheckpoint'", "turns checkpointing off"),
    ),
    "gpu_accelerator_without_gpu": (
        _fit("--trainer.accelerator", "gpu"),
        ("trainer.accelerator='gpu'", "no CUDA device"),
    ),
    # Lightning's own refusals of these were stack traces from Trainer.__init__, or came after step 1
    "unknown_accelerator": (_fit("--trainer.accelerator", "cpuu"), ("trainer.accelerator='cpuu'", "auto, cpu, cuda")),
    "accelerator_without_its_device": (
        _fit("--trainer.accelerator", "tpu"),
        ("trainer.accelerator='tpu'", "no tpu device"),
    ),
    "negative_devices": (_fit("--trainer.devices", "-2"), ("trainer.devices='-2'", "a positive number of devices")),
    "devices_in_words": (_fit("--trainer.devices", "two"), ("trainer.devices='two'", "a list of device ids")),
    "zero_nodes": (_fit("--trainer.num_nodes", "0"), ("trainer.num_nodes=0", "a positive number of nodes")),
    # waited for the other node, silently, until killed
    "nodes_without_a_launcher": (
        _fit("--trainer.num_nodes", "2", "--trainer.strategy", "ddp"),
        ("trainer.num_nodes=2", "no launcher started this process", "srun or torchrun"),
    ),
    "zero_val_check_interval": (
        _fit("--trainer.val_check_interval", "0"),
        ("trainer.val_check_interval=0", "positive"),
    ),
    # these trained nothing and exited 0
    "zero_train_batches": (
        _fit("--trainer.limit_train_batches", "0"),
        ("trainer.limit_train_batches=0", "trains nothing"),
    ),
    "zero_max_epochs": (_fit("--trainer.max_epochs", "0"), ("trainer.max_epochs=0", "at least 1 epoch")),
    # accepted without a word: clipping silently off, decay growing the weights, "median after -1 warm-up steps"
    "negative_clip_value": (_fit("--trainer.gradient_clip_val", "-1"), ("trainer.gradient_clip_val=-1", "0 / null")),
    "negative_weight_decay": (_fit("--model.init_args.weight_decay", "-0.1"), ("model.init_args.weight_decay=-0.1",)),
    "negative_record_warmup": (_fit("--recorder.warmup_steps", "-1"), ("recorder.warmup_steps=-1", "0 or more")),
    # --- optimizer: refused when the optimizer was built, after the ranks started and the model was built ---
    "beta_of_one_or_more": (
        _fit("--model.init_args.betas", "[0.9, 1.5]"),
        ("model.init_args.betas=[0.9, 1.5]", "[0, 1)"),
    ),
    "unknown_optimizer_option": (
        _fit("--model.init_args.optimizer_options", '{"epss": 1e-8}'),
        ("model.init_args.optimizer_options.epss=", "did you mean model.init_args.optimizer_options.eps"),
    ),
    "optimizer_option_the_class_refuses": (
        _fit("--model.init_args.optimizer_options", '{"eps": -1}'),
        ("model.init_args.optimizer_options={'eps': -1}", "Invalid epsilon value"),
    ),
    "fit_mesh_not_the_world_size": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.init_args.dp_replicate",
            "2",
            "--trainer.strategy.init_args.dp_shard",
            "2",
        ),
        ("trainer.strategy.init_args", "multiply to 4", "world size", "is 2"),
    ),
    "ep_larger_than_the_world_size": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.class_path",
            "lit_ablate.strategies.ExpertParallelStrategy",
            "--trainer.strategy.init_args.ep",
            "4",
        ),
        ("trainer.strategy.init_args.ep=4", "cannot exceed the world size (2 ranks"),
    ),
    "fused_adamw_clipped_in_mixed_precision": (
        _fit(
            "--trainer.precision",
            "bf16-mixed",
            "--trainer.gradient_clip_val",
            "1.0",
            "--model.init_args.optimizer_options",
            "{fused: true}",
        ),
        ("model.init_args.optimizer_options.fused=True", "refuses to clip for a fused optimizer"),
    ),
    "unknown_strategy_name": (
        _fit("--trainer.strategy", "lit_ablate.strategies.FSDP3Strategy"),
        ("trainer.strategy='lit_ablate.strategies.FSDP3Strategy'", "not a strategy", "did you mean FSDP2Strategy?"),
    ),
    "strategy_refusal_inside_a_union": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.init_args.activation_checkpointing",
            "full",
            "--trainer.strategy.init_args.checkpoint_every",
            "0",
        ),
        ("trainer.strategy.init_args.checkpoint_every=0", "use 1 or more"),
    ),
    # --- keys that only act together with another's value: refused where they would be ignored ---------
    "cp_option_without_cp": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.class_path",
            "lit_ablate.strategies.MeshParallelStrategy",
            "--trainer.strategy.init_args.cp_layout",
            "contiguous",
        ),
        (
            "trainer.strategy.init_args.cp_layout='contiguous'",
            "acts only when trainer.strategy.init_args.cp is not 1 (here 1)",
        ),
    ),
    "compile_backend_without_compile_layers": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.init_args.compile_backend",
            "aot_eager",
        ),
        (
            "trainer.strategy.init_args.compile_backend='aot_eager'",
            "acts only when trainer.strategy.init_args.compile_layers is true",
        ),
    ),
    "unknown_compile_backend": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.init_args.compile_layers",
            "true",
            "--trainer.strategy.init_args.compile_backend",
            "inductr",
        ),
        ("trainer.strategy.init_args.compile_backend='inductr'", "use inductor"),
    ),
    "powersgd_rank_without_powersgd": (
        _fit(
            "--trainer.strategy", "lit_ablate.strategies.DDPStrategy", "--trainer.strategy.init_args.powersgd_rank", "4"
        ),
        ("trainer.strategy.init_args.powersgd_rank=4", "comm_hook is powersgd"),
    ),
    "study_slurm_block_without_the_slurm_executor": (
        _study(
            {
                "name": "local",
                "base": QUICKSTART,
                "steps": 1,
                "axes": {"data.init_args.batch_size": [2, 4]},
                "launch": {"slurm": {"partition": "cpu"}},
            }
        ),
        ("launch.slurm={'partition': 'cpu'}", "acts only when launch.executor is 'slurm' (here 'local')"),
    ),
    "no_wait_on_a_local_study": (
        lambda tmp: [
            *_study({"name": "local", "base": QUICKSTART, "steps": 1, "axes": {"data.init_args.batch_size": [2, 4]}})(
                tmp
            ),
            "--no-wait",
        ],
        ("--no-wait=True", "acts only when launch.executor is 'slurm'"),
    ),
    # --- the model's shape against the mesh, and the batches: refused before any rank starts ------------
    "ep_not_dividing_the_experts": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.class_path",
            "lit_ablate.strategies.ExpertParallelStrategy",
            "--trainer.strategy.init_args.ep",
            "2",
            "--model.init_args.model.preset",
            "tiny-qwen3-moe",
            "--model.init_args.model.moe",
            '{"experts": "grouped"}',
            "--model.init_args.model.config",
            '{"num_experts": 3}',
        ),
        ("trainer.strategy.init_args.ep=2", "3 experts per layer", "divides 3"),
    ),
    "tp_not_dividing_the_heads": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.class_path",
            "lit_ablate.strategies.TensorParallelStrategy",
            "--trainer.strategy.init_args.tp",
            "2",
            "--trainer.strategy.init_args.dp_shard",
            "1",
            "--model.init_args.model.config",
            '{"num_key_value_heads": 1}',
        ),
        ("trainer.strategy.init_args.tp=2", "num_key_value_heads is 1"),
    ),
    "more_stages_than_layers": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy",
            "PipelineParallelStrategy",
            "--model.init_args.model.config",
            '{"num_hidden_layers": 1}',
        ),
        ("trainer.strategy.init_args.pp=2", "1 decoder layers", "at most 1 stages"),
    ),
    "split_points_outside_the_layers": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy",
            "PipelineParallelStrategy",
            "--trainer.strategy.init_args.split_points",
            "[4]",
        ),
        ("trainer.strategy.init_args.split_points=[4]", "between 1 and 3"),
    ),
    "microbatches_not_dividing_the_batch": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy",
            "PipelineParallelStrategy",
            "--trainer.strategy.init_args.microbatches",
            "3",
        ),
        ("trainer.strategy.init_args.microbatches=3", "batch_size is 4"),
    ),
    "context_parallel_attention_dropout": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy",
            "ContextParallelStrategy",
            "--model.init_args.model.config",
            '{"attention_dropout": 0.1}',
        ),
        ("model.init_args.model.config.attention_dropout=0.1", "no dropout"),
    ),
    "context_parallel_dpo": (
        _args(
            "fit",
            "--config",
            DPO_TINY,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ContextParallelStrategy",
        ),
        ("trainer.strategy.init_args.cp=2", "DPO's per-sequence log-probs", "cp: 1"),
    ),
    "sequence_parallel_on_padded_sft_batches": (
        _args(
            "fit",
            "--config",
            SFT,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "TensorParallelStrategy",
            "--trainer.strategy.init_args.sequence_parallel",
            "true",
        ),
        ("data.init_args.collator=None", "multiple of 2", "pad_to_multiple_of: 2"),
    ),
    # --- schedules and DPO's reference ------------------------------------------------------------
    "negative_min_lr_ratio": (
        _fit("--model.init_args.min_lr_ratio", "-0.33"),
        ("model.init_args.min_lr_ratio=-0.33", "[0, 1]"),
    ),
    "unknown_lr_schedule": (
        _fit("--model.init_args.lr_schedule", "exp"),
        ("model.init_args.lr_schedule='exp'", "one of ['linear', 'cosine', 'constant', 'wsd']"),
    ),
    "missing_reference_model": (
        _args(
            "fit",
            "--config",
            DPO_TINY,
            "--trainer.default_root_dir",
            "{tmp}",
            "--model.init_args.reference_model",
            "{tmp}/sft",
        ),
        ("model.init_args.reference_model=", "sft'", "no such directory"),
    ),
    "cp_block_kernel_without_its_gpu": (
        _args(
            "fit",
            "--config",
            FSDP2,
            "--trainer.default_root_dir",
            "{tmp}",
            "--trainer.strategy.class_path",
            "lit_ablate.strategies.ContextParallelStrategy",
            "--trainer.strategy.init_args.dp_shard",
            "1",
            "--trainer.strategy.init_args.cp_block_kernel",
            "flex",
        ),
        ("trainer.strategy.init_args.cp_block_kernel='flex'", "CUDA only", "sdpa"),
    ),
    # --- generate ---------------------------------------------------------------------------------
    "generate_zero_new_tokens": (_args(*GENERATE, "--max_new_tokens", "0"), ("--max_new_tokens=0",)),
    "generate_negative_new_tokens": (_args(*GENERATE, "--max_new_tokens", "-3"), ("--max_new_tokens=-3",)),
    "generate_negative_temperature": (_args(*GENERATE, "--temperature", "-1"), ("--temperature=-1.0",)),
    "generate_top_k_zero": (_args(*GENERATE, "--temperature", "1", "--top_k", "0"), ("--top_k=0",)),
    "generate_empty_prompt": (_args("generate", "--ckpt_path", "{tmp}/missing.ckpt", "--prompt", ""), ("--prompt=''",)),
    "generate_wrong_type": (_args(*GENERATE, "--max_new_tokens", "many"), ("max_new_tokens='many'", "expected int")),
    # --- estimate ---------------------------------------------------------------------------------
    # jsonargparse blamed the study's first key as an option fit does not take
    "fit_given_a_study_file": (
        _args("fit", "--config", str(CONFIGS / "studies" / "depth_grid.yaml")),
        ("--config=", "depth_grid.yaml", "a study file", "lit-ablate ablate --config"),
    ),
    # the fix was vary: [trainer.strategy] whatever the variants changed (a second refusal once followed)
    "study_variants_without_vary": (
        _study(
            {
                "name": "v",
                "base": QUICKSTART,
                "variants": [
                    {"name": "a", "overrides": {"data.init_args.batch_size": 2}},
                    {"name": "b", "overrides": {"data.init_args.batch_size": 4}},
                ],
            }
        ),
        ("vary=None", "here vary: ['data.init_args.batch_size']"),
    ),
    "study_whose_base_is_a_study": (
        _study(
            {
                "name": "b",
                "base": str(CONFIGS / "studies" / "depth_grid.yaml"),
                "axes": {"data.init_args.batch_size": [2, 4]},
            }
        ),
        ("base=", "a study file, not a fit config", "'../quickstart.yaml'"),
    ),
    "estimate_missing_config": (_args("estimate", "--config", "{tmp}/missing.yaml"), ("--config", "missing.yaml")),
    "estimate_config_not_yaml": (
        lambda tmp: ["estimate", "--config", _file(tmp, "bad.yaml", "trainer: [a\n")],
        ("--config", "not valid YAML"),
    ),
    "estimate_unknown_key": (
        _args("estimate", "--config", QUICKSTART, "--trainer.max_stepz", "3"),
        ("trainer.max_stepz",),
    ),
    "estimate_zero_world_size": (_args("estimate", "--config", QUICKSTART, "--world_size", "0"), ("--world_size=0",)),
    "estimate_negative_gpu_memory": (
        _args("estimate", "--config", QUICKSTART, "--gpu_memory_gib", "-1"),
        ("--gpu_memory_gib=-1.0",),
    ),
    "estimate_usable_fraction_above_one": (
        _args("estimate", "--config", QUICKSTART, "--usable_fraction", "2"),
        ("--usable_fraction=2.0",),
    ),
    "estimate_mesh_not_the_world_size": (
        _args("estimate", "--config", FSDP2, "--world_size", "3", "--trainer.strategy.init_args.dp_shard", "2"),
        ("trainer.strategy.init_args", "multiply to 2", "world size", "is 3"),
    ),
    # --- ablate -----------------------------------------------------------------------------------
    "study_not_yaml": (
        lambda tmp: ["ablate", "--config", _file(tmp, "study.yaml", "name: x\nbase: [a\n"), "--dry-run"],
        ("--config=", "study.yaml", "not valid YAML"),
    ),
    "study_where_no_variant_resolves": (
        _study(
            {"name": "broken", "base": QUICKSTART, "steps": 1, "axes": {"data.init_args.batch_size": ["abc", "xyz"]}}
        ),
        ("variants=['abc', 'xyz']", "no variant's config can run", "data.init_args.batch_size='abc'"),
    ),
    # a bad variant refuses the whole study before its first run (the others trained first, and it exited 0)
    "study_variant_with_a_value_of_the_wrong_type": (
        _study({"name": "typo", "base": QUICKSTART, "steps": 1, "axes": {"data.init_args.batch_size": [2, "abc"]}}),
        ("variants=['abc']", "nothing ran", "data.init_args.batch_size='abc'", "expected int"),
    ),
    "study_variant_that_fit_would_refuse": (
        _study(
            {
                "name": "named",
                "base": QUICKSTART,
                "steps": 1,
                "axes": {"trainer.strategy": ["auto", "lit_ablate.strategies.FSDP3Strategy"]},
            }
        ),
        ("variants=['lit_ablate.strategies.FSDP3Strategy']", "config refused: trainer.strategy=", "not a strategy"),
    ),
    "study_variant_with_an_unknown_accelerator": (
        _study({"name": "acc", "base": QUICKSTART, "steps": 1, "axes": {"trainer.accelerator": ["cpu", "cpuu"]}}),
        ("variants=['cpuu']", "nothing ran", "trainer.accelerator='cpuu'"),
    ),
    "study_unwritable_output_dir": (
        lambda tmp: [
            "ablate",
            "--config",
            str(CONFIGS / "studies" / "depth_grid.yaml"),
            "--output_dir",
            _text_file(tmp) + "/out",
        ],
        ("--output_dir=", "cannot write"),
    ),
}


def _stderr_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, list[str]]:
    """``(exit code, non-empty stderr lines)`` of ``lit-ablate argv``; a string exit code is what
    Python prints to stderr on exit (status 1)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    code, err = exit_info.value.code, capsys.readouterr().err
    if isinstance(code, str):
        code, err = 1, err + code + "\n"
    return code, [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank started by Lightning's launcher, or a study's run, fails the row: its refusal must come first."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lit_ablate.commands import ablate

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the ranks or the study's runs started before the refusal")

    monkeypatch.setattr(_SubprocessScriptLauncher, "launch", started)
    monkeypatch.setattr(ablate, "run_runs", started)
    for name in NODE_LAUNCH_ENV:  # the suite run inside a SLURM job: a launcher's variables would let num_nodes 2 wait
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_is_one_line_naming_the_key(
    row: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], nothing_runs: None
) -> None:
    build, expected = ROWS[row]
    if row == "gpu_accelerator_without_gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the row needs one that has none")
    argv = build(tmp_path)
    inputs = _tree(tmp_path)
    code, lines = _stderr_lines(argv, capsys)
    assert code not in (0, None), lines
    assert len(lines) == 1, lines
    missing = [fragment for fragment in expected if fragment not in lines[0]]
    assert not missing, f"{missing} not in: {lines[0]}"
    left = sorted(_tree(tmp_path) - inputs)
    if row in RECORDED_ROWS:  # refused once the trainer exists: the run's record of its error, and nothing else
        left = [path for path in left if not path.endswith("run.json") and not _is_record_folder(tmp_path / path)]
    assert not left, f"the refusal left {left} behind"


RECORDED_ROWS = (
    "malformed_jsonl_line",
    "truncated_jsonl_line",
    "chat_message_without_content",
    "chat_message_with_null_content",
    "sft_row_without_response",
    "missing_reference_model",
)
"""Rows refused once the trainer exists (data set-up, the model's build): such a run leaves its
``run.json`` with ``status: error`` by design (``test_an_error_before_training_still_writes_the_run_record``)."""


def _tree(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*")}


def _is_record_folder(path: Path) -> bool:
    """A folder on the way to a run record (``lightning_logs/version_0``)."""
    return path.is_dir() and any(p.name == "run.json" for p in path.rglob("*"))


# One bad config per command: every command answers a usage or config error with EXIT_USAGE (2).
BAD_CONFIG_PER_COMMAND: dict[str, Build] = {
    "fit": _fit("--trainer.max_steps", "0"),
    "validate": _args("validate", "--config", QUICKSTART, "--ckpt_path", "{tmp}/missing.ckpt"),
    "test": _args("test", "--config", QUICKSTART, "--ckpt_path", "{tmp}/missing.ckpt"),
    "generate": _args(*GENERATE),
    "export": _args("export", "--ckpt_path", "{tmp}", "--output_dir", "{tmp}/hf"),
    "estimate": _args("estimate", "--config", QUICKSTART, "--world_size", "0"),
    "peak": _args("peak", "--device", "tpu"),
    "ablate": lambda tmp: ["ablate", "--config", _file(tmp, "study.yaml", "name: x\nbase: [a\n"), "--dry-run"],
    "report": _args("report", "{tmp}/no_study"),
}


@pytest.mark.parametrize("command", list(BAD_CONFIG_PER_COMMAND))
def test_every_command_exits_2_for_a_config_error(command: str, tmp_path: Path, capsys) -> None:
    """Exit codes were 1 for fit and generate, 2 for export and ablate, for the same kind of mistake;
    now every command's config error is ``EXIT_USAGE``. Seen failing (code 1) for fit, validate, test,
    generate, export and peak with ``main`` refusing with status 1 (``sys.exit(message)`` had that status)."""
    assert set(BAD_CONFIG_PER_COMMAND) == set(SUMMARIES), "a command without its row here"
    code, lines = _stderr_lines(BAD_CONFIG_PER_COMMAND[command](tmp_path), capsys)
    assert code == EXIT_USAGE, lines
    assert lines, "the refusal says why"


class FailsAtTheFirstStep(Callback):
    """A run that fails after it started (not a config error)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        raise RuntimeError("a failure during the run")


def _real_process(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_ablate.cli", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        timeout=300,
    )


def test_a_failure_during_a_run_exits_1_and_a_wrong_multi_rank_config_prints_once(tmp_path: Path) -> None:
    """A failure during a run exits ``EXIT_FAILURE`` (1) with its traceback; a config error only the ranks
    can see (a vocabulary smaller than the tokenizer's, found when each of 2 FSDP2 ranks builds the
    model) is printed by rank 0 alone and exits 2. Seen failing (the error printed once per rank) with
    every rank printing its refusal."""
    failed = _real_process(
        [
            *FIT,
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.callbacks+=tests.test_bad_inputs.FailsAtTheFirstStep",
        ],
        tmp_path,
    )
    assert failed.returncode == EXIT_FAILURE, failed.stderr
    assert "RuntimeError: a failure during the run" in failed.stderr
    ranks = _real_process(
        [
            "fit",
            "--config",
            FSDP2,
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--model.init_args.model.config",
            '{"vocab_size": 100}',
        ],
        tmp_path,
    )
    errors = [line for line in ranks.stderr.splitlines() if "error:" in line]
    assert ranks.returncode == EXIT_USAGE and len(errors) == 1, ranks.stderr
    assert "model.init_args.model.config.vocab_size=100" in errors[0]


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["estimate", "--config", "missing.yaml"], "--config"),
        ([*FIT, "--model.init_args.model.config", '{"num_hidden_layers": 0}'], "config.num_hidden_layers=0"),
        (
            [
                *FIT,
                "--data.init_args.source",
                '{"class_path": "lit_ablate.data.LocalFiles", "init_args": {"path": "bad.jsonl"}}',
            ],
            "line 2 of bad.jsonl",
        ),
    ],
)
def test_a_real_process_prints_one_line(argv: list[str], key: str, tmp_path: Path) -> None:
    """What a user's terminal shows, loggers included (in-process, Lightning's log handlers write
    past capsys): ``estimate`` printed 98 lines of traceback, ``fit`` a "Seed set to 0" line before
    the error, and an error in data set-up came after Lightning's "GPU available: False" and "TPU
    available: False" lines (only a device the machine has may keep its line). The process runs as on
    a SLURM login node, an ``srun`` on PATH and no job around it: Lightning's "The `srun` command is
    available on your system but is not used" warning, printed on every run there, is filtered
    (``lit_ablate.import_warnings``); seen failing (two lines) without the filter."""
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{bad json\n')
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    for name in [n for n in env if n.startswith("SLURM_")]:
        del env[name]
    done = subprocess.run(
        [sys.executable, "-m", "lit_ablate.cli", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    lines = [
        line for line in done.stderr.splitlines() if line.strip() and not re.match(r"[GT]PU available: True", line)
    ]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert key in lines[0]


@pytest.mark.parametrize("failure", ["data_set_up", "model_build"])
def test_an_error_before_training_still_writes_the_run_record(failure: str, tmp_path: Path, capsys) -> None:
    """A fit that fails in data set-up (a bad chat row) or in the model build (a vocabulary smaller
    than the tokenizer's) still leaves run.json with status error and the one-line message, as the
    record's contract promises (it used to be written only from on_fit_start on)."""
    record = tmp_path / "run.json"
    if failure == "data_set_up":
        argv = [
            *_sft_file({"messages": [*CHAT, {"role": "assistant", "content": None}]})(tmp_path),
            "--recorder.path",
            str(record),
        ]
        key = "data.init_args.source row 1 messages[1]"
    else:
        argv = [
            *_fit("--model.init_args.model.config", '{"vocab_size": 100}')(tmp_path),
            "--recorder.path",
            str(record),
        ]
        key = "model.init_args.model.config.vocab_size=100"
    code, lines = _stderr_lines(argv, capsys)
    assert code not in (0, None) and key in lines[-1]
    summary = read_record(record)["summary"]
    assert summary["status"] == "error"
    assert key in summary["message"] and summary["message"].startswith("ConfigError: ")


def test_a_file_mixing_chat_and_prompt_response_rows_trains_both(tmp_path: Path) -> None:
    """``datasets`` gives every row every column (a prompt/response row has ``messages: None``): each
    row must still be read in its own form, giving exactly the examples of the two files apart."""
    chat = {"messages": [*CHAT, {"role": "assistant", "content": "2"}]}
    pair = {"prompt": "3+4=", "response": "7"}
    tok = load_tokenizer("byte")

    def examples(name: str, rows: list[dict]) -> list[list[int]]:
        path = _file(tmp_path, name, "".join(json.dumps(r) + "\n" for r in rows))
        return [e["labels"].tolist() for e in build_examples(LocalFiles(path), tok, "sft", 64, "truncate")]

    mixed = examples("mixed.jsonl", [chat, pair, chat])
    assert mixed == [*examples("chat.jsonl", [chat]), *examples("pair.jsonl", [pair]), *examples("chat2.jsonl", [chat])]
    assert all(any(label != -100 for label in labels) for labels in mixed)  # each row kept its answer


def test_overlong_truncate_says_how_many_it_dropped(caplog) -> None:
    """Truncation drops an example whose labels all fall past seq_len; the log must count those as
    dropped, not claim it kept the first seq_len tokens of every overlong example."""
    rows = [
        {"prompt": "1+1=", "response": "2"},
        {"prompt": "long prompt: ", "response": "a much longer answer"},
        {"prompt": "x" * 40, "response": "y"},
    ]
    with caplog.at_level(logging.WARNING, logger="lit_ablate.data.formats"):
        kept = build_examples(rows, load_tokenizer("byte"), "sft", 16, "truncate")
    assert len(kept) == 2
    assert (
        "2 of 3 examples were longer than seq_len=16; overlong=truncate kept the first 16 tokens of 1 "
        "and dropped 1 with no labelled token left" in caplog.text
    )


def test_the_fix_of_sequence_parallelism_s_refusal_is_accepted() -> None:
    """The refusal of sequence parallelism on padded SFT batches names a key that exists
    (``data.init_args.collator``) and a value that passes every check: the same config with it set is not
    refused again. Seen failing while the fix named ``data pad_to_multiple_of`` (no such key)."""
    from lit_ablate.fit_cli import resolve_fit_config
    from lit_ablate.rules import check_run

    tensor_parallel = [
        "--config",
        SFT,
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "TensorParallelStrategy",
        "--trainer.strategy.init_args.sequence_parallel",
        "true",
    ]
    with pytest.raises(ConfigError, match=r"data\.init_args\.collator=None: .*pad_to_multiple_of: 2"):
        check_run(resolve_fit_config(tensor_parallel))
    fixed = '{"class_path": "lit_ablate.data.PaddingCollator", "init_args": {"pad_to_multiple_of": 2}}'
    check_run(resolve_fit_config([*tensor_parallel, "--data.init_args.collator", fixed]))


def test_a_study_skips_a_variant_the_model_s_shape_refuses(tmp_path: Path) -> None:
    """The rules that refuse ``fit`` before its ranks start (here tp not dividing the key/value heads) skip a
    study's variant with the same line before any run starts. Seen failing with the rule left out of
    ``RULES`` (the variant planned to run, to be refused by its ranks)."""
    from lit_ablate.ablation.plan import plan_study
    from lit_ablate.ablation.spec import parse_study

    tensor_parallel = {
        "class_path": "lit_ablate.strategies.TensorParallelStrategy",
        "init_args": {"tp": 2, "dp_shard": 1},
    }
    study = parse_study(
        {
            "name": "tp",
            "base": FSDP2,
            "steps": 1,
            "vary": ["trainer.strategy"],
            "overrides": {"model.init_args.model.config": {"num_key_value_heads": 1}},
            "variants": [{"name": "fsdp2"}, {"name": "tp2", "overrides": {"trainer.strategy": tensor_parallel}}],
        }
    )
    runs = {run.variant.name: run for run in plan_study(study, tmp_path / "study")}
    assert runs["fsdp2"].skip_reason is None and runs["tp2"].invalid is None
    assert runs["tp2"].skip_reason == (
        "trainer.strategy.init_args.tp=2: the model's num_key_value_heads is 1; use a tp that divides it"
    )
