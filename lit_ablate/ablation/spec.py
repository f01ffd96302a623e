"""The study spec: one YAML file that declares an ablation (``configs/studies/*.yaml``).

A study is a base ``fit`` config plus the variants that differ from it in declared keys
(``axes:`` expanded into a product, or an explicit ``variants:`` list with ``vary:``), repeated
over ``seeds``. Parsing validates everything before any run starts, and every mistake raises a
``ConfigError`` naming the study key, so a typo costs a second, not a night of runs.

Precedence when a run's config is assembled (later wins): the base config, the study
``overrides``, the study ``launch``, the variant's overrides (or axis values), the variant's
``launch``, then what the runner owns (``steps``, the seed, the output directory) and, with
``expect_equal_gradients``, the callback that records what it compares.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from lit_ablate.ablation.agreements import (
    GradientAgreement,
    LossAgreement,
    gradient_agreement,
    loss_agreement,
    planned,
    positive_int,
)
from lit_ablate.ablation.launch import LAUNCH_CONFIG_KEYS, SLURM_BLOCK, Launch, mapping_at
from lit_ablate.ablation.speed_verdict import INTERLEAVE_MODES, SpeedDesign
from lit_ablate.config_keys import NOT_GIVEN, PairedKey, ignored_key, is_under, with_overrides
from lit_ablate.errors import ConfigError

STUDY_KEYS = (
    "name",
    "base",
    "overrides",
    "axes",
    "variants",
    "vary",
    "baseline",
    "seeds",
    "steps",
    "warmup_steps",
    "launch",
    "expect_equal_loss",
    "expect_equal_gradients",
    "order",
    "speed",
)
VARIANT_KEYS = ("name", "overrides", "launch")
MAX_AXES = 2
RUNNER_KEYS = ("trainer.max_steps", "seed_everything", "trainer.default_root_dir", "recorder.warmup_steps")
"""Keys the runner sets for every run: never a study variable, never a single-variable violation.
(``recorder`` is the CLI's ``RunRecorder``: the study's warm-up is also the record's.)"""
RUN_ORDERS = ("round_robin", "by_variant")
"""``round_robin`` (default): the first seed of every variant, then the second of every variant, ...
so slow drift of a shared machine spreads over all variants instead of landing on the last ones;
``by_variant``: every seed of one variant, then the next variant."""
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._=,+-]")


GRADIENT_CALLBACK = "lit_ablate.callbacks.GradientFingerprint"
"""The callback ``expect_equal_gradients`` adds to every run's ``trainer.callbacks``."""


@dataclass(frozen=True)
class Variant:
    """One arm of the study: its name, the dotted overrides it applies, and its own launch."""

    name: str
    overrides: dict[str, Any]
    launch: Launch
    launch_overrides: dict[str, Any] = field(default_factory=dict)
    axis_values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StudySpec:
    """A parsed, validated study: everything the runner and the report need."""

    name: str
    source: Path | None
    base: dict[str, Any]
    base_path: Path | None
    overrides: dict[str, Any]
    variables: tuple[str, ...]
    axes: dict[str, list[Any]]
    variants: tuple[Variant, ...]
    baseline: str
    seeds: tuple[int, ...]
    steps: int | None
    warmup_steps: int | None
    launch: Launch
    launch_overrides: dict[str, Any]
    expect_equal_loss: LossAgreement | None
    order: str = RUN_ORDERS[0]
    expect_equal_gradients: GradientAgreement | None = None
    speed: SpeedDesign = field(default_factory=SpeedDesign)

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def fit_config(self, variant: Variant, seed: int, root_dir: str | Path) -> dict[str, Any]:
        """The ``fit`` config of one run as the study file merges it (not yet resolved), in the documented
        precedence order."""
        config = with_overrides(
            self.base,
            {
                **self.overrides,
                **self.launch_overrides,
                **variant.overrides,
                **variant.launch_overrides,
                **self.runner_overrides(seed, root_dir),
            },
        )
        return self._with_gradient_fingerprint(config, variant)

    def runner_overrides(self, seed: int, root_dir: str | Path) -> dict[str, Any]:
        """What the runner sets in every run's config (``RUNNER_KEYS``): the seed, the output folder, the
        study's steps and warm-up."""
        runner: dict[str, Any] = {"seed_everything": seed, "trainer.default_root_dir": str(root_dir)}
        if self.steps is not None:
            runner["trainer.max_steps"] = self.steps
        if self.warmup_steps is not None:
            runner["recorder.warmup_steps"] = self.warmup_steps
        return runner

    def _with_gradient_fingerprint(self, config: dict[str, Any], variant: Variant) -> dict[str, Any]:
        """``config`` with the callback that records what ``expect_equal_gradients`` compares, at its step,
        after the variant's own callbacks (every variant gets the same one, so it is no study variable)."""
        if self.expect_equal_gradients is None:
            return config
        trainer = config.setdefault("trainer", {})
        callbacks = trainer.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if any(
            isinstance(c, Mapping) and str(c.get("class_path", "")).endswith("GradientFingerprint") for c in callbacks
        ):
            raise ConfigError(
                "trainer.callbacks[GradientFingerprint]",
                f"listed for variant {variant.name}",
                "leave it out of the study's configs: expect_equal_gradients adds it to every variant, at its step",
            )
        trainer["callbacks"] = [
            *callbacks,
            {"class_path": GRADIENT_CALLBACK, "init_args": {"step": self.expect_equal_gradients.step}},
        ]
        return config

    def shortened(self, steps: int | None = None, seeds: int | None = None, only: str | None = None) -> StudySpec:
        """This study cut down for a first try (``lit-ablate ablate --steps N --seeds K --only a,b``).

        ``steps`` replaces the study's steps (and a study-level ``trainer.max_steps``; a loss check over
        more steps compares them all); ``seeds`` keeps
        the study's first K seeds, continuing with the integers after its largest when it lists fewer;
        ``only`` (comma-separated names; a grid's names hold commas themselves, so the longest names
        that match are taken) keeps those variants, plus the baseline (every ratio of the report is to it) and the
        variants their losses are checked against (``loss_reference``).
        Each value is checked like its study key, and named by its flag when it is wrong.
        """
        spec = self
        if steps is not None:
            if not positive_int(steps):
                raise ConfigError("--steps", steps, "give a positive integer number of optimizer steps")
            if self.warmup_steps is not None and self.warmup_steps >= steps:
                raise ConfigError(
                    "--steps",
                    steps,
                    f"the study excludes {self.warmup_steps} warm-up steps from its "
                    f"numbers; give more than {self.warmup_steps} steps",
                )
            overrides = {k: v for k, v in self.overrides.items() if k != "trainer.max_steps"}
            agreement, gradients = self.expect_equal_loss, self.expect_equal_gradients
            if agreement and agreement.steps is not None and agreement.steps > steps:  # compare the steps there are
                agreement = replace(agreement, steps=steps)
            if gradients and gradients.step > steps:  # the last step there is
                gradients = replace(gradients, step=steps)
            spec = replace(
                spec, steps=steps, overrides=overrides, expect_equal_loss=agreement, expect_equal_gradients=gradients
            )
        if seeds is not None:
            if not positive_int(seeds):
                raise ConfigError("--seeds", seeds, "give how many seeds to run: a positive integer")
            kept = list(self.seeds[:seeds])
            kept += range(max(self.seeds) + 1, max(self.seeds) + 1 + seeds - len(kept))
            spec = replace(spec, seeds=tuple(kept))
        if only is not None:
            chosen = _variant_names(only, [v.name for v in self.variants])
            keep = {*chosen, self.baseline, *(self.loss_reference(self.variant(name)).name for name in chosen)}
            spec = replace(spec, variants=tuple(v for v in self.variants if v.name in keep))
        return spec

    def loss_reference(self, variant: Variant) -> Variant:
        """The variant whose loss ``variant``'s is compared with: the baseline, or with
        ``expect_equal_loss.across`` the variant differing only in that axis, at the baseline's value."""
        across = self.expect_equal_loss.across if self.expect_equal_loss else None
        baseline = self.variant(self.baseline)
        if across is None:
            return baseline
        wanted = {**variant.axis_values, across: baseline.axis_values.get(across)}
        return next((v for v in self.variants if v.axis_values == wanted), baseline)

    def plan(self) -> dict[str, Any]:
        """The study as plain data (written to ``study.json``; the report reads it back)."""
        return {
            "name": self.name,
            "source": str(self.source) if self.source else None,
            "baseline": self.baseline,
            "variables": list(self.variables),
            "axes": self.axes,
            "seeds": list(self.seeds),
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "expect_equal_loss": planned(self.expect_equal_loss),
            "expect_equal_gradients": planned(self.expect_equal_gradients),
            "order": self.order,
            "speed": asdict(self.speed),
            "variants": [
                {
                    "name": v.name,
                    "overrides": v.overrides,
                    "launch": asdict(v.launch),
                    "axis_values": v.axis_values,
                }
                for v in self.variants
            ],
        }


def load_study(path: str | Path) -> StudySpec:
    """Read and validate a study file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--config", str(path), "give the path of a study YAML (e.g. configs/studies/depth_grid.yaml)")
    with open(path) as f:
        raw = yaml.safe_load(f)
    return parse_study(raw, source=path)


def parse_study(raw: Any, source: Path | None = None) -> StudySpec:
    """Validate a study mapping; ``source`` (the study file) anchors a relative ``base`` path."""
    if not isinstance(raw, Mapping):
        raise ConfigError(
            "study", type(raw).__name__, "a study file is a YAML mapping with base: and axes: or variants:"
        )
    for key in raw:
        if key not in STUDY_KEYS:
            raise ConfigError(str(key), raw[key], f"unknown study key; the keys are {list(STUDY_KEYS)}")
    name = raw.get("name", source.stem if source else None)
    if not isinstance(name, str) or not name or _SAFE_NAME.search(name):
        raise ConfigError("name", name, "give a name of letters, digits, '.', '_', '-' (it names the output folder)")
    base, base_path = _base(raw.get("base"), source)
    overrides = _dottedmapping_at(raw.get("overrides", {}), "overrides", study_level=True)
    if "steps" in raw and "trainer.max_steps" in overrides:
        raise ConfigError("overrides.trainer.max_steps", overrides["trainer.max_steps"], "set steps: or this, not both")
    launch = Launch().updated(mapping_at(raw.get("launch", {}), "launch"), "launch")
    launch_overrides = launch.config_overrides()
    if ("axes" in raw) == ("variants" in raw):
        raise ConfigError(
            "axes", raw.get("axes"), "give exactly one of axes: (a product of values) or variants: (a list)"
        )
    if "axes" in raw:
        if "vary" in raw:
            raise ConfigError(
                "vary", raw["vary"], "vary: goes with variants:; with axes: the axis keys are the variables"
            )
        axes, variants = _expand_axes(raw["axes"], launch)
        variables = tuple(axes)
    else:
        axes = {}
        variants = _explicit_variants(raw["variants"], launch)
        variables = _vary(raw.get("vary"), variants)
    submitted = "slurm" if any(v.launch.executor == "slurm" for v in variants) else launch.executor
    _check_paired(SLURM_BLOCK, raw.get("launch", {}), submitted)
    names = [v.name for v in variants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError("variants", duplicates, "variant names must be unique")
    baseline = _baseline(raw.get("baseline", names[0]), variants)
    steps = raw.get("steps")
    if steps is not None and not positive_int(steps):
        raise ConfigError("steps", steps, "give a positive integer number of optimizer steps")
    warmup = raw.get("warmup_steps")
    if warmup is not None and (
        not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0 or (steps is not None and warmup >= steps)
    ):
        raise ConfigError("warmup_steps", warmup, "give a non-negative integer smaller than steps")
    order = raw.get("order", RUN_ORDERS[0])
    if order not in RUN_ORDERS:
        raise ConfigError("order", order, f"give one of {list(RUN_ORDERS)}")
    return StudySpec(
        name=name,
        source=source,
        base=base,
        base_path=base_path,
        overrides=overrides,
        variables=variables,
        axes=axes,
        variants=tuple(variants),
        baseline=baseline,
        seeds=_seeds(raw.get("seeds", [0])),
        steps=steps,
        warmup_steps=warmup,
        launch=launch,
        launch_overrides=launch_overrides,
        expect_equal_loss=loss_agreement(raw.get("expect_equal_loss"), axes, steps, [v.name for v in variants]),
        order=order,
        expect_equal_gradients=gradient_agreement(raw.get("expect_equal_gradients"), steps, [v.name for v in variants]),
        speed=_speed(raw.get("speed"), submitted),
    )


def _speed(raw: Any, executor: str) -> SpeedDesign:
    """The ``speed:`` block: how speed is measured (``rounds``, ``interleave``) and judged."""
    if raw is None:
        return SpeedDesign()
    raw = mapping_at(raw, "speed")
    known = {f.name for f in fields(SpeedDesign)}
    for name, value in raw.items():
        if name not in known:
            raise ConfigError(f"speed.{name}", value, f"the keys are {sorted(known)}")
    design = SpeedDesign(**raw)
    if not positive_int(design.rounds):
        raise ConfigError(
            "speed.rounds", design.rounds, "give how many blocks each run is measured in: a positive integer"
        )
    if not _number(design.confidence) or not 0.5 < design.confidence < 1:
        raise ConfigError("speed.confidence", design.confidence, "give a probability between 0.5 and 1, e.g. 0.95")
    for name, least in (("threshold", "0 or more, e.g. 0.05 for 5%"), ("load_tolerance", "above 0 cores, e.g. 0.25")):
        value = getattr(design, name)
        if not _number(value) or value < 0 or (name == "load_tolerance" and value == 0):
            raise ConfigError(f"speed.{name}", value, f"give a number of {least}")
    if design.interleave not in INTERLEAVE_MODES:
        raise ConfigError("speed.interleave", design.interleave, f"give one of {list(INTERLEAVE_MODES)}")
    if design.interleave == "steps" and executor == "slurm":
        raise ConfigError(
            "speed.interleave",
            "steps",
            "SLURM jobs start when and where the scheduler places them, so they cannot take turns; "
            "use runs (or auto), and seeds for the rounds",
        )
    return design


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _base(value: Any, source: Path | None) -> tuple[dict[str, Any], Path | None]:
    if isinstance(value, Mapping):
        return copy.deepcopy(dict(value)), None
    if not isinstance(value, str):
        raise ConfigError("base", value, "give a fit config path (relative to the study file) or an inline mapping")
    path = Path(value)
    if not path.is_absolute() and source is not None:
        path = source.parent / path
    if not path.is_file():
        raise ConfigError("base", value, f"no such file: {path} (a relative base is relative to the study file)")
    with open(path) as f:
        base = yaml.safe_load(f) or {}
    if not isinstance(base, Mapping):
        raise ConfigError("base", value, "the base must be a fit config: a YAML mapping (trainer:, model:, data:)")
    if "base" in base and ("variants" in base or "axes" in base):
        raise ConfigError(
            "base",
            value,
            f"a study file, not a fit config; give the fit config it varies (its own base: {base['base']!r})",
        )
    return dict(base), path.resolve()


def _expand_axes(raw: Any, launch: Launch) -> tuple[dict[str, list[Any]], list[Variant]]:
    axes = _dottedmapping_at(raw, "axes")
    if not 1 <= len(axes) <= MAX_AXES:
        raise ConfigError("axes", raw, f"declare 1 axis, or {MAX_AXES} for a grid")
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"axes.{key}", values, "give a non-empty list of values")
    variants = []
    for combo in itertools.product(*(list(enumerate(v)) for v in axes.values())):
        values = {key: value for key, (_, value) in zip(axes, combo)}
        parts = [_value_name(key, value, index, single=len(axes) == 1) for key, (index, value) in zip(axes, combo)]
        variants.append(Variant(name=",".join(parts), overrides=values, launch=launch, axis_values=values))
    return {k: list(v) for k, v in axes.items()}, variants


def _value_name(key: str, value: Any, index: int, single: bool) -> str:
    """A readable, path-safe name for an axis value: ``torch``, ``num_hidden_layers=2``, ``FSDP2Strategy``."""
    if isinstance(value, Mapping) and isinstance(value.get("class_path"), str):
        text = value["class_path"].rsplit(".", 1)[-1]
    elif isinstance(value, (Mapping, list)):
        text = f"{key.rsplit('.', 1)[-1]}={index}"
    elif isinstance(value, str) and single:
        text = value
    else:
        text = f"{key.rsplit('.', 1)[-1]}={value}"
    return _SAFE_NAME.sub("_", text)


def _explicit_variants(raw: Any, launch: Launch) -> list[Variant]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError("variants", raw, "give a non-empty list of {name, overrides, launch}")
    variants = []
    for i, item in enumerate(raw):
        key = f"variants[{i}]"
        item = mapping_at(item, key)
        for k in item:
            if k not in VARIANT_KEYS:
                raise ConfigError(f"{key}.{k}", item[k], f"a variant has the keys {list(VARIANT_KEYS)}")
        name = item.get("name")
        if not isinstance(name, str) or not name or _SAFE_NAME.search(name):
            raise ConfigError(f"{key}.name", name, "give a name of letters, digits, '.', '_', '-', '=', ','")
        variant_launch_raw = mapping_at(item.get("launch", {}), f"{key}.launch")
        variant_launch = launch.updated(variant_launch_raw, f"{key}.launch")
        _check_paired(
            replace(SLURM_BLOCK, key=f"{key}.launch.slurm", partner=f"{key}.launch.executor"),
            variant_launch_raw,
            variant_launch.executor,
        )
        launch_overrides = {
            LAUNCH_CONFIG_KEYS[f]: variant_launch_raw[f] for f in LAUNCH_CONFIG_KEYS if f in variant_launch_raw
        }
        overrides = _dottedmapping_at(item.get("overrides", {}), f"{key}.overrides")
        variants.append(Variant(name, overrides, variant_launch, launch_overrides))
    return variants


def _check_paired(pair: PairedKey, block: Mapping[str, Any], partner_value: Any) -> None:
    """Refuse ``pair.key`` (its last segment read in ``block``, as the file gives it) when ``partner_value``
    does not make it act (``config_keys.ignored_key``)."""
    name = pair.key.rsplit(".", 1)[-1]
    refusal = ignored_key([pair], lambda key: block.get(name, NOT_GIVEN), lambda key: partner_value)
    if refusal:
        raise refusal.error()


def _vary(raw: Any, variants: Sequence[Variant]) -> tuple[str, ...]:
    if raw is None:
        changed = list(dict.fromkeys(k for v in variants for k in [*v.overrides, *v.launch_overrides]))
        raise ConfigError(
            "vary",
            None,
            "with variants:, list the keys (or prefixes) they vary"
            + (f": here vary: {changed}" if changed else ", e.g. vary: [trainer.strategy]"),
        )
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(k, str) and k for k in raw):
        raise ConfigError("vary", raw, "give a list of dotted keys or key prefixes")
    for variant in variants:
        for key in [*variant.overrides, *variant.launch_overrides]:
            if not any(is_under(key, prefix) for prefix in raw):
                raise ConfigError(
                    f"variants.{variant.name}.overrides.{key}",
                    variant.overrides.get(key, variant.launch_overrides.get(key)),
                    f"this key is not declared as a variable; add it (or a prefix of it) to vary: {raw}",
                )
    return tuple(raw)


def _baseline(raw: Any, variants: Sequence[Variant]) -> str:
    """The baseline's variant name; with one axis, its axis value names it too (``baseline: 2``)."""
    for variant in variants:
        if raw == variant.name or (len(variant.axis_values) == 1 and [raw] == list(variant.axis_values.values())):
            return variant.name
    raise ConfigError("baseline", raw, f"name one of the variants: {[v.name for v in variants]}")


def _seeds(raw: Any) -> tuple[int, ...]:
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(s, int) and not isinstance(s, bool) for s in raw):
        raise ConfigError("seeds", raw, "give a list of integer seeds, e.g. [0, 1, 2]")
    if len(set(raw)) != len(raw):
        raise ConfigError("seeds", raw, "seeds must be distinct")
    return tuple(raw)


def _dottedmapping_at(value: Any, key: str, study_level: bool = False) -> dict[str, Any]:
    """Dotted overrides; runner keys are refused, except ``trainer.max_steps`` for the whole study."""
    mapping = mapping_at(value, key)
    for dotted in mapping:
        if not isinstance(dotted, str) or not dotted or any(not s for s in dotted.split(".")):
            raise ConfigError(
                f"{key}.{dotted}", mapping[dotted], "keys are dotted config keys like model.init_args.loss"
            )
        owned = [k for k in RUNNER_KEYS if is_under(dotted, k)]
        if owned and not (study_level and owned == ["trainer.max_steps"] and dotted == "trainer.max_steps"):
            raise ConfigError(f"{key}.{dotted}", mapping[dotted], "the runner sets this per run: use steps:/seeds:")
    return mapping


def _variant_names(text: str, names: Sequence[str]) -> list[str]:
    """``--only``'s comma-separated variant names, each the longest run of comma-separated pieces that
    names a variant (``loss=torch,dtype=float32,loss=cce,dtype=float32`` is two grid variants)."""
    pieces, chosen, start = text.split(","), [], 0
    while start < len(pieces):
        end = next((end for end in range(len(pieces), start, -1) if ",".join(pieces[start:end]).strip() in names), None)
        if end is None:
            raise ConfigError(
                "--only", text, f"{pieces[start].strip()!r} starts no variant's name; the variants: {list(names)}"
            )
        chosen.append(",".join(pieces[start:end]).strip())
        start = end
    if not chosen:
        raise ConfigError("--only", text, f"name variants, comma-separated; the variants: {list(names)}")
    return chosen
