"""Every ``lit-ablate`` command: where it lives and its one line in ``lit-ablate --help``.

A table with no imports, so that ``--help`` and ``--version`` answer without loading torch or Lightning.
"""

# command -> "module:function" taking argv (without the command) and returning an exit code.
COMMANDS: dict[str, str] = {
    "ablate": "lit_ablate.commands.ablate:ablate_main",
    "report": "lit_ablate.commands.report:report_main",
    "estimate": "lit_ablate.commands.estimate:estimate_main",
    "peak": "lit_ablate.commands.peak:peak_main",
    "generate": "lit_ablate.commands.generate:generate_main",
    "export": "lit_ablate.commands.export:export_main",
}
# Every command's one line, in the order ``lit-ablate --help`` lists them.
SUMMARIES: dict[str, str] = {
    "fit": "train from a YAML config (any key: --trainer.max_steps 20)",
    "validate": "held-out loss of a checkpoint (--ckpt_path)",
    "test": "held-out loss of a checkpoint, as test/loss (--ckpt_path)",
    "generate": "sample text from a fit checkpoint",
    "ablate": "run a study (variants x seeds, resumable), write its report",
    "report": "re-render a study's report from its run records",
    "estimate": "parameters and per-rank memory of a config, per sharding",
    "peak": "this device's spec peak and measured matmul ceiling",
    "export": "a checkpoint as a Hugging Face folder (weights, tokenizer)",
}
