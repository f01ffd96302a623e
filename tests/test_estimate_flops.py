"""Analytic FLOPs per token (what MFU divides) against torch's FLOP counter."""

import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lit_ablate.estimate.flops import batch_model_flops, count_parameters, count_parameters_of_config, flops_per_token
from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss
from lit_ablate.models.factory import ModelFactory
from lit_ablate.models.losses.cross_entropy import loss_backend


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_analytic_flops_match_flop_counter(preset):
    """FlopCounterMode counts matmuls in forward and backward. Eager attention makes the score
    and value matmuls explicit (CPU's fused SDPA kernel is invisible to the counter). Both sides
    ignore element-wise work (norms, activations, softmax, the loss). Measured agreement is
    about 0.1%; the 1% tolerance leaves room for small per-architecture matmuls the formula
    folds into 6N, while a missing attention term (~8% here) or a wrong N would fail."""
    torch.manual_seed(0)
    factory = ModelFactory(preset=preset, attn_implementation="eager")
    model = CausalLMWithLoss(factory.build(), loss_backend("torch"))
    batch, seq = 2, 64
    ids = torch.randint(0, 300, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        loss_sum, _ = model({"input_ids": ids, "labels": ids})
        loss_sum.backward()
    analytic = flops_per_token(count_parameters(model.lm, model.lm.config), model.lm.config, seq) * batch * seq
    assert counter.get_total_flops() == pytest.approx(analytic, rel=0.01)


def test_moe_counts_only_active_experts():
    config = ModelFactory(preset="tiny-qwen3-moe").hf_config()
    counts = count_parameters_of_config(config)
    assert counts.experts > 0
    share = config.num_experts_per_tok / config.num_experts
    assert counts.active == counts.total - counts.experts + int(counts.experts * share)
    dense = count_parameters_of_config(ModelFactory(preset="tiny-qwen3").hf_config())
    assert counts.embedding == dense.embedding


def test_tied_embedding_head_is_counted_as_a_matmul():
    factory = ModelFactory(preset="tiny-llama", config={"tie_word_embeddings": True})
    config = factory.hf_config()
    counts = count_parameters_of_config(config)
    assert counts.matmul == counts.active  # the shared table is the LM head: a real matmul


def test_batch_flops_count_each_document_at_its_own_context_and_no_padding():
    """A packed batch's FLOPs equal the sum of its documents' FLOPs run alone (the attention term is
    per document), not the row length's, which would inflate packed MFU; padding counts nothing."""
    model = ModelFactory(preset="tiny-llama").build()
    counts = count_parameters(model, model.config)
    per_token = functools.partial(flops_per_token, counts, model.config)
    lengths = [7, 5, 12, 4]  # documents of two packed rows of 16 (4 padding positions)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long), "document_lengths": lengths}
    alone = sum(per_token(n) * n for n in lengths)
    assert batch_model_flops(batch, per_token) == pytest.approx(alone, rel=1e-12)
    row_long = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}  # no lengths: every position, row-long context
    assert batch_model_flops(row_long, per_token) == pytest.approx(per_token(16) * 32, rel=1e-12)


def test_collators_report_document_lengths_without_padding():
    from lit_ablate.data import PackingCollator, PaddingCollator

    examples = [{"input_ids": torch.arange(n), "labels": torch.arange(n)} for n in (3, 5, 2)]
    padding = PaddingCollator(pad_to_multiple_of=8)
    padding.bind(pad_id=0, seq_len=16)
    assert padding(examples)["document_lengths"] == [3, 5, 2]
    packing = PackingCollator(max_tokens=16, static_shape=True)
    packing.bind(pad_id=0, seq_len=16)
    batch = packing([examples[:2], examples[2:]])
    assert batch["document_lengths"] == [3, 5, 2] and batch["input_ids"].shape == (2, 16)
