"""Research code: change one step of a strategy's parallelism pipeline by subclassing it.

Every mesh strategy applies parallelism in one ordered list of steps, one method each
(``MeshStrategy.apply_steps``): ``apply_tp`` -> ``apply_ep`` -> ``apply_cp`` ->
``apply_activation_checkpointing`` -> ``apply_compile`` -> ``apply_expert_fsdp`` -> ``apply_fsdp``,
each dimension's step run when its size is above 1 (checkpointing and compile read their own
options, so a step of yours runs whatever they say). To try an idea, subclass the strategy and
override the one step it changes; the mesh, the sampler, initialisation, checkpoints and every
other step stay as they are.

The idea here: checkpoint only the feed-forward block of each decoder layer. Its activations
(3-4x the hidden size) are most of a layer's activation memory, while recomputing it costs no
attention, so it may keep most of full checkpointing's saving at a fraction of its recompute.
An ablation can then compare it with ``activation_checkpointing: none | full | selective``.

Run it from the repository root: it trains the FSDP2 tiny config three ways, each a ``lit-ablate
fit`` of its own (6 steps on one CPU rank: what checkpointing saves is per rank, and a second rank
would only double the start-up), and prints each one's activation peak (the tracked tensors of a
warm-up step, ``MemoryMonitor``) and step time, so you see what it saves:
    python examples/custom_strategy.py
Or select it from any config, in YAML (``strategy: {class_path: examples.custom_strategy.
FeedForwardCheckpointing}``) or on the command line, from the repository root (``lit-ablate`` puts
the working directory on the Python path, as ``python -m`` does). A strategy given by its class
is a ``class_path``; a bare ``--trainer.strategy NAME`` is one of Lightning's registered names:
    lit-ablate fit --config configs/fsdp2_tiny.yaml \\
        --trainer.strategy.class_path examples.custom_strategy.FeedForwardCheckpointing
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from torch.distributed._composable import checkpoint

from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.record import RECORD_PATH_ENV
from lit_ablate.strategies import FSDP2Strategy, decoder_layers

REPOSITORY = Path(__file__).resolve().parents[1]
STRATEGY = "--trainer.strategy.init_args.activation_checkpointing"
VARIANTS: dict[str, list[str]] = {
    "no checkpointing": [STRATEGY, "none"],
    "feed-forward only (this file)": [
        "--trainer.strategy.class_path",
        "examples.custom_strategy.FeedForwardCheckpointing",
    ],
    "every layer (full)": [STRATEGY, "full"],
}


class FeedForwardCheckpointing(FSDP2Strategy):
    """FSDP2 that recomputes only each decoder layer's feed-forward block in backward.

    Takes every ``FSDP2Strategy`` argument (mesh sizes, mixed precision, resharding). Llama-,
    Qwen- and Mistral-family decoder layers in transformers name that block ``mlp``.

    It implements ``StrategyInterface`` (what modules and callbacks may ask a strategy) through
    ``FSDP2Strategy`` and changes none of its answers: checkpointing changes neither which ranks
    share a batch (``batch_replicas``), nor the gradient group, nor how state is sharded. A strategy
    that did would override that answer beside its step.
    """

    def apply_activation_checkpointing(self, model: CausalLMWithLoss) -> None:
        for layer in decoder_layers(model):
            checkpoint(layer.mlp)


def measure(name: str, overrides: list[str], folder: Path) -> dict:
    """One ``lit-ablate fit`` of configs/fsdp2_tiny.yaml with ``overrides``; its run record's summary."""
    record = folder / f"{len(list(folder.glob('*.json')))}.json"
    command = [
        sys.executable,
        "-m",
        "lit_ablate.cli",
        "fit",
        "--config",
        "configs/fsdp2_tiny.yaml",
        "--trainer.max_steps",
        "6",
        "--trainer.devices",
        "1",
        "--trainer.default_root_dir",
        str(folder / "runs"),
        *overrides,
    ]
    done = subprocess.run(
        command, cwd=REPOSITORY, capture_output=True, text=True, env={**os.environ, RECORD_PATH_ENV: str(record)}
    )
    if done.returncode != 0:
        sys.exit(f"{name}: lit-ablate fit failed:\n{done.stderr[-3000:]}")
    return json.loads(record.read_text())["summary"]


def main() -> None:
    mib = 2**20
    with tempfile.TemporaryDirectory() as folder:  # runs and records: nothing lands in the checkout
        summaries = {name: measure(name, overrides, Path(folder)) for name, overrides in VARIANTS.items()}
    baseline = summaries["no checkpointing"]["tensor_breakdown"]["max"]["activations"]
    print(f"{'activation checkpointing':<32} {'activations/rank':>17} {'saved':>7} {'step time':>10}")
    for name, summary in summaries.items():
        activations = summary["tensor_breakdown"]["max"]["activations"]
        print(
            f"{name:<32} {activations / mib:>13.1f} MiB {1 - activations / baseline:>7.0%} "
            f"{summary['step_time_s']['median'] * 1000:>7.0f} ms"
        )


if __name__ == "__main__":
    main()
