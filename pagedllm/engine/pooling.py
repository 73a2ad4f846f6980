"""Pooling requests (embeddings, classification, per-token outputs): which runner an engine takes, and how a
prompt's hidden states become one vector, or one row per token.

A pooling engine runs prompts only. Its model runner hands back the final hidden states (after the last norm)
where a generating engine hands back logits — a classification model's rows have gone through its linear `score`
head already, so they are label logits (a model converted with convert='reward' hands back its hidden states as
they are: vLLM's as_reward_model); a request finishes when its last prompt chunk has run, with the last
token's row (LAST), the mean over every token (MEAN), the first token's (CLS), every token's row (ALL: the
token_embed and token_classify tasks, gathered across chunks), or the rows of the prompt's step-tag tokens (STEP: a
process reward model's step rewards, `step_tag_id`, in their `returned_token_ids` columns). An embedding is
L2-normalized unless asked not to be (per row for token_embed); a classifier's logits become probabilities (softmax
over the labels, or sigmoid for a single label: vLLM's defaults, per row for token_classify) unless asked not to
(`activation`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedllm.config import PoolerConfig
from pagedllm.model.models.registry import (
    get_model_class,
    is_base_model,
    is_classification_model,
    is_encoder_only,
    is_token_classification_model,
    text_config,
)
from pagedllm.pooling_params import TOKEN_POOLING_TASKS, PoolingParams, check_step_ids

# vLLM's token pooling types (a token task's: one row per prompt token, or per step tag), and STEP's own fields.
TOKEN_POOLING_TYPES = ("ALL", "STEP")
_STEP_FIELDS = ("step_tag_id", "returned_token_ids")


def resolve_runner(runner: str, convert: str, hf_config: Any) -> str:
    """vLLM's --runner / --convert → "generate" or "pooling"."""
    base = is_base_model(hf_config)
    classifier = is_classification_model(hf_config) or is_token_classification_model(hf_config)
    if convert == "reward":
        check_reward_convert(runner, hf_config)
        return "pooling"
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


def check_reward_convert(runner: str, hf_config: Any) -> None:
    """convert='reward' (vLLM's as_reward_model) takes a generating (*ForCausalLM) model to the pooling runner:
    ValueError, naming what is allowed, with runner='generate' or on a checkpoint that is a pooling model already
    (a base model, a classifier, a token classifier or reward model)."""
    if runner == "generate":
        raise ValueError("convert='reward' makes a reward model, which runs the pooling runner: drop "
                         "runner='generate' or pass runner='pooling' (--runner pooling).")
    if is_base_model(hf_config) or is_classification_model(hf_config) or is_token_classification_model(hf_config):
        archs = getattr(hf_config, "architectures", None) or ["?"]
        raise ValueError(f"convert='reward' turns a generating model (a *ForCausalLM architecture) into a reward "
                         f"model returning every token's hidden state; this checkpoint ({archs[0]}) is a pooling "
                         f"model already: drop convert (or pass convert='auto') to serve it as it is, or "
                         f"convert='embed' for embeddings of its hidden states.")


def resolve_pooling_task(convert: str, hf_config: Any) -> str:
    """What a pooling model returns (config.POOLING_MODEL_TASKS): "classify" for a *ForSequenceClassification
    checkpoint, "token_classify" for a *ForTokenClassification one (unless convert='embed' asks for their hidden
    states) and for a model converted with convert='reward' (its hidden states per token), else "embed"."""
    if convert == "reward":
        # Following vLLM's vllm/model_executor/models/adapters.py::as_reward_model (the token_classify version):
        # Pooler.for_token_classify(pooler_config) with no classifier, so the rows are the final hidden states,
        # pooled ALL by default (STEP if the pooler config says so); its TokenClassifierPoolerHead applies
        # PoolerClassify(static_num_labels=False) when use_activation, which token_classify requests default to
        # (vllm/pooling_params.py): softmax over the row's columns (sigmoid for one), as PoolingState does here;
        # activation=False (request or pooler_config) gives the raw hidden states.
        return "token_classify"
    if is_token_classification_model(hf_config):
        return "embed" if convert == "embed" else "token_classify"
    if is_classification_model(hf_config):
        return "embed" if convert == "embed" else "classify"
    if convert == "classify":
        archs = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")]
        raise ValueError(f"convert='classify' needs a sequence-classification checkpoint (an architecture such as "
                         f"LlamaForSequenceClassification or Qwen3ForSequenceClassification, with its `score.weight` "
                         f"head); this one is {archs[0]}: pass convert='embed' (--convert embed) for embeddings "
                         f"instead.")
    return "embed"


# sentence-transformers' Pooling modes → vLLM's pooling types (the ones pagedllm runs), in the order vLLM checks them.
_ST_POOLING_MODES = (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
                     ("pooling_mode_lasttoken", "LAST"))
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


def sentence_transformers_pooling(model_dir: str | Path | None) -> dict[str, Any] | None:
    """What a sentence-transformers checkpoint's `modules.json` (and its Pooling module's `config.json`) says about
    pooling, as vLLM reads it: {"pooling_type": "CLS" | "MEAN" | "LAST", "normalize": a Normalize module follows};
    None where the directory has no such files or names no mode pagedllm runs."""
    if model_dir is None or not (Path(model_dir) / "modules.json").is_file():
        return None
    root = Path(model_dir)
    try:
        modules = json.loads((root / "modules.json").read_text())
        pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
        if pooling is None:
            return None
        config = json.loads((root / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    kind = next((t for key, t in _ST_POOLING_MODES if config.get(key) is True), None)
    if kind is None:
        return None
    return {"pooling_type": kind, "normalize": any(m.get("type") == _ST_NORMALIZE for m in modules)}


def default_pooler_fields(hf_config: Any, task: str, model_dir: str | Path | None) -> dict[str, Any]:
    """The model's own pooler defaults, under any `pooler_config` the user gives (vLLM's order: the user's
    fields, then the sentence-transformers config of an embedding checkpoint, then the model's): token
    classifiers keep every token (ALL), encoder-only models pool CLS (their classification heads read the CLS
    row), decoders the last token."""
    if task == "token_classify":
        return {"pooling_type": "ALL", **_model_pooler_defaults(hf_config)}
    fields: dict[str, Any] = {"pooling_type": "CLS" if is_encoder_only(hf_config) else "LAST"}
    if task == "embed":
        fields.update(sentence_transformers_pooling(model_dir) or {})
    return fields


def resolve_pooler_config(given: Any, hf_config: Any, task: str, model_dir: str | Path | None,
                          convert: str = "auto") -> PoolerConfig:
    """The pooler config: the user's `pooler_config` (a dict, JSON text or a PoolerConfig, whose fields all count
    as given) over the model's defaults (default_pooler_fields). An encoder-only classifier's head reads the CLS
    row, so it takes no other pooling type; a token classifier (or reward model) takes ALL or STEP only, and STEP
    (with its step_tag_id / returned_token_ids: check_step_fields) applies to those only. "ALL" on another model is
    vLLM's token pooling type (what its token_embed / token_classify requests use anyway): its sequence pooling type
    stays the model's default. A model's default step tag applies only where the pooling type is STEP. `convert`:
    vLLM's --convert ("reward": STEP's returned_token_ids index the hidden state's columns)."""
    if isinstance(given, PoolerConfig):  # (an unset step field leaves the model's default, as in vLLM)
        fields = {f.name: getattr(given, f.name) for f in dataclasses.fields(given)
                  if f.name not in _STEP_FIELDS or getattr(given, f.name) is not None}
    else:
        user = PoolerConfig.from_json(given)  # validates the user's JSON and keys
        fields = {k: getattr(user, k) for k in _given_keys(given)}
    defaults = default_pooler_fields(hf_config, task, model_dir)
    if task == "token_classify" and fields.get("pooling_type", "ALL") not in TOKEN_POOLING_TYPES:
        archs = getattr(hf_config, "architectures", None) or ["?"]
        raise ValueError(f"pooler_config pooling_type={fields['pooling_type']!r}: {archs[0]} classifies every "
                         f"token, so it takes pooling_type 'ALL' only (every token's row) or 'STEP' (the rows of "
                         f"its step-tag tokens); drop the pooling_type, or pass convert='embed' for "
                         f"{fields['pooling_type']} embeddings of its hidden states.")
    if task != "token_classify" and fields.get("pooling_type") == "STEP":
        raise _step_unsupported(hf_config, task)
    if task != "token_classify" and fields.get("pooling_type") == "ALL":
        del fields["pooling_type"]
    merged = {**defaults, **fields}
    if merged.get("pooling_type") != "STEP":  # a model's default step tag applies to STEP only
        merged = {k: v for k, v in merged.items() if k in fields or k not in _STEP_FIELDS}
    pooler = PoolerConfig.from_json(merged)
    check_step_fields(pooler, hf_config, convert)
    if task == "classify" and is_encoder_only(hf_config) and pooler.pooling_type != "CLS":
        archs = getattr(hf_config, "architectures", None) or ["?"]
        raise ValueError(f"pooler_config pooling_type={pooler.pooling_type!r}: {archs[0]}'s classification head "
                         f"reads the CLS token's hidden state, so it takes pooling_type 'CLS' only; drop the "
                         f"pooling_type or pass convert='embed' for {pooler.pooling_type} embeddings.")
    return pooler


def _model_pooler_defaults(hf_config: Any) -> dict[str, Any]:
    """The model class's own pooler defaults (its `pooler_defaults()`: a reward model's pooling type, step tag and
    activation, as vLLM's default_pooling_type / VerifyAndUpdateConfig); {} for other classes."""
    try:
        hook = getattr(get_model_class(hf_config), "pooler_defaults", None)
    except ValueError:
        return {}
    return dict(hook()) if hook is not None else {}


def _step_unsupported(hf_config: Any, task: str) -> ValueError:
    archs = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")]
    kind = "a classification" if task == "classify" else "an embedding"
    return ValueError(f"pooler_config pooling_type='STEP' keeps the step-tag tokens' rows of a model that classifies "
                      f"every token: a reward model (Qwen2ForProcessRewardModel, whose default it is, or "
                      f"Qwen2ForRewardModel) or a *ForTokenClassification checkpoint; this one is {archs[0]}, "
                      f"served as {kind} model, without per-token classifier outputs. (A *ForCausalLM served as a "
                      f"pooling model pools its hidden states, as in vLLM, not vocabulary logits: math-shepherd-style "
                      f"returned_token_ids over the vocabulary are not offered.) Use pooling_type 'ALL', 'LAST', "
                      f"'MEAN' or 'CLS' here, or convert='reward' (--convert reward) for STEP over its hidden states.")


def check_step_fields(pooler: PoolerConfig, hf_config: Any, convert: str = "auto") -> None:
    """STEP's `step_tag_id` / `returned_token_ids`: only with pooling_type STEP, a token id of the vocabulary, and
    columns of the model's outputs (its labels); ValueError naming what is allowed."""
    given = [k for k in _STEP_FIELDS if getattr(pooler, k) is not None]
    if given and pooler.pooling_type != "STEP":
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"pooler_config {' and '.join(given)} {verb} to pooling_type 'STEP' only, and this pooler "
                         f"is {pooler.pooling_type!r}: add \"pooling_type\": \"STEP\" (on a model that classifies "
                         f"every token: a reward model or *ForTokenClassification checkpoint) or drop them.")
    if pooler.pooling_type != "STEP":
        return
    check_step_ids(pooler.step_tag_id, pooler.returned_token_ids, vocab_size(hf_config),
                   len(classification_labels(hf_config, convert)), "pooler_config ")


def vocab_size(hf_config: Any) -> int | None:
    """The (text) model's vocabulary size; None where the config names none."""
    n = getattr(text_config(hf_config), "vocab_size", None) if hf_config is not None else None
    return int(n) if isinstance(n, int) and n > 0 else None


def _given_keys(given: Any) -> list[str]:
    if given is None or given == "":
        return []
    value = json.loads(given) if isinstance(given, str) else given
    return list(value)


def check_encoder_step_budget(max_num_batched_tokens: int, max_model_len: int, hf_config: Any) -> None:
    """An encoder runs each prompt whole in one step: the step budget must hold the longest prompt."""
    if max_num_batched_tokens < max_model_len:
        archs = getattr(hf_config, "architectures", None) or ["?"]
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is less than max_model_len="
                         f"{max_model_len}: {archs[0]} is encoder-only and runs each prompt whole in one step "
                         f"(no chunked prefill), so raise max_num_batched_tokens to at least {max_model_len} or "
                         f"lower max_model_len.")


def token_type_start(token_type_ids: Any, num_tokens: int) -> int | None:
    """A pair prompt's token types (0 for the first segment, then 1 for the second: BERT's) as the position where
    the 1s start (vLLM's compressed form); None where all are 0. ValueError for any other shape of types."""
    if not isinstance(token_type_ids, (list, tuple)) or len(token_type_ids) != num_tokens:
        n = len(token_type_ids) if isinstance(token_type_ids, (list, tuple)) else type(token_type_ids).__name__
        raise ValueError(f"token_type_ids must be a list of one 0 or 1 per prompt token ({num_tokens}), got {n}.")
    start = next((i for i, t in enumerate(token_type_ids) if t == 1), num_tokens)
    if any(t != 0 for t in token_type_ids[:start]) or any(t != 1 for t in token_type_ids[start:]):
        raise ValueError("token_type_ids must be 0s then 1s (a text pair's first and second segment), as a "
                         "tokenizer's pair encoding gives them.")
    return start if start < num_tokens else None


def classification_labels(hf_config: Any, convert: str = "auto") -> tuple[str, ...]:
    """A classifier's label names by class index (the config's `id2label`; LABEL_<i> where it names none). A reward
    model's label count is its architecture's (as vLLM sets it), whatever the config says; a model converted with
    convert='reward' has one column per hidden-state value (its rows are the hidden states)."""
    if convert == "reward":
        return tuple(f"LABEL_{i}" for i in range(int(text_config(hf_config).hidden_size)))
    n = fixed_num_labels(hf_config) or int(getattr(hf_config, "num_labels", 0) or 0)
    id2label = getattr(hf_config, "id2label", None) or {}
    names = {int(k): str(v) for k, v in id2label.items()}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(n))


def fixed_num_labels(hf_config: Any) -> int | None:
    """A reward model's output size, set by its architecture (Qwen2ForRewardModel 1, Qwen2ForProcessRewardModel 2);
    None for other models (their config's num_labels counts)."""
    if not is_token_classification_model(hf_config):
        return None
    try:
        return getattr(get_model_class(hf_config), "reward_num_labels", None)
    except ValueError:
        return None


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


@dataclass(frozen=True)
class StepSelection:
    """STEP pooling's choice for one prompt (vLLM's StepPool): the positions whose rows it keeps (those of the
    step-tag tokens; None: every row) and the columns of each (`returned_token_ids`; None: all)."""

    positions: torch.Tensor | None  # sorted int64 prompt positions
    columns: tuple[int, ...] | None

    @classmethod
    def of(cls, params: PoolingParams, pooler: PoolerConfig, token_ids: list[int] | None) -> StepSelection:
        """The request's `step_tag_id` / `returned_token_ids`, else the pooler config's; `token_ids`: the prompt's
        (None: an embeddings prompt, which has none to find a step tag among)."""
        tag = params.step_tag_id if params.step_tag_id is not None else pooler.step_tag_id
        columns = params.returned_token_ids if params.returned_token_ids is not None else pooler.returned_token_ids
        positions = None
        if tag is not None:
            if token_ids is None:
                raise ValueError(f"STEP pooling with step_tag_id={tag} keeps the rows of that token in the prompt, "
                                 f"and a prompt given as embeddings has no token ids: pass token ids or text.")
            positions = torch.tensor([i for i, t in enumerate(token_ids) if t == tag], dtype=torch.long)
        return cls(positions, tuple(columns) if columns else None)

    def select(self, start_pos: int, rows: torch.Tensor) -> torch.Tensor:
        """The kept rows among those of positions start_pos … start_pos + len(rows) - 1, in their kept columns."""
        if self.positions is not None:
            p = self.positions
            local = p[(p >= start_pos) & (p < start_pos + len(rows))] - start_pos
            rows = rows[local.to(rows.device)]
        if self.columns is not None:
            rows = rows[:, list(self.columns)]
        return rows


@dataclass
class PoolingState:
    """One pooling request's running reduction over its prompt rows (robust to a recomputed prompt: rows of
    positions already seen are skipped). `pooling_type` "ALL" keeps every row (the token tasks), "STEP" the rows
    `step` selects."""

    params: PoolingParams
    pooling_type: str
    normalize: bool
    activation: str | None = None  # a classifier's: "softmax" or "sigmoid" (None: none)
    step: StepSelection | None = None  # STEP's rows and columns
    sum: torch.Tensor | None = None
    first: torch.Tensor | None = None
    rows: list[torch.Tensor] = field(default_factory=list)  # ALL, STEP: the rows so far, in position order
    next_pos: int = 0  # rows of positions below this were reduced already
    result: torch.Tensor | None = None

    @classmethod
    def of(cls, params: PoolingParams, pooler: PoolerConfig, num_labels: int | None = None,
           token_ids: list[int] | None = None) -> PoolingState:
        """`num_labels`: a classification model's (its rows are label logits); None: an embedding model. A token
        task (or "encode" on a model whose pooler is ALL or STEP) pools per token: STEP where the pooler is STEP
        (its step tag found among `token_ids`, the prompt's), else ALL. A classifier's activation is softmax, or
        sigmoid for one value per row (vLLM's, by the width of the rows returned)."""
        per_token = params.task in TOKEN_POOLING_TASKS or (params.task in (None, "encode")
                                                           and pooler.pooling_type in TOKEN_POOLING_TYPES)
        pooling_type = ("STEP" if pooler.pooling_type == "STEP" else "ALL") if per_token else pooler.pooling_type
        step = StepSelection.of(params, pooler, token_ids) if pooling_type == "STEP" else None
        if num_labels is not None:
            on = pooler.activation if params.activation is None else params.activation
            width = len(step.columns) if step is not None and step.columns else num_labels
            return cls(params, pooling_type, False, classifier_activation(width) if on else None, step)
        normalize = pooler.normalize if params.normalize is None else params.normalize
        return cls(params, pooling_type, normalize, step=step)

    @property
    def wants_every_row(self) -> bool:
        """MEAN, CLS, ALL and STEP read rows before the last one (LAST reads the last row only); such a request
        computes its whole prompt (a cached prefix has no rows)."""
        return self.pooling_type != "LAST"

    def add_rows(self, start_pos: int, rows: torch.Tensor) -> None:
        """Rows of positions start_pos … start_pos + len(rows) - 1 (MEAN, CLS, ALL, STEP)."""
        skip = max(0, self.next_pos - start_pos)
        new = rows[skip:].float()
        if not len(new):
            return
        if self.pooling_type == "MEAN":
            part = new.sum(dim=0)
            self.sum = part if self.sum is None else self.sum + part
        elif self.pooling_type == "CLS" and start_pos + skip == 0:
            self.first = new[0].clone()
        elif self.pooling_type == "ALL":
            self.rows.append(new.clone())  # the step's buffer is reused by the next step
        elif self.pooling_type == "STEP":
            self.rows.append(self.step.select(start_pos + skip, new).clone())
        self.next_pos = start_pos + skip + len(new)

    def finish(self, last_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The pooled vector (float32, on the CPU), once the prompt's last row ran; ALL: [num_tokens, dim]; STEP:
        [num_step_tags, num_columns] (no rows where the prompt has no step tag, as vLLM)."""
        if self.pooling_type == "LAST":
            vec = last_row.float().clone()  # the row may sit in a buffer the next step reuses
        elif self.pooling_type == "MEAN":
            vec = self.sum / num_tokens
        elif self.pooling_type == "ALL":
            vec = torch.cat(self.rows)[:num_tokens]
            self.rows = []
        elif self.pooling_type == "STEP":
            vec = torch.cat(self.rows) if self.rows else self.step.select(0, last_row[None].float())[:0]
            vec = vec[:num_tokens] if self.step.positions is None else vec
            self.rows = []
        else:
            vec = self.first
        if self.params.dimensions is not None:
            vec = vec[..., : self.params.dimensions]
        if self.normalize:
            vec = torch.nn.functional.normalize(vec, p=2.0, dim=-1)
        if self.activation == "softmax":
            vec = torch.softmax(vec, dim=-1)
        elif self.activation == "sigmoid":
            vec = torch.sigmoid(vec)
        self.result = vec.cpu()
        return self.result
