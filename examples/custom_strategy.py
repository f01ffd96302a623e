"""Research code: change one step of a strategy's parallelism pipeline by subclassing it.

Every mesh strategy applies parallelism in one order, one method per step: ``apply_tp`` ->
``apply_ep`` -> ``apply_cp`` -> ``apply_activation_checkpointing`` -> ``apply_compile`` ->
``apply_fsdp``. To try an idea, subclass the strategy and override the one step it changes;
the mesh, the sampler, initialisation, checkpoints and every other step stay as they are.

The idea here: checkpoint only the feed-forward block of each decoder layer. Its activations
(3-4x the hidden size) are most of a layer's activation memory, while recomputing it costs no
attention, so it may keep most of full checkpointing's saving at a fraction of its recompute.
An ablation can then compare it with ``activation_checkpointing: none | full | selective``.

Run it (2 CPU ranks, a few seconds per step):
    python examples/custom_strategy.py
Or select it from any config (the repository root on the Python path):
    PYTHONPATH=. lit-ablate fit --config configs/fsdp2_tiny.yaml \\
        --trainer.strategy examples.custom_strategy.FeedForwardCheckpointing
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.distributed._composable import checkpoint

from lit_ablate.data import LMDataModule, SyntheticText
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from lit_ablate.strategies import FSDP2Strategy, decoder_layers


class FeedForwardCheckpointing(FSDP2Strategy):
    """FSDP2 that recomputes only each decoder layer's feed-forward block in backward.

    Takes every ``FSDP2Strategy`` argument (mesh sizes, mixed precision, resharding). Llama-,
    Qwen- and Mistral-family decoder layers in transformers name that block ``mlp``.
    """

    def apply_activation_checkpointing(self, model: CausalLMWithLoss) -> None:
        for layer in decoder_layers(model):
            checkpoint(layer.mlp)


def main() -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FeedForwardCheckpointing(),
        max_steps=10,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        default_root_dir="runs/custom_strategy",
    )
    module = CausalLM(ModelFactory(preset="tiny-llama"), learning_rate=3e-3, warmup_steps=2)
    data = LMDataModule(SyntheticText(num_documents=200), seq_len=64, batch_size=4)
    trainer.fit(module, data)


if __name__ == "__main__":
    main()
