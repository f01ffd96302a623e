"""Every suggestion a refusal makes points at a key that exists and takes the value: applied, it is accepted
and acts (issue 53). Each case is refused first, its suggestion read from the refusal's own words, applied,
and the result checked where the value acts: the optimizer's parameter groups, DPO's loss, the strategy
Lightning builds.

Seen failing before: ``optimizer_options: {weight_decai: 0.1}`` was told "did you mean weight_decay?", which
was then accepted and silently ignored (the decay groups' own rate wins); ``optimizer_options: {betas}`` was
told "AdamW takes no betas"; DPO's ``beta`` there was offered ``betas``; a misspelt strategy got a list of
1,150 characters and no suggestion.
"""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lit_ablate.errors import ConfigError
from lit_ablate.models.factory import ModelFactory
from lit_ablate.modules.causal_lm import CausalLM
from lit_ablate.modules.dpo import DPO
from lit_ablate.strategy_choice import strategy_class_path

SUGGESTED_KEY = re.compile(r"(?:did you mean|set) (model\.init_args\.[\w.]+)")


def suggestion(refusal: ConfigError) -> str:
    found = SUGGESTED_KEY.search(str(refusal))
    assert found, f"no key suggested: {refusal}"
    return found.group(1)


def applied(module_class: type, options: dict, **arguments) -> tuple[str, object]:
    """Make ``module_class`` with ``optimizer_options=options``: refused; then with the option moved to the
    key the refusal suggests: returns that key and the module made."""
    with pytest.raises(ConfigError) as refused:
        module_class(ModelFactory(preset="tiny-llama"), optimizer_options=options, **arguments)
    key = suggestion(refused.value)
    (value,) = options.values()
    argument = key.removeprefix("model.init_args.")
    return key, module_class(ModelFactory(preset="tiny-llama"), **{**arguments, argument: value})


def optimizer_of(module: CausalLM) -> torch.optim.Optimizer:
    """The optimizer ``module`` trains with, after one step on one batch (where its groups are made)."""
    tokens = torch.randint(0, 200, (1, 16))
    batch = {"input_ids": tokens, "labels": tokens, "attention_mask": torch.ones_like(tokens)}
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader([batch], batch_size=None))
    return trainer.optimizers[0]


def test_a_misspelt_weight_decay_is_sent_to_the_module_s_key_and_acts():
    key, module = applied(CausalLM, {"weight_decai": 0.23}, warmup_steps=0)
    assert key == "model.init_args.weight_decay"
    assert {group["weight_decay"] for group in optimizer_of(module).param_groups} == {0.0, 0.23}  # decay groups


def test_betas_in_optimizer_options_are_sent_to_the_module_s_key_and_act():
    key, module = applied(CausalLM, {"betas": (0.8, 0.9)}, warmup_steps=0)
    assert key == "model.init_args.betas"
    assert all(group["betas"] == (0.8, 0.9) for group in optimizer_of(module).param_groups)


def test_a_learning_rate_in_optimizer_options_is_sent_to_learning_rate():
    key, module = applied(CausalLM, {"lr": 0.02}, warmup_steps=0)
    assert key == "model.init_args.learning_rate" and module.hparams.learning_rate == 0.02


def test_dpo_s_beta_in_optimizer_options_is_sent_to_dpo_s_beta_and_acts():
    for options in ({"beta": 0.25}, {"bta": 0.25}):  # the argument itself, and a misspelling of it
        key, module = applied(DPO, options)
        assert key == "model.init_args.beta" and module.preference_loss.beta == 0.25


def test_an_option_of_the_optimizer_is_suggested_under_optimizer_options():
    with pytest.raises(ConfigError) as refused:
        CausalLM(ModelFactory(preset="tiny-llama"), optimizer_options={"epss": 1e-7})
    assert "did you mean model.init_args.optimizer_options.eps?" in str(refused.value)
    CausalLM(ModelFactory(preset="tiny-llama"), optimizer_options={"eps": 1e-7})  # accepted as suggested


def test_a_misspelt_strategy_gets_the_closest_name_which_is_accepted():
    with pytest.raises(ConfigError) as refused:
        strategy_class_path("FSDP2Strategyy")
    message = str(refused.value)
    assert message.endswith("not a strategy; did you mean FSDP2Strategy?") and len(message) < 200
    assert strategy_class_path(message.rsplit(" ", 1)[-1].rstrip("?")) == "lit_ablate.strategies.FSDP2Strategy"
