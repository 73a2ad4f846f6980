"""Pooling requests (embeddings, classification): which runner an engine takes, and how a prompt's hidden states
become one vector.

A pooling engine runs prompts only. Its model runner hands back the final hidden states (after the last norm)
where a generating engine hands back logits — a classification model's rows have gone through its linear `score`
head already, so they are label logits; a request finishes when its last prompt chunk has run, with the last
token's row (LAST), the mean over every token (MEAN) or the first token's (CLS). An embedding is L2-normalized
unless asked not to be; a classifier's logits become probabilities (softmax over the labels, or sigmoid for a
single label: vLLM's defaults) unless asked not to (`activation`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import PoolerConfig
from pagedllm.model.models.registry import is_base_model, is_classification_model
from pagedllm.pooling_params import PoolingParams


def resolve_runner(runner: str, convert: str, hf_config: Any) -> str:
    """vLLM's --runner / --convert → "generate" or "pooling"."""
    base = is_base_model(hf_config)
    classifier = is_classification_model(hf_config)
    if convert in ("embed", "classify"):
        if runner == "generate":
            kind = "an embedding" if convert == "embed" else "a classification"
            raise ValueError(f"convert={convert!r} makes {kind} model, which runs the pooling runner: drop "
                             f"runner='generate' or pass runner='pooling'.")
        return "pooling"
    if runner == "auto":
        return "pooling" if base or classifier else "generate"
    if runner == "generate" and (base or classifier):
        archs = getattr(hf_config, "architectures", None)
        use = "embeddings" if base else "classification and scores"
        raise ValueError(f"this checkpoint ({archs[0]}) has no LM head, so it cannot generate text: serve it with "
                         f"runner='pooling' (--runner pooling) for {use}.")
    return runner


def resolve_pooling_task(convert: str, hf_config: Any) -> str:
    """What a pooling model returns (config.POOLING_MODEL_TASKS): "classify" for a *ForSequenceClassification
    checkpoint (unless convert='embed' asks for its hidden states), else "embed"."""
    if is_classification_model(hf_config):
        return "embed" if convert == "embed" else "classify"
    if convert == "classify":
        archs = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")]
        raise ValueError(f"convert='classify' needs a sequence-classification checkpoint (an architecture such as "
                         f"LlamaForSequenceClassification or Qwen3ForSequenceClassification, with its `score.weight` "
                         f"head); this one is {archs[0]}: pass convert='embed' (--convert embed) for embeddings "
                         f"instead.")
    return "embed"


def classification_labels(hf_config: Any) -> tuple[str, ...]:
    """A classifier's label names by class index (the config's `id2label`; LABEL_<i> where it names none)."""
    n = int(getattr(hf_config, "num_labels", 0) or 0)
    id2label = getattr(hf_config, "id2label", None) or {}
    names = {int(k): str(v) for k, v in id2label.items()}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(n))


def matryoshka_dimensions(hf_config: Any) -> tuple[int, ...] | None:
    """The output sizes a Matryoshka model was trained for (vLLM reads `is_matryoshka` / `matryoshka_dimensions`
    from config.json); () = any size up to the hidden size; None = not a Matryoshka model."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def classifier_activation(num_labels: int) -> str:
    """vLLM's default activation of a classifier's logits: softmax over several labels, sigmoid for one."""
    return "softmax" if num_labels > 1 else "sigmoid"


@dataclass
class PoolingState:
    """One pooling request's running reduction over its prompt rows (robust to a recomputed prompt: rows of
    positions already seen are skipped)."""

    params: PoolingParams
    pooling_type: str
    normalize: bool
    activation: str | None = None  # a classifier's: "softmax" or "sigmoid" (None: none)
    sum: torch.Tensor | None = None
    first: torch.Tensor | None = None
    next_pos: int = 0  # rows of positions below this were reduced already
    result: torch.Tensor | None = None

    @classmethod
    def of(cls, params: PoolingParams, pooler: PoolerConfig, num_labels: int | None = None) -> PoolingState:
        """`num_labels`: a classification model's (its rows are label logits); None: an embedding model."""
        if num_labels is not None:
            on = pooler.activation if params.activation is None else params.activation
            return cls(params, pooler.pooling_type, False, classifier_activation(num_labels) if on else None)
        normalize = pooler.normalize if params.normalize is None else params.normalize
        return cls(params, pooler.pooling_type, normalize)

    @property
    def wants_every_row(self) -> bool:
        """MEAN and CLS read rows before the last one (LAST reads the last row only)."""
        return self.pooling_type != "LAST"

    def add_rows(self, start_pos: int, rows: torch.Tensor) -> None:
        """Rows of positions start_pos … start_pos + len(rows) - 1 (MEAN, CLS)."""
        skip = max(0, self.next_pos - start_pos)
        new = rows[skip:].float()
        if not len(new):
            return
        if self.pooling_type == "MEAN":
            part = new.sum(dim=0)
            self.sum = part if self.sum is None else self.sum + part
        elif self.pooling_type == "CLS" and start_pos + skip == 0:
            self.first = new[0].clone()
        self.next_pos = start_pos + skip + len(new)

    def finish(self, last_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The pooled vector (float32, on the CPU), once the prompt's last row ran."""
        if self.pooling_type == "LAST":
            vec = last_row.float().clone()  # the row may sit in a buffer the next step reuses
        elif self.pooling_type == "MEAN":
            vec = self.sum / num_tokens
        else:
            vec = self.first
        if self.params.dimensions is not None:
            vec = vec[: self.params.dimensions]
        if self.normalize:
            vec = torch.nn.functional.normalize(vec, p=2.0, dim=-1)
        if self.activation == "softmax":
            vec = torch.softmax(vec, dim=-1)
        elif self.activation == "sigmoid":
            vec = torch.sigmoid(vec)
        self.result = vec.cpu()
        return self.result
