"""Qwen2 reward models (vLLM's qwen2_rm.py): the Qwen2 decoder and a two-layer `score` head read at every token.

`Qwen2ForRewardModel` (Qwen2.5-Math-RM-72B) gives one reward per token (ALL pooling, raw values: no activation
unless a request asks for it); `Qwen2ForProcessRewardModel` (Qwen2.5-Math-PRM-7B) gives two logits per token and
pools STEP: the rows of the step-tag tokens (`<extra_0>`, id 151651, by default), softmaxed. Both run the pooling
runner's token_classify task (`LLM.reward`, `LLM.encode`, `POST /pooling`).

Checkpoint names: `model.*` (the decoder), `score.0.weight/bias` (Linear(hidden, hidden)), `score.2.weight/bias`
(Linear(hidden, num_labels)); an `lm_head.*` tensor, if any, is skipped (the LM head is never used). As in vLLM, the
number of labels is the architecture's (1 or 2), whatever the config's `num_labels` says (transformers' default is 2).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.models.qwen2 import Qwen2ForCausalLM

# Qwen2.5-Math-PRM's step separator, `<extra_0>` (vLLM's Qwen2ForProcessRewardModelConfig default).
QWEN2_PRM_STEP_TAG_ID = 151651


def reward_head(hidden_size: int, num_labels: int, dtype: torch.dtype) -> nn.Sequential:
    """Linear(hidden, hidden) → ReLU → Linear(hidden, num_labels), both with biases, frozen."""
    head = nn.Sequential(nn.Linear(hidden_size, hidden_size, dtype=dtype), nn.ReLU(),
                         nn.Linear(hidden_size, num_labels, dtype=dtype))
    head.requires_grad_(False)
    return head


class Qwen2RewardBaseModel(Qwen2ForCausalLM):
    """The decoder and its reward head. The checkpoint has no LM head: ours shares the token embeddings' weight (no
    memory of its own). Subclasses set `reward_num_labels` and their pooler defaults (engine/pooling.py reads
    `pooler_defaults()`, as vLLM's default_pooling_type decorator and VerifyAndUpdateConfig hooks)."""

    reward_num_labels: ClassVar[int] = 1

    @classmethod
    def pooler_defaults(cls) -> dict[str, Any]:
        """The pooler config fields this architecture defaults to (under the user's `pooler_config`)."""
        return {"pooling_type": "ALL"}

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(config, tp, dtype)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.tie_word_embeddings = True
        self.num_labels = self.reward_num_labels
        self.score = reward_head(int(config.hidden_size), self.num_labels, dtype)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per-token rewards (logits) [rows, num_labels] of final hidden states [rows, hidden]."""
        return self.score(hidden)


class Qwen2ForRewardModel(Qwen2RewardBaseModel):
    """An outcome reward model: one raw reward per token (pooling ALL, activation off: vLLM's defaults)."""

    reward_num_labels: ClassVar[int] = 1

    @classmethod
    def pooler_defaults(cls) -> dict[str, Any]:
        return {"pooling_type": "ALL", "activation": False}


class Qwen2ForProcessRewardModel(Qwen2RewardBaseModel):
    """A process reward model: two logits per token, pooled STEP at the step-tag tokens and softmaxed."""

    reward_num_labels: ClassVar[int] = 2

    @classmethod
    def pooler_defaults(cls) -> dict[str, Any]:
        return {"pooling_type": "STEP", "step_tag_id": QWEN2_PRM_STEP_TAG_ID}
