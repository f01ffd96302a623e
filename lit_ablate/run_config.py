"""``RunConfig``: one run config, read once, as typed values.

LightningCLI (jsonargparse) parses and types a ``fit`` config into ``class_path``/``init_args``
sections. What the rules (``lit_ablate.rules``), the estimator and the study
planner then need to know about the run (its strategy and mesh sizes, the loss and its options,
precision and dtype, fp8, quantisation, the collator and data format, devices and nodes, the
model's section, the simulated rank) is read from that dict here, into the values below, and nowhere
else: no other module digs in the dict by dotted key or builds a strategy to learn a size.

A config read here may be one ``lit-ablate fit`` resolved (every default filled in), a study
variant's merged YAML before it is resolved, or a run record's: what it leaves out reads as the
default the named class takes (``ClassChoice.option``). Classes (and torch) are imported on first
use, so ``RunConfig.of`` is cheap and a study spec can read it; a ``class_path`` that does not import
reads as no class (the run reports it itself when it builds).

The world size and the mesh sizes are resolved here and nowhere else (``RunConfig.world_size``,
``RunConfig.mesh_sizes``): a study's launch is part of the config it merges, and a simulated rank's job
is read with it, so every rule judges a simulated run as it judges a real one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from lit_ablate.class_choice import ClassChoice
from lit_ablate.config_keys import get_dotted
from lit_ablate.errors import ConfigError
from lit_ablate.mesh_sizes import MeshSizes
from lit_ablate.simulated_rank import SIMULATE_KEY, SIMULATE_RANK_KEY, SimulatedRank
from lit_ablate.strategy_choice import StrategyChoice

if TYPE_CHECKING:
    from lit_ablate.models.adapters.quantization import QuantizationOptions
    from lit_ablate.models.factory import ModelFactory
    from lit_ablate.models.fp8.conversion import Fp8Options
    from lit_ablate.models.losses.loss_choice import LossChoice

MODEL_DTYPES = ("float32", "float16", "bfloat16")
GPU_ACCELERATORS = ("gpu", "cuda")
EXECUTORS = ("local", "slurm")
"""How a study starts its runs: ``local`` (a process of its runner each) or ``slurm`` (a job each)."""


BAREBONES_OFF: dict[str, Any] = {
    "enable_checkpointing": False,
    "logger": False,
    "enable_progress_bar": False,
    "log_every_n_steps": 0,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "fast_dev_run": False,
    "detect_anomaly": False,
    "profiler": None,
}
"""The ``trainer`` keys whose features ``barebones: true`` (Lightning's mode for timing its own loop) turns off,
each with the value that asks for nothing (null also does, where the key takes it)."""


@dataclass(frozen=True)
class TrainerSettings:
    """``trainer``: where and how the run runs, as the config gives it (``None``: left to Lightning)."""

    accelerator: str | None = None
    devices: Any = None
    """As given: a count, a digit string (``--trainer.devices 2``), a list of device ids or ``auto``."""
    num_nodes: Any = None
    precision: str = "32-true"
    accumulate_grad_batches: Any = None
    max_steps: Any = None
    max_epochs: Any = None
    limit_train_batches: Any = None
    val_check_interval: Any = None
    gradient_clip_val: Any = None
    default_root_dir: str | None = None
    strategy: StrategyChoice = field(default_factory=StrategyChoice)
    callbacks: tuple[str, ...] = ()
    """The ``class_path`` of each configured callback."""
    barebones: bool = False
    barebones_off: Mapping[str, Any] = field(default_factory=dict)
    """The value the config gives each key of ``BAREBONES_OFF`` (absent: left unset)."""

    @classmethod
    def of(cls, trainer: Mapping[str, Any]) -> TrainerSettings:
        """The ``trainer`` section of a config."""
        return cls(
            accelerator=trainer.get("accelerator"),
            devices=trainer.get("devices"),
            num_nodes=trainer.get("num_nodes"),
            precision=str(trainer.get("precision") or "32-true"),
            accumulate_grad_batches=trainer.get("accumulate_grad_batches"),
            max_steps=trainer.get("max_steps"),
            max_epochs=trainer.get("max_epochs"),
            limit_train_batches=trainer.get("limit_train_batches"),
            val_check_interval=trainer.get("val_check_interval"),
            gradient_clip_val=trainer.get("gradient_clip_val"),
            default_root_dir=trainer.get("default_root_dir"),
            strategy=StrategyChoice(trainer.get("strategy") or "auto"),
            callbacks=tuple(
                c["class_path"]
                for c in _as_list(trainer.get("callbacks"))
                if isinstance(c, Mapping) and isinstance(c.get("class_path"), str)
            ),
            barebones=bool(trainer.get("barebones")),
            barebones_off={key: trainer[key] for key in BAREBONES_OFF if trainer.get(key) is not None},
        )

    @property
    def accelerator_name(self) -> str:
        """The accelerator, ``auto`` when the config leaves it unset (Lightning's default)."""
        return self.accelerator or "auto"

    @property
    def devices_per_node(self) -> int | None:
        """The devices per node when the config counts them (a number, a digit string, a list of ids);
        None when Lightning counts them itself (``auto``)."""
        devices = self.devices
        if isinstance(devices, str) and devices.strip().isdigit():
            return int(devices)
        if isinstance(devices, list):
            return len(devices)
        return devices if isinstance(devices, int) and not isinstance(devices, bool) else None

    @property
    def nodes(self) -> int:
        return int(self.num_nodes or 1)

    @property
    def device_type(self) -> str:
        """``cuda`` or ``cpu``: where the ranks compute (``auto`` is CUDA when this machine has it)."""
        accelerator = self.accelerator_name
        if accelerator == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cuda" if accelerator in GPU_ACCELERATORS else accelerator

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step (``accumulate_grad_batches``; 1 when unset)."""
        return int(self.accumulate_grad_batches or 1)


@dataclass(frozen=True)
class ModelSettings:
    """``model``: the LightningModule (``CausalLM``, ``DPO`` or a subclass) and what it builds and trains with."""

    module: ClassChoice = field(default_factory=lambda: ClassChoice(""))
    """The module's ``class_path`` and its ``init_args``."""
    factory: Mapping[str, Any] | None = None
    """``init_args.model``: the ``ModelFactory`` arguments (preset/config/pretrained, dtype, attention,
    quantisation, fp8, adapter, MoE), as given."""

    @property
    def loss(self) -> LossChoice:
        """The loss backend and its options (``init_args.loss``, ``loss_options``)."""
        from lit_ablate.models.losses.loss_choice import LossChoice

        return LossChoice(
            self.module.init_args.get("loss") or "torch", dict(self.module.init_args.get("loss_options") or {})
        )

    @property
    def optimizer(self) -> str | None:
        """``init_args.optimizer``: the module's own optimizer name (None: its default)."""
        return self.module.init_args.get("optimizer")

    def option(self, name: str, default: Any = None) -> Any:
        """The module's argument ``name`` (``reference``, ``logprobs``, ...), with its class's default."""
        return self.module.option(name, default)

    def _factory_value(self, name: str, default: Any = None) -> Any:
        value = self.factory.get(name) if isinstance(self.factory, Mapping) else None
        return default if value is None else value

    @property
    def dtype(self) -> str:
        """The parameters' dtype (``init_args.model.dtype``)."""
        return str(self._factory_value("dtype", "float32"))

    @property
    def attention(self) -> str:
        """The attention backend (``init_args.model.attn_implementation``)."""
        return str(self._factory_value("attn_implementation", "sdpa"))

    @property
    def adapter_section(self) -> Any:
        """``init_args.model.adapter`` as given (None: no adapters)."""
        return self._factory_value("adapter")

    @property
    def quantization_section(self) -> Any:
        """``init_args.model.quantization`` as given."""
        return self._factory_value("quantization")

    @property
    def fp8_section(self) -> Any:
        """``init_args.model.fp8`` as given."""
        return self._factory_value("fp8")

    @cached_property
    def quantization(self) -> QuantizationOptions | None:
        """The base weights' quantisation; None when absent or malformed (the run's own error when it builds)."""
        from lit_ablate.models.adapters.quantization import QuantizationOptions

        return _options(self.quantization_section, QuantizationOptions)

    @cached_property
    def fp8(self) -> Fp8Options | None:
        """fp8 training; None when absent or malformed (the run's own error when it builds)."""
        from lit_ablate.models.fp8.conversion import Fp8Options

        return _options(self.fp8_section, Fp8Options)

    @cached_property
    def hf_config(self) -> Any | None:
        """The Hugging Face config of the model, as ``ModelFactory`` builds it (from a preset, a config or a
        pretrained folder's ``config.json``, no weights); None for a model section the run itself refuses."""
        try:
            return self.build_factory().hf_config()
        except (ConfigError, TypeError, OSError):
            return None

    def build_factory(self) -> ModelFactory:
        """The ``ModelFactory`` of ``init_args.model`` (which validates it); ``ConfigError`` when there is none."""
        from lit_ablate.models.factory import ModelFactory

        if not isinstance(self.factory, Mapping):
            raise ConfigError(
                "model.init_args.model", self.factory, "give the model to build: preset, config or pretrained"
            )
        return ModelFactory(**self.factory)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]


def _simulation(tree: Mapping[str, Any]) -> SimulatedRank | None:
    """``simulate`` (the job's world size) and ``simulate_rank``; None when the run is not simulated."""
    world_size = tree.get(SIMULATE_KEY)
    return None if world_size is None else SimulatedRank(world_size, tree.get(SIMULATE_RANK_KEY) or 0)


def _options(section: Any, options_class: type) -> Any:
    if not isinstance(section, Mapping):
        return None
    try:
        return options_class(**section)
    except (ConfigError, TypeError):
        return None


@dataclass(frozen=True)
class DataSettings:
    """``data``: the data module's batch shape, format and collator, as given."""

    batch_size: Any = None
    seq_len: Any = None
    format: str | None = None
    collator: ClassChoice | None = None
    module: ClassChoice | None = None
    """The data module's ``class_path`` and ``init_args`` (its other options: ``storage``, ``cache_dir``)."""

    @classmethod
    def of(cls, data: Any) -> DataSettings:
        init_args = (data.get("init_args") or {}) if isinstance(data, Mapping) else {}
        return cls(
            init_args.get("batch_size"),
            init_args.get("seq_len"),
            init_args.get("format"),
            ClassChoice.of(init_args.get("collator")),
            ClassChoice.of(data),
        )

    @property
    def packs_preference_pairs(self) -> bool:
        """Whether the collator packs preference pairs into rows (``PreferencePackingCollator``)."""
        return self.collator is not None and self.collator.class_path.endswith("PreferencePackingCollator")


@dataclass(frozen=True, eq=False)
class RunConfig(Mapping[str, Any]):
    """A run config read once: its typed parts, and the config itself as a read-only mapping (what a
    run record keeps)."""

    given: Mapping[str, Any]
    """The config as ``of`` was given it: a parser's resolved config, or a study's merged YAML."""
    trainer: TrainerSettings
    model: ModelSettings
    data: DataSettings
    optimizer: ClassChoice | None
    """LightningCLI's own ``optimizer:`` section, when the config has one."""
    record_path: str | None
    """``recorder.path``: where the run record goes."""
    trackers: tuple[str, ...] = ()
    """``recorder.trackers``: the experiment trackers that get a copy of the record (``lit_ablate.trackers``)."""
    simulation: SimulatedRank | None = None
    """``simulate`` / ``simulate_rank``: the one rank of a larger job this run plays (docs/simulation.md)."""
    subcommand: str = "fit"
    """What runs the config: ``fit``, or ``validate``/``test`` (which train nothing and write nothing)."""
    executor: str | None = None
    """The study executor that starts the run (``EXECUTORS``); None for a command the user runs."""

    @classmethod
    def of(cls, config: RunConfig | Mapping[str, Any], **launch: Any) -> RunConfig:
        """The view of ``config`` (a dict, a jsonargparse ``Namespace`` or already a view); ``launch`` sets
        how it runs (``subcommand``, ``executor``)."""
        if isinstance(config, RunConfig):
            return replace(config, **launch) if launch else config
        tree = config.as_dict() if hasattr(config, "as_dict") else dict(config)
        module = ClassChoice.of(get_dotted(tree, "model")) or ClassChoice(
            "", dict(get_dotted(tree, "model.init_args") or {})
        )  # a bare model section (tests, partial configs)
        return cls(
            given=tree,
            trainer=TrainerSettings.of(get_dotted(tree, "trainer") or {}),
            model=ModelSettings(module, get_dotted(tree, "model.init_args.model")),
            data=DataSettings.of(get_dotted(tree, "data")),
            optimizer=ClassChoice.of(get_dotted(tree, "optimizer")),
            record_path=get_dotted(tree, "recorder.path"),
            trackers=tuple(get_dotted(tree, "recorder.trackers") or ()),
            simulation=_simulation(tree),
            **launch,
        )

    @property
    def ckpt_path(self) -> str | None:
        """``--ckpt_path``: the checkpoint the run resumes or evaluates (None: none)."""
        path = self.given.get("ckpt_path")
        return None if path is None else str(path)

    @property
    def fits(self) -> bool:
        """Whether the run trains (``fit``): validate and test train nothing and write nothing."""
        return self.subcommand == "fit"

    def __getitem__(self, key: str) -> Any:
        return self.given[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.given)

    def __len__(self) -> int:
        return len(self.given)

    @property
    def world_size(self) -> int:
        """The job's ranks: the simulated job's under ``simulate``, else devices per node (``auto``
        counts as 1) x nodes. The one place a run's world size is computed."""
        if self.simulation is not None:
            return self.simulation.world_size
        return (self.trainer.devices_per_node or 1) * self.trainer.nodes

    @property
    def devices_started(self) -> int | None:
        """The processes the run starts per node: one for a simulated rank, else ``trainer.devices`` (None:
        Lightning counts them, ``auto``)."""
        return 1 if self.simulation is not None else self.trainer.devices_per_node

    @property
    def nodes_started(self) -> int:
        """The nodes the run starts processes on: one for a simulated rank."""
        return 1 if self.simulation is not None else self.trainer.nodes

    @cached_property
    def mesh_sizes(self) -> MeshSizes | None:
        """The mesh sizes on the run's ``world_size`` ranks (a ``-1`` resolved); None for a strategy without
        a mesh, or sizes that do not lay out on those ranks (``mesh_lays_out`` refuses them)."""
        try:
            requested = self.trainer.strategy.requested_mesh_sizes
            return None if requested is None else requested.resolved(self.world_size)
        except ConfigError:
            return None

    def mesh_size(self, dim: str) -> int:
        """The size of mesh dimension ``dim`` on the run's ranks; 1 where ``mesh_sizes`` is None."""
        return 1 if self.mesh_sizes is None else self.mesh_sizes[dim]

    @property
    def compute_dtype(self) -> str | None:
        """The dtype the model computes in (what the loss's hidden states are): the 16-bit precision if
        one is set, else the parameter dtype (None for a dtype the run itself refuses)."""
        precision = self.trainer.precision
        if precision.startswith("bf16"):
            return "bfloat16"
        if precision.startswith("16"):
            return "float16"
        return self.model.dtype if self.model.dtype in MODEL_DTYPES else None


def on_ranks(run: RunConfig, world_size: int) -> RunConfig:
    """``run`` on ``world_size`` ranks of one node (``lit-ablate estimate --world_size``), simulated or not."""
    if run.simulation is not None:
        return replace(run, simulation=replace(run.simulation, world_size=world_size))
    return replace(run, trainer=replace(run.trainer, devices=world_size, num_nodes=1))
