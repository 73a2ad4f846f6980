"""Loading a model for the pooling runner: its LM head is never used, and a base-model checkpoint has none."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn


def share_lm_head_with_embeddings(model: nn.Module) -> None:
    """Point the LM head at the token embeddings (as a tied model does), so it holds no memory of its own and a
    checkpoint's head, if any, is skipped. Models without that layout keep their head."""
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None or embed is None or head.weight.shape != embed.weight.shape:
        return
    head.weight = embed.weight
    model.tie_word_embeddings = True


def base_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A base-model checkpoint's tensors (``layers.0…``, ``embed_tokens.weight``) under the names of the
    *ForCausalLM module tree (``model.layers.0…``)."""
    for name, tensor in weights:
        yield (name if name.startswith("model.") else "model." + name), tensor
