"""A simulated rank (``simulate``: one process playing one rank of a larger job over a fake process group)
where it can mean something (docs/simulation.md)."""

from __future__ import annotations

from lit_ablate.config_keys import TRAINER_STRATEGY_KEY
from lit_ablate.errors import Refusal
from lit_ablate.mesh_sizes import STRATEGY_OPTIONS_KEY
from lit_ablate.rules.registry import Scope, rule
from lit_ablate.run_config import RunConfig
from lit_ablate.simulated_rank import SIMULATE_KEY, SIMULATE_RANK_KEY


@rule(Scope.CONFIG)
def simulated_rank_plays_its_part(run: RunConfig) -> Refusal | None:
    """Refused: a simulated rank outside ``fit`` (its weights are drawn, not trained), resuming (nothing real
    was saved), under a strategy the fake process group cannot run (torch's DDP waits on the result of its
    gradient all-reduce, which a fake one never gives), with a quantised base (its quantisation state is made
    from real weights on rank 0), or playing a pipeline rank past the first stage (its inputs' shapes would
    come from a stage no process runs). The mesh's sizes on the simulated world size: ``mesh_lays_out``."""
    from lit_ablate.strategies.mesh import MeshStrategy
    from lit_ablate.strategies.pipeline_parallel import PipelineParallelStrategy

    simulation = run.simulation
    if simulation is None:
        return None
    if not run.fits:
        return Refusal(
            SIMULATE_KEY,
            simulation.world_size,
            f"a simulated rank only trains; drop --{SIMULATE_KEY} for {run.subcommand}",
        )
    if run.ckpt_path:
        return Refusal(
            "--ckpt_path",
            run.ckpt_path,
            f"a simulated rank draws its own weights and saves nothing to resume from; drop --ckpt_path (or "
            f"--{SIMULATE_KEY})",
        )
    strategy = run.trainer.strategy
    if not strategy.is_a(MeshStrategy):
        return Refusal(
            TRAINER_STRATEGY_KEY,
            strategy.short_name,
            "a simulated rank runs lit-ablate's mesh strategies (FSDP2Strategy, HSDPStrategy, "
            "TensorParallelStrategy, ContextParallelStrategy, ExpertParallelStrategy, MeshParallelStrategy, "
            "PipelineParallelStrategy); torch's DDP (ddp, DDPStrategy, ZeRO1Strategy) and FSDP1 wait on "
            "collective results a fake process group never gives",
        )
    if run.model.quantization_section is not None:
        return Refusal(
            "model.init_args.model.quantization",
            run.model.quantization_section,
            "a quantised base is made from real weights on rank 0, which a simulated rank does not build; "
            "simulate the unquantised model",
        )
    sizes = run.mesh_sizes
    if sizes is not None and sizes.pp > 1 and strategy.is_a(PipelineParallelStrategy):
        per_stage = simulation.world_size // sizes.pp
        if simulation.rank >= per_stage:
            return Refusal(
                SIMULATE_RANK_KEY,
                simulation.rank,
                f"a simulated pipeline rank holds the first stage (ranks 0-{per_stage - 1} of {sizes.pp} "
                "stages): a later stage's inputs come from a stage no process runs",
            )
        if strategy.option("schedule") == "interleaved_1f1b":
            return Refusal(
                f"{STRATEGY_OPTIONS_KEY}.schedule",
                "interleaved_1f1b",
                "an interleaved rank also holds later stages, whose inputs come from stages no process "
                "runs; simulate 1f1b or gpipe",
            )
    return None
