"""The optimizer's weight-decay group holds exactly the 2-D non-embedding matrices.

``CausalLM.configure_optimizers`` splits the parameters into a group that decays (the matrices of
the linear layers, LM head included) and one that does not (norm gains, biases, the input
embedding): the GPT-2/LLaMA convention ``lit_ablate.modules.optim.decay_groups`` documents. A
wrong split trains a different model without any error, and both decay settings train, so loss
and equivalence tests do not notice (every strategy builds the same wrong groups). Here the groups
of the optimizer a 1-step fit actually built are read back by parameter name, on the tiny Llama
with attention and MLP biases switched on and on the tiny Qwen3 (its q/k norms).

Seen failing (by hand, once): ``decay_names`` keeping every parameter with ``ndim >= 1`` (norm
weights and biases decay): 37 (Llama with biases) and 17 (Qwen3) extra parameters in the decay
group. Issue 30's mutation testing found ``test_optimizers.py`` and ``test_strategies_trainer.py``
passing under it.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules import CausalLM
from tests.test_step_objective import micro_batches

WEIGHT_DECAY = 0.1
MODELS = {
    "llama-with-biases": ModelFactory(preset="tiny-llama", config={"attention_bias": True, "mlp_bias": True}),
    "qwen3": ModelFactory(preset="tiny-qwen3"),
}


def optimizer_groups(factory: ModelFactory) -> tuple[CausalLM, list[dict]]:
    """The module and its optimizer's parameter groups after one training step."""
    pl.seed_everything(0, verbose=False)
    module = CausalLM(factory, learning_rate=1e-2, warmup_steps=0, weight_decay=WEIGHT_DECAY)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(micro_batches("reference"), batch_size=None))
    return module, trainer.optimizers[0].param_groups


@pytest.mark.parametrize("model", list(MODELS))
def test_decay_group_holds_exactly_the_2d_non_embedding_matrices(model):
    module, groups = optimizer_groups(MODELS[model])
    names = {id(p): name for name, p in module.model.named_parameters()}
    embedding = module.model.lm.get_input_embeddings().weight
    decaying = {names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    not_decaying = {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert {g["weight_decay"] for g in groups} == {WEIGHT_DECAY, 0.0}

    matrices = {name for name, p in module.model.named_parameters() if p.ndim == 2 and p is not embedding}
    assert decaying == matrices
    assert not_decaying == set(names.values()) - matrices
    # What must not decay is really there: norm gains, biases (Llama) or q/k norms (Qwen3), the embedding.
    assert {n for n in not_decaying if n.endswith("norm.weight")}, not_decaying
    assert "lm.model.embed_tokens.weight" in not_decaying and "lm.lm_head.weight" in decaying
    if model == "llama-with-biases":
        assert {n for n in not_decaying if n.endswith(".bias")}
    else:
        assert {n for n in not_decaying if n.endswith("q_norm.weight")}
