"""vLLM's PoolingParams: the per-request options of a pooling request (`LLM.embed`, `LLM.classify`, `LLM.score`,
`LLM.reward`, `LLM.encode`, `/v1/embeddings`, `/classify`, `/v1/score`, `/rerank`, `/pooling`)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import check_token_id, check_token_ids
from pagedllm.sampling_params import _check_bool, _check_opt_int

# vLLM's pooling tasks: "encode" (what the model returns by default), "embed" (an embedding model's vector),
# "classify" (a classifier's class probabilities), "score" (a cross-encoder's one probability for a text pair), and
# the per-token ones (ALL pooling: one row per prompt token): "token_embed" (every token's embedding) and
# "token_classify" (every token's class probabilities).
POOLING_TASKS = ("embed", "encode", "classify", "score", "token_embed", "token_classify")
TOKEN_POOLING_TASKS = ("token_embed", "token_classify")


@dataclass
class PoolingParams:
    """`dimensions`: keep the embedding's first this many values (Matryoshka models only, as in vLLM);
    `normalize`: L2-normalize the embedding (None: the model's pooler config, by default True);
    `activation`: a classification model's softmax (sigmoid for one label) over its logits (None: the pooler
    config, by default True; False: the raw logits);
    `truncate_prompt_tokens`: keep the prompt's last this many tokens (-1: as many as fit);
    `step_tag_id`, `returned_token_ids`: a STEP-pooling model's (a process reward model's) rows to keep (those of
    the prompt tokens with this id) and columns to return (None: the pooler config's, vLLM's fields)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None  # one of POOLING_TASKS (None: what the model does)
    activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.step_tag_id = check_token_id("step_tag_id", self.step_tag_id)
        if self.returned_token_ids is not None:  # ([] stays [], vLLM's "every column", which the pooler's None is)
            self.returned_token_ids = check_token_ids("returned_token_ids", self.returned_token_ids) or []
        self.dimensions = _check_opt_int("dimensions", self.dimensions)
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions}.")
        if self.normalize is not None:
            self.normalize = _check_bool("normalize", self.normalize)
        if self.activation is not None:
            self.activation = _check_bool("activation", self.activation)
        self.truncate_prompt_tokens = _check_opt_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise ValueError(f"truncate_prompt_tokens must be at least 1, or -1 (as many as fit), got {k}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}.")


def check_step_ids(step_tag_id: int | None, returned_token_ids: list[int] | None, vocab: int | None,
                   num_labels: int, where: str = "") -> None:
    """`step_tag_id` in the vocabulary (where its size is known), `returned_token_ids` among the `num_labels`
    output columns; ValueError naming the allowed range."""
    if step_tag_id is not None and vocab is not None and step_tag_id >= vocab:
        raise ValueError(f"{where}step_tag_id={step_tag_id} is not a token of this model's vocabulary (ids 0 to "
                         f"{vocab - 1}): set step_tag_id to the id of its step separator (Qwen2ForProcessRewardModel "
                         f"defaults to 151651, Qwen2.5-Math-PRM's <extra_0>).")
    bad = [t for t in returned_token_ids or () if t >= num_labels]
    if bad:
        raise ValueError(f"{where}returned_token_ids {bad} are out of range: this model returns {num_labels} "
                         f"values per token (columns 0 to {num_labels - 1}).")
