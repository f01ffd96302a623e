"""``LitAblateCLI``: the LightningCLI behind ``lit-ablate fit``/``validate``/``test``.

Model, data, strategy and callbacks from YAML (``class_path``/``init_args``), every key overridable
(``--trainer.max_steps 20``). It always adds a ``RunRecorder`` (configured under ``recorder:``) so every
run leaves a run record. ``resolve_fit_config`` is the same parser without running anything (what
studies and ``lit-ablate estimate`` read).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_ablate.callbacks.pipeline_bubble import PipelineBubbleMonitor
from lit_ablate.callbacks.progress_file import PROGRESS_PATH_ENV, ProgressFile
from lit_ablate.callbacks.run_recorder import RunRecorder
from lit_ablate.callbacks.turn_taking import TurnTaking
from lit_ablate.checkpoint_model import check_same_model, checkpoint_model_section
from lit_ablate.command_table import SUMMARIES
from lit_ablate.cpu_half_matmuls import slow_bf16_matmuls
from lit_ablate.errors import quoted_refusal
from lit_ablate.no_profiler import NoProfiler
from lit_ablate.rules import check_parts, check_run
from lit_ablate.rules.paths import checkpoint_is_a_checkpoint
from lit_ablate.run_config import RunConfig
from lit_ablate.simulated_rank import SIMULATE_KEY, SIMULATE_RANK_KEY, SimulatedRank
from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy
from lit_ablate.strategies.simulation import simulated_trainer_arguments, start_fake_process_group
from lit_ablate.strategies.whole_checkpoint import WholeCheckpointIO
from lit_ablate.terminal import console_trainer_args, silence_noise

SEED_LOGGER = "lightning.fabric.utilities.seed"
"""The logger of Lightning's ``seed_everything`` (its "Seed set to N" line)."""
PARSER_KWARGS = {"exit_on_error": False, "allow_abbrev": False}
"""Every parser raises instead of exiting (``main`` prints one line, not a usage dump) and takes
options only by their full name."""


class LitAblateCLI(LightningCLI):
    """LightningCLI with lit-ablate's defaults: any LightningModule/DataModule by class_path,
    a run record for every run, and the resolved config handed to it.

    ``--simulate W [--simulate_rank R]`` (config keys ``simulate``, ``simulate_rank``): this one process
    plays rank R of the configured mesh on W ranks over a fake process group (docs/simulation.md).
    """

    simulation: SimulatedRank | None = None
    """The rank this run plays when ``simulate`` is set."""
    left_process_group = False
    """Whether the run joined a process group (and left it, ``after_fit``): its process then exits without
    the interpreter's finalization (``lit_ablate.process_exit``)."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            # Raise instead of exiting so main() can print one line instead of a usage dump.
            parser_kwargs={
                **PARSER_KWARGS,
                **{c: {**PARSER_KWARGS, "description": SUMMARIES[c]} for c in self.subcommands()},
            },
            args=args,
            run=run,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test``; not ``predict``. Lightning's predict runs a
        ``predict_step`` over a prediction dataloader and returns its outputs in memory: for a causal
        LM that means a second, batch-shaped inference path (prompts as a data set, a decoding
        loop, a writer) beside ``generate``, which already turns a prompt into text with the run's
        tokenizer, and ``export``, which hands the model to Hugging Face tooling for batch
        inference. A command that only crashes (``Trainer.predict requires forward method``) or
        duplicates those is worse than none, so the CLI does not offer it."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(RunRecorder, "recorder")
        parser.add_argument(
            f"--{SIMULATE_KEY}",
            type=int | None,
            default=None,
            help="play one rank of a job of this many ranks over a fake process group (one process; "
            "docs/simulation.md)",
        )
        parser.add_argument(f"--{SIMULATE_RANK_KEY}", type=int, default=0, help="the rank --simulate plays")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, printing and writing only what informs (``lit_ablate.terminal``).

        Where the config leaves ``trainer.logger`` unset: fit logs CSV under ``default_root_dir``
        (Lightning's own choice without TensorBoard, made explicit so it does not warn about it);
        validate and test print their metrics and write nothing (no logger, no saved config), so
        evaluating a checkpoint adds no ``lightning_logs/version_N`` beside the run that wrote it.
        Where it leaves ``trainer.profiler`` unset: ``NoProfiler`` (Lightning's default, minus its cost per hook).
        """
        silence_noise()
        trainer_args = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        configured = trainer_args.get("callbacks") or []
        callbacks = list(configured) if isinstance(configured, list) else [configured]
        if self.simulation is not None:  # one rank of a larger job: no checkpoint, no validation
            callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
            kwargs.update(simulated_trainer_arguments(self.simulation))
            kwargs["plugins"] = [*_as_list(trainer_args.get("plugins")), *kwargs["plugins"]]
        if self._reads_sharded_folder_whole(trainer_args.get("strategy")):
            kwargs["plugins"] = [*_as_list(trainer_args.get("plugins")), WholeCheckpointIO()]
        if self.subcommand in ("validate", "test"):
            self.save_config_callback = None
            if trainer_args.get("logger") is None:
                kwargs["logger"] = False
        elif trainer_args.get("logger") is None and not trainer_args.get("barebones"):  # barebones: no logger
            kwargs["logger"] = CSVLogger(save_dir=trainer_args.get("default_root_dir") or os.getcwd())
        kwargs.update(console_trainer_args(trainer_args, callbacks))
        if trainer_args.get("profiler") is None and not trainer_args.get("barebones"):
            kwargs["profiler"] = NoProfiler()
        trainer = super().instantiate_trainer(**kwargs)
        if isinstance(trainer.strategy, PipelineParallelStrategy) and not any(
            isinstance(c, PipelineBubbleMonitor) for c in trainer.callbacks
        ):
            trainer.callbacks.append(PipelineBubbleMonitor())  # the bubble belongs in every pipeline run's record
        if self.subcommand == "fit" and os.environ.get(PROGRESS_PATH_ENV):  # a study's run: its live progress line
            trainer.callbacks.append(ProgressFile(os.environ[PROGRESS_PATH_ENV]))
        turns = TurnTaking.from_environment() if self.subcommand == "fit" else None
        if turns is not None:  # a study's run in turns: first, so it waits before any callback measures
            trainer.callbacks.insert(0, turns)
        return trainer

    def _reads_sharded_folder_whole(self, strategy: Any) -> bool:
        """Whether ``--ckpt_path`` is a sharded folder that ``strategy`` reads as one file (one process, DDP):
        it then gets ``WholeCheckpointIO``, which reads the folder whole. Mesh strategies and FSDP1 read
        their shards of it themselves."""
        from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

        ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
        reads_shards = isinstance(strategy, (ModelParallelStrategy, FSDPStrategy, DeepSpeedStrategy))
        return bool(ckpt_path) and Path(ckpt_path).expanduser().is_dir() and not reads_shards

    def _set_seed(self) -> None:
        """Lightning's seeding without its "Seed set to N" log line: the seed is in the config and the
        run record, and a config refused right after (``before_instantiate_classes``, a model shape)
        would otherwise print two lines instead of its one."""
        seed_log = logging.getLogger(SEED_LOGGER)
        level = seed_log.level
        seed_log.setLevel(logging.WARNING)
        try:
            super()._set_seed()
        finally:
            seed_log.setLevel(level)

    def _parse_ckpt_path(self) -> None:
        """Replaces LightningCLI's, which lets a checkpoint's hyper-parameters override the config's
        model section without a word: here a checkpoint (file or sharded folder) whose model differs
        from the config's is refused naming every differing key, and a matching one leaves the config
        as parsed (``lit_ablate.checkpoint_model``)."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        refusal = checkpoint_is_a_checkpoint(self.config[subcommand]) if ckpt_path else None
        if refusal:
            raise refusal.error()
        section = checkpoint_model_section(ckpt_path) if ckpt_path else None
        if section is not None:
            theirs = self.parser.parse_object({subcommand: {"model": section}}, self.config)[subcommand].model
            check_same_model(self.config[subcommand].model.as_dict(), theirs.as_dict(), ckpt_path)

    def before_instantiate_classes(self) -> None:
        """Refuse, before anything is built or any rank launches, what the rules of the config and of this
        machine refuse (``lit_ablate.rules``). A simulated rank is one process: it joins its fake process
        group here, before Lightning sets up, which then finds it and launches nothing."""
        if self.subcommand is not None:
            run = RunConfig.of(self.config[self.subcommand], subcommand=self.subcommand)  # read once
            check_run(run, self.subcommand)
            slow = slow_bf16_matmuls(run.compute_dtype, run.trainer.device_type)
            if slow:
                rank_zero_warn(f"trainer.precision={run.trainer.precision!r}: {slow}")
            if run.simulation is not None:
                start_fake_process_group(run.simulation)
                self.simulation = run.simulation
                rank_zero_info(run.simulation.first_line)
            if run.trainer.strategy.names_a_class:
                self._strategy_as_section(run.trainer.strategy.section.class_path)

    def _strategy_as_section(self, class_path: str) -> None:
        """``trainer.strategy`` given as a class's path or lit-ablate name (``lit_ablate.strategies.DDPStrategy``,
        ``FSDP2Strategy``) becomes that class's ``class_path`` section, its arguments at their defaults, so
        it is built (and saved in the run's config) as the ``class_path:`` form is: Lightning would read
        the string as a registry name and refuse it."""
        section = {"trainer": {"strategy": {"class_path": class_path}}}
        self.config = self.parser.parse_object({self.subcommand: section}, self.config)

    def before_fit(self) -> None:
        """The built parts' rules (``Scope.BUILT_PARTS``), before the strategy starts any rank."""
        check_parts(self.model, self.trainer.strategy)

    def after_fit(self) -> None:
        """Each rank leaves the process group before its process exits, as torch asks of a normal exit:
        left to interpreter shutdown, gloo's threads aborted a rank ("terminate called without an active
        exception", exit code -6) after its run had finished and its record was written. Every
        collective of the run (the records' gathers included) is over when ``fit`` returns. The groups'
        C++ objects outlive this call all the same: ``main`` ends such a process without finalization."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            self.left_process_group = True

    after_validate = after_test = after_fit

    def after_instantiate_classes(self) -> None:
        self._dump_config()
        for callback in self.trainer.callbacks:
            if isinstance(callback, RunRecorder):
                callback.resolved_config = self.config_dump


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


class _Resolved(Exception):
    """Raised by ``_ParsingCLI`` once it has parsed: the resolved config travels in it."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__("resolved")
        self.config = config


class _ParsingCLI(LitAblateCLI):
    """``LitAblateCLI`` that stops once the arguments are parsed (and, with ``construct``, every class they
    name is made, so each constructor has judged its own arguments): no rule is judged, nothing run."""

    construct = False

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        if self.construct:
            try:
                parser.instantiate_classes(self.config)
            except ValueError as err:  # jsonargparse lists each alternative's failure: a constructor's refusal
                raise quoted_refusal(str(err)) or err from None
        raise _Resolved(yaml.safe_load(parser.dump(self.config, skip_unset=False))[self.config["subcommand"]])


class _ConstructingCLI(_ParsingCLI):
    construct = True


def _parsed(cli: type[_ParsingCLI], args: list[str]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args.*sys.argv.*")  # intentional: args are explicit
        try:
            cli(args=["fit", *args])
        except _Resolved as resolved:
            return resolved.config
    raise AssertionError("the parser returned without resolving")  # parse_arguments always raises


def resolve_fit_config(args: list[str]) -> dict[str, Any]:
    """The resolved config that ``lit-ablate fit <args>`` would run (every default filled in, as
    ``--print_config`` prints it), without running anything."""
    return _parsed(_ParsingCLI, args)


def construct_fit_parts(args: list[str]) -> None:
    """Make every class ``lit-ablate fit <args>`` would make (the module, the data module, the strategy,
    the callbacks; no model is built): ``ConfigError`` for a value a constructor refuses, as ``fit`` refuses
    it once its rules have passed."""
    _parsed(_ConstructingCLI, args)
