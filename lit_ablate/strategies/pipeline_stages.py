"""What a pipeline stage is: its module (``StageModule``), the stand-in for layers other stages hold, and the batch the stages take."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from lit_ablate.errors import ConfigError

if TYPE_CHECKING:
    from lit_ablate.models.causal_lm_with_loss import CausalLMWithLoss


class StageModule(nn.Module):
    """One stage's forward: token ids (first stage) or the previous stage's hidden states in, hidden states out.

    The decoder's own forward runs (masks, rotary positions); the pass-through layers and the
    identity norm make it compute only this stage's part. A rank holding several stages
    (interleaved schedules) gives each one its ``layers``: during the stage's forward the decoder
    runs those only, and its final norm only on the last stage (the decoder's modules are swapped
    for the call, so parameter names and the model's structure stay as built).

    Its submodules (``parts``) are the stage's own layers, embeddings (first) or final norm and LM
    head (last): what torch's ``PipelineStage`` and FSDP take as the stage, so that each of a rank's
    interleaved stages is its own FSDP root. The model is referenced, not registered.
    """

    def __init__(self, model: CausalLMWithLoss, first: bool, last: bool = True, layers: list[int] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)
        self.first, self.last = first, last
        decoder = model.lm.base_model
        held = [index for index, layer in enumerate(decoder.layers)
                if (index in layers if layers is not None else not isinstance(layer, PassThrough))]
        ends = ([decoder.embed_tokens] if first else []) + ([decoder.norm, model.lm.lm_head] if last else [])
        self.parts = nn.ModuleList([decoder.layers[index] for index in held] + ends)
        # A plain list, not a ModuleList: the pass-throughs are no part of the stage.
        self._view = None if layers is None else [
            layer if index in layers else PassThrough() for index, layer in enumerate(decoder.layers)]

    def head_loss(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """The last stage's token-loss sum of its output (final norm applied) through the LM head."""
        head = self.model.lm.get_output_embeddings()
        hidden = hidden.reshape(-1, hidden.shape[-1])
        return self.model.loss_fn(hidden, head.weight, labels.reshape(-1), head.bias)

    def forward(self, x: Tensor) -> Tensor:
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        decoder = self.model.lm.base_model
        if self._view is None:
            return decoder(**inputs, use_cache=False).last_hidden_state
        saved = decoder._modules["layers"], decoder._modules["norm"]
        decoder._modules["layers"] = nn.ModuleList(self._view)
        if not self.last:
            decoder._modules["norm"] = nn.Identity()
        try:
            return decoder(**inputs, use_cache=False).last_hidden_state
        finally:
            decoder._modules["layers"], decoder._modules["norm"] = saved


class PassThrough(nn.Module):
    """Stands in for a decoder layer another stage holds (the layer list keeps its length and names)."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


def pipeline_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch the stages take: token ids and labels; right padding (causal, labels -100) needs no mask."""
    if batch.get("position_ids") is not None or batch.get("cu_seqlens") is not None:
        raise ConfigError("data.init_args.packing", True, "packed batches are not built for pipeline parallelism; "
                          "use unpacked batches")
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ConfigError("data", "attention_mask", "pipeline parallelism takes right-padded batches only")
    return {"input_ids": batch["input_ids"], "labels": batch["labels"]}
