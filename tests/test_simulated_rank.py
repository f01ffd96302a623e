"""One process plays rank 0 of a 64-rank mesh over torch's fake process group (``lit-ablate fit --simulate``),
and its measured memory is checked against the estimate of that rank, category by category.

Each layout is a fit config (the dict ``lit-ablate fit`` resolves); the strategy is built from it as the
CLI builds it, the estimate is ``estimate_for_config(config, rank=0)`` (what ``lit-ablate estimate
--measure`` and the study report compare), and the measurement is the run record's tracked step
(``MemoryMonitor``'s tensor tracker on step 2 of 2). No rank is forked: 64 ranks cost one process.
Model: 2 decoder layers of width 256 (every matrix's rows divisible by 64, so FSDP's shards are even and
rank 0 holds exactly its share), a 1,024-token vocabulary, 2 rows of 128 tokens per rank; and a wide one
(width 1024, an 8,192-token vocabulary) on 4 rows of 32 tokens, whose root gradients outweigh its
activations, as a Qwen3-8B-wide model's do on few tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lit_ablate.estimate.agreement import AGREEMENT_FACTORS, compare_with_measured
from lit_ablate.estimate.from_config import estimate_for_config
from lit_ablate.run_config import RunConfig
from lit_ablate.simulated_rank import SimulatedRank, current_simulation

WORLD = 64
ROWS, SEQ = 2, 128
WIDE = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
DENSE = {"preset": "tiny-qwen3", "config": WIDE}
MOE = {
    "preset": "tiny-qwen3-moe",
    "config": {**WIDE, "num_experts": 64, "moe_intermediate_size": 128},
    "moe": {"experts": "grouped"},
}  # 64 experts: 8 per ep rank, 1 per FSDP rank
STRATEGIES = "lit_ablate.strategies"
WIDER = {
    "preset": "tiny-qwen3",
    "config": {
        "vocab_size": 8192,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
LAYOUTS = {  # name: (strategy class, its init_args, model, rows and tokens per rank)
    "fsdp2_64": ("FSDP2Strategy", {"dp_shard": 64}, DENSE, (ROWS, SEQ)),
    "tp4_fsdp16": ("TensorParallelStrategy", {"tp": 4, "dp_shard": 16}, DENSE, (ROWS, SEQ)),
    "pp2_fsdp32": ("PipelineParallelStrategy", {"pp": 2, "dp_shard": 32, "microbatches": 2}, DENSE, (ROWS, SEQ)),
    "ep8_fsdp8": ("ExpertParallelStrategy", {"ep": 8, "dp_shard": 8}, MOE, (ROWS, SEQ)),
    "wide_fsdp2_64": ("FSDP2Strategy", {"dp_shard": 64}, WIDER, (4, 32)),
    "wide_tp8_fsdp8": ("TensorParallelStrategy", {"tp": 8, "dp_shard": 8}, WIDER, (4, 32)),
}
STATES = ("params", "grads", "optimizer")


def layout_config(name: str, world_size: int = WORLD, rank: int = 0) -> dict:
    """The fit config of one layout, simulated as rank ``rank`` of ``world_size``."""
    strategy, options, model, (rows, seq) = LAYOUTS[name]
    return {
        "seed_everything": 0,
        "simulate": world_size,
        "simulate_rank": rank,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 2,
            "precision": "32-true",
            "strategy": {"class_path": f"{STRATEGIES}.{strategy}", "init_args": options},
        },
        "model": {"class_path": "lit_ablate.modules.CausalLM", "init_args": {"model": model, "warmup_steps": 0}},
        "data": {"class_path": "lit_ablate.data.LMDataModule", "init_args": {"batch_size": rows, "seq_len": seq}},
    }


def batches(count: int, rows: int, seq: int) -> list[dict]:
    """``count`` batches of ``rows`` rows of ``seq`` tokens, unequal masked prompts."""
    from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX

    generator, out = torch.Generator().manual_seed(0), []
    for _ in range(count):
        ids = torch.randint(0, 259, (rows, seq), generator=generator)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = IGNORE_INDEX
        for row in range(rows):
            labels[row, : 3 * row] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def simulate(config: dict, record_path: Path) -> dict:
    """Fit ``config`` as its simulated rank in this process (as ``lit-ablate fit --simulate`` does after its
    checks) and return the run record. The fake process group is left again, and Lightning's rank-zero
    state restored, whatever happens."""
    import lightning as L
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from torch.utils.data import DataLoader

    from lit_ablate.callbacks import MemoryMonitor, RunRecorder, ThroughputMonitor
    from lit_ablate.models.factory import ModelFactory
    from lit_ablate.modules import CausalLM
    from lit_ablate.strategies.simulation import simulated_trainer_arguments, start_fake_process_group

    run = RunConfig.of(config)
    rank = getattr(rank_zero_only, "rank", 0)
    start_fake_process_group(run.simulation)
    try:
        L.seed_everything(0)
        trainer = L.Trainer(
            max_steps=run.trainer.max_steps,
            accelerator="cpu",
            strategy=run.trainer.strategy.build(),
            use_distributed_sampler=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[MemoryMonitor(), ThroughputMonitor(), RunRecorder(path=str(record_path), warmup_steps=2)],
            **simulated_trainer_arguments(run.simulation),
        )
        trainer.fit(
            CausalLM(ModelFactory(**run.model.factory), warmup_steps=0),
            DataLoader(batches(run.trainer.max_steps, run.data.batch_size, run.data.seq_len), batch_size=None),
        )
    finally:
        dist.destroy_process_group()
        rank_zero_only.rank = rank
    return json.loads(record_path.read_text())


_RECORDS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """``simulated(name)``: the run record of rank 0 of that layout (each simulated once per module)."""
    root = tmp_path_factory.mktemp("simulated")

    def record(name: str) -> dict:
        if name not in _RECORDS:
            _RECORDS[name] = simulate(layout_config(name), root / f"{name}.json")
        return _RECORDS[name]

    yield record
    _RECORDS.clear()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_0_of_64_holds_what_the_estimate_says(simulated, name):
    """Every category of the simulated rank's tracked step against ``estimate_for_config(config, rank=0)`` by
    the study reports' rule (``compare_with_measured``), and the state categories by their factor alone
    (however small beside the peak: at 64 ranks they are). Measured ratios (estimate / measured): states
    0.995-1.0; activations 1.06 (fsdp2_64), 0.88 (tp4_fsdp16), 0.83 (pp2_fsdp32), 1.01 (ep8_fsdp8), 1.09
    (wide_fsdp2_64), 1.11 (wide_tp8_fsdp8); transient 1.14, 1.14, 0.99, 1.64, 1.18, 0.73. Seen failing with
    the FSDP step's shard count halved in ``state_sharding`` (states 1.99-2.0 in every layout; ep8_fsdp8's
    dense share 1.08), and with the root's unsharded gradients left out of the activations
    (``root_gradient_bytes``: wide_fsdp2_64 0.60, wide_tp8_fsdp8 0.30)."""
    record = simulated(name)
    assert record["simulated"] == {"world_size": WORLD, "rank": 0}
    assert record["environment"]["world_size"] == WORLD
    breakdown = record["summary"]["tensor_breakdown"]
    assert breakdown["rank"] == 0
    comparison = compare_with_measured(estimate_for_config(layout_config(name), rank=0), breakdown)
    disagreeing = {c: round(r["ratio"] or 0, 3) for c, r in comparison.items() if not r["agrees"]}
    assert not disagreeing, disagreeing
    for category in STATES:
        assert 1 / AGREEMENT_FACTORS[category] <= comparison[category]["ratio"] <= AGREEMENT_FACTORS[category], category


def test_an_estimate_with_a_wrong_shard_count_disagrees(simulated):
    """The check above can fail: rank 0 of FSDP2 x 64 against the estimate of the same config with its state
    over 32 shards (every state category twice what rank 0 holds) is outside each state factor."""
    from dataclasses import replace

    from lit_ablate.estimate.from_config import configured_sharding, model_of, training_shape_of
    from lit_ablate.estimate.memory import estimate_memory

    config = layout_config("fsdp2_64")
    counts, shape = model_of(config)
    wrong = replace(configured_sharding(config, WORLD), params=WORLD // 2, grads=WORLD // 2, optimizer=WORLD // 2)
    estimate = estimate_memory(counts, shape, training_shape_of(config, world_size=WORLD), wrong, WORLD)
    comparison = compare_with_measured(estimate, simulated("fsdp2_64")["summary"]["tensor_breakdown"])
    for category in STATES:
        assert comparison[category]["ratio"] == pytest.approx(2.0, rel=0.01), category
        assert comparison[category]["ratio"] > AGREEMENT_FACTORS[category]


def test_another_rank_of_a_symmetric_layout_holds_what_rank_0_holds(simulated, tmp_path):
    """``simulate_rank``: rank 37 of FSDP2 x 64 writes its own record (Lightning's rank zero is another rank),
    names itself in it, and holds rank 0's state (every shard is even)."""
    record = simulate(layout_config("fsdp2_64", rank=37), tmp_path / "rank37.json")
    assert record["simulated"] == {"world_size": WORLD, "rank": 37}
    breakdown, first = record["summary"]["tensor_breakdown"], simulated("fsdp2_64")["summary"]["tensor_breakdown"]
    assert breakdown["rank"] == 37
    assert {c: breakdown["max"][c] for c in STATES} == {c: first["max"][c] for c in STATES}


def test_the_fake_process_group_is_left_after_a_simulation(simulated):
    simulated("fsdp2_64")
    assert current_simulation() is None and not dist.is_initialized()


def test_a_simulated_rank_records_no_loss_and_its_own_memory_only(simulated):
    record = simulated("fsdp2_64")
    assert record["summary"]["final_loss"] is None
    assert all("loss" not in step and "tokens_per_sec" not in step for step in record["steps"])
    assert all(len(step["memory_peak_bytes_per_rank"]) == 1 for step in record["steps"])
    assert record["summary"]["step_time_s"] is None or record["summary"]["step_time_s"]["n"] >= 0


def test_the_simulated_rank_reads_its_config():
    run = RunConfig.of(layout_config("tp4_fsdp16", rank=5))
    assert run.simulation == SimulatedRank(64, 5) and run.world_size == 64


def _stderr_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, list[str]]:
    from lit_ablate.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


CONFIGS = Path(__file__).parents[1] / "configs"
FIT = ["fit", "--config", str(CONFIGS / "fsdp2_tiny.yaml"), "--trainer.max_steps", "1"]
PIPELINE = [
    "--trainer.strategy",
    "lit_ablate.strategies.PipelineParallelStrategy",
    "--trainer.strategy.init_args.pp",
    "2",
    "--trainer.strategy.init_args.dp_shard",
    "4",
]
REFUSALS = {  # name: (arguments after FIT, fragments of the one line)
    "resume": (["--simulate", "64", "--ckpt_path", "last"], ["--ckpt_path", "resume"]),
    "validate": (None, ["simulate", "only trains"]),
    "ddp": (["--simulate", "8", "--trainer.strategy", "ddp"], ["trainer.strategy", "mesh strategies"]),
    "mesh_not_dividing": (
        ["--simulate", "48", "--trainer.strategy.init_args.dp_shard", "32"],
        ["dp_shard", "32", "48"],
    ),
    "one_rank": (["--simulate", "1"], ["simulate", "2 or more"]),
    "rank_outside": (["--simulate", "8", "--simulate_rank", "8"], ["simulate_rank", "0 to 7"]),
    "later_stage": (["--simulate", "8", "--simulate_rank", "5", *PIPELINE], ["simulate_rank", "first stage", "0-3"]),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_simulation_that_cannot_mean_anything_is_one_line_before_any_work(name, tmp_path, capsys):
    """Refused before the process group or anything else starts (the fake group would be left behind)."""
    extra, fragments = REFUSALS[name]
    argv = (
        ["validate", "--config", str(CONFIGS / "fsdp2_tiny.yaml"), "--simulate", "64"]
        if extra is None
        else [*FIT, "--trainer.default_root_dir", str(tmp_path), *extra]
    )
    code, lines = _stderr_lines(argv, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
    assert not dist.is_initialized()


@pytest.mark.parametrize("dispatch", ["all_to_all", "all_reduce"])
def test_expert_parallel_dispatch_is_balanced_when_a_fake_exchange_leaves_its_buffers(dispatch, monkeypatch):
    """A fake exchange moves nothing; torch before 2.13 also leaves its output as allocated (2.13 copies the
    input in). With that behaviour forced, rank 0 of ep 8 still hands its experts exactly its own token copies
    (balanced routing) in valid expert ids. Seen failing with the receive buffers allocated empty (all-to-all:
    the experts got counts [61, 59] read from uninitialised memory instead of [135, 121]; all-reduce: [0, 0]
    instead of [112, 152])."""
    from lit_ablate.models.moe.dispatch import DISPATCH_MODES
    from lit_ablate.models.moe.router import Routing
    from lit_ablate.strategies.simulation import start_fake_process_group

    start_fake_process_group(SimulatedRank(8, 0))
    try:
        monkeypatch.setattr(dist, "all_to_all_single", lambda *args, **kwargs: None)  # leaves its output as it is
        tokens, top_k, experts = 64, 4, 16
        generator = torch.Generator().manual_seed(0)
        indices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
        routing = Routing(
            torch.full((tokens, top_k), 1 / top_k),
            indices,
            torch.zeros(tokens, experts),
            torch.zeros(tokens, experts),
            torch.bincount(indices.reshape(-1), minlength=experts),
        )
        seen = []

        def local_experts(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            seen.append(counts.clone())
            return x

        dispatcher = DISPATCH_MODES[dispatch](dist.group.WORLD, experts)
        out = dispatcher(torch.randn(tokens, 8, generator=generator), routing, local_experts)
    finally:
        dist.destroy_process_group()
    assert out.shape == (tokens, 8)
    # all_to_all: from each rank, for each of its 2 experts, what rank 0 sends that rank's; all_reduce:
    # every rank's tokens are rank 0's, so its 2 experts' copies, 8 times
    expected = routing.counts.view(8, 2).sum(0) if dispatch == "all_to_all" else 8 * routing.counts[:2]
    assert torch.equal(seen[0], expected) and int(seen[0].sum()) > 0


def test_the_report_sets_a_simulated_rank_s_categories_beside_its_estimate(simulated):
    """A study of simulated ranks gets a section with each category's estimate and measurement; a study
    without them does not."""
    from lit_ablate.ablation.report import render_markdown
    from lit_ablate.ablation.summary import study_summary

    record = {**simulated("pp2_fsdp32"), "variant": "pp2", "seed": 0, "config": layout_config("pp2_fsdp32")}
    plan = {"name": "s", "baseline": "pp2", "variants": [{"name": "pp2"}], "seeds": [0], "steps": 2, "warmup_steps": 2}
    page = render_markdown(study_summary(plan, [("runs/pp2/seed0/run.json", record)]))
    section = page.split("## Simulated ranks: estimate beside measurement")[1].split("\n\n")[2]
    row = section.splitlines()[-1]
    assert row.startswith("| pp2 | 0 of 64 | ") and row.count("MiB /") + row.count("KiB /") == 5, row
    plain = {**record, "simulated": None}
    assert "## Simulated ranks" not in render_markdown(study_summary(plan, [("runs/pp2/seed0/run.json", plain)]))


def _study(**extra) -> dict:
    return {
        "name": "sim",
        "base": layout_config("fsdp2_64"),
        "vary": ["trainer.strategy"],
        "variants": [
            {"name": "fsdp2"},
            {"name": "tp4", "overrides": {"trainer.strategy": layout_config("tp4_fsdp16")["trainer"]["strategy"]}},
        ],
        "launch": {"simulate": 64},
        **extra,
    }


def test_a_study_s_launch_simulates_every_run_as_one_process(tmp_path):
    """``launch.simulate`` lands in each run's config (``simulate``), and the planned launch is one process."""
    import yaml

    from lit_ablate.ablation.plan import plan_study
    from lit_ablate.ablation.spec import parse_study

    base = {k: v for k, v in layout_config("fsdp2_64").items() if k not in ("simulate", "simulate_rank")}
    spec = parse_study({**_study(), "base": base})
    runs = plan_study(spec, tmp_path, resolve=lambda args: yaml.safe_load(Path(args[1]).read_text()))
    assert [run.config["simulate"] for run in runs] == [64, 64]
    view = [(run.view.devices_started, run.view.nodes_started, run.view.simulation.world_size) for run in runs]
    assert view == [(1, 1, 64), (1, 1, 64)]
    assert all(run.skip_reason is None and run.invalid is None for run in runs)


@pytest.mark.parametrize("check", ["expect_equal_loss", "expect_equal_gradients"])
def test_a_study_refuses_a_loss_or_gradient_check_over_simulated_ranks(tmp_path, check):
    import yaml

    from lit_ablate.ablation.plan import plan_study
    from lit_ablate.ablation.spec import parse_study
    from lit_ablate.errors import ConfigError

    spec = parse_study(_study(**{check: {"rtol": 1e-5}}))
    with pytest.raises(ConfigError, match=f"{check}.*simulated ranks"):
        plan_study(spec, tmp_path, resolve=lambda args: yaml.safe_load(Path(args[1]).read_text()))


@pytest.mark.slow  # a lit-ablate fit subprocess (imports, 3 steps): ~30 s on 2 cores
def test_estimate_measure_runs_the_rank_and_sets_it_beside_its_estimate(capsys):
    """``lit-ablate estimate --measure``: ``lit-ablate fit --simulate 8`` in a process of its own (fsdp2_tiny:
    rank 0 of FSDP2 x 8), its record read back and each category judged by the reports' rule; the table
    names the rank and shows every category."""
    import json as json_module

    from lit_ablate.commands.estimate import _estimate_table, estimate_main

    args = ["--config", str(CONFIGS / "fsdp2_tiny.yaml"), "--world_size", "8", "--measure", "--json"]
    assert estimate_main(args) == 0
    summary = json_module.loads(capsys.readouterr().out)
    measured = summary["measured"]
    assert (measured["world_size"], measured["rank"]) == (8, 0)
    assert set(measured["categories"]) == set(AGREEMENT_FACTORS)
    assert all(row["agrees"] for row in measured["categories"].values()), measured["categories"]
    assert measured["step_time_s"] is not None
    table = _estimate_table(summary)
    assert "Rank 0 of 8, simulated" in table and all(f"| {c} |" in table for c in AGREEMENT_FACTORS)
