"""Sequence classifiers (HF's *ForSequenceClassification): the decoder, then a linear `score` head from the
hidden size to the labels, read at the prompt's last token (the pooling runner's LAST pooling).

Token classifiers (HF's *ForTokenClassification) are the same decoder with a `score` head (with a bias, unless the
config sets `token_classification_bias: false`) read at every token: the token_classify task.

The head is linear, so it commutes with pooling: the model runner applies it to the rows a step returns and the
engine pools those logits as it pools hidden states (engine/pooling.py), then applies softmax or sigmoid.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.models.llama import LlamaForCausalLM
from pagedllm.model.models.qwen2 import Qwen2ForCausalLM
from pagedllm.model.models.qwen3 import Qwen3ForCausalLM


def num_labels_of(config: Any) -> int:
    """The classifier's output size: `num_labels` of the HF config (the size of its `id2label`)."""
    n = getattr(config, "num_labels", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"a sequence-classification config needs num_labels >= 1 (or an id2label map), got {n!r}.")
    return n


class SequenceClassifierMixin:
    """Adds HF's `score` head (Linear(hidden, num_labels, bias=False), in the model's dtype) to a *ForCausalLM
    class. The checkpoint has no LM head: ours shares the token embeddings' weight (no memory of its own)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(config, tp, dtype)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.tie_word_embeddings = True
        self.num_labels = num_labels_of(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False, dtype=dtype)
        self.score.weight.requires_grad_(False)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Label logits [rows, num_labels] of final hidden states [rows, hidden]."""
        return self.score(hidden)


class LlamaForSequenceClassification(SequenceClassifierMixin, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(SequenceClassifierMixin, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassifierMixin, Qwen3ForCausalLM):
    pass


class TokenClassifierMixin(SequenceClassifierMixin):
    """HF's GenericForTokenClassification head: `score` = Linear(hidden, num_labels) with a bias unless the config's
    `token_classification_bias` is false (dropout is the identity at inference)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(config, tp, dtype)
        bias = bool(getattr(config, "token_classification_bias", True))
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=bias, dtype=dtype)
        self.score.requires_grad_(False)


class LlamaForTokenClassification(TokenClassifierMixin, LlamaForCausalLM):
    pass


class Qwen2ForTokenClassification(TokenClassifierMixin, Qwen2ForCausalLM):
    pass


class Qwen3ForTokenClassification(TokenClassifierMixin, Qwen3ForCausalLM):
    pass
