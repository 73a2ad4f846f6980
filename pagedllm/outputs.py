"""What the engine returns: vLLM's RequestOutput and CompletionOutput, and the pooling runner's outputs (embeddings,
class probabilities, scores)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedllm.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    lora_request: object = None  # the LoRARequest it ran with (vLLM's field)


@dataclass
class DeltaCursor:
    """How much of one completion a ``RequestOutputKind.DELTA`` request has handed out: `take` returns what came
    after it (new token ids, new text, new logprobs) and moves it to the end."""

    num_tokens: int = 0
    text_len: int = 0
    num_logprobs: int = 0
    finish_sent: bool = False

    def take(self, index: int, token_ids: Any, text: str, cumulative_logprob: float | None,
             logprobs: Any, finish_reason: str | None, stop_reason: int | str | None) -> CompletionOutput | None:
        """The completion's part since the last call; None when nothing is new (no token, no text, and no
        finish not yet sent). `token_ids` and `logprobs` are the whole sequences so far (lists or tuples)."""
        new_ids = token_ids[self.num_tokens:]
        new_text = text[self.text_len:]
        new_logprobs = None if logprobs is None else list(logprobs[self.num_logprobs:])
        finishing = finish_reason is not None and not self.finish_sent
        if not new_ids and not new_text and not new_logprobs and not finishing:
            return None
        self.num_tokens = len(token_ids)
        self.text_len = len(text)
        self.num_logprobs = 0 if logprobs is None else len(logprobs)
        self.finish_sent = finish_reason is not None
        return CompletionOutput(index=index, text=new_text, token_ids=list(new_ids),
                                cumulative_logprob=cumulative_logprob, logprobs=new_logprobs,
                                finish_reason=finish_reason, stop_reason=stop_reason)


@dataclass
class DeltaState:
    """A DELTA request's cursors, one per completion index, and whether its prompt logprobs went out (they
    travel in its first output only, as vLLM's)."""

    cursors: dict[int, DeltaCursor] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False

    def cursor(self, index: int) -> DeltaCursor:
        cur = self.cursors.get(index)
        if cur is None:
            cur = self.cursors[index] = DeltaCursor()
        return cur

    def prompt_logprobs(self, value: PromptLogprobs | None) -> PromptLogprobs | None:
        if self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return value

    def delta_of(self, out: RequestOutput) -> RequestOutput | None:
        """A cumulative output → its delta since the previous call (None when nothing is new and it is not the
        finished one)."""
        comps = [c for c in (self.cursor(o.index).take(o.index, o.token_ids, o.text, o.cumulative_logprob,
                                                        o.logprobs, o.finish_reason, o.stop_reason)
                             for o in out.outputs) if c is not None]
        if not comps and not out.finished:
            return None
        return dataclasses.replace(out, outputs=comps, prompt_logprobs=self.prompt_logprobs(out.prompt_logprobs))


@dataclass
class PoolingOutput:
    """The pooled hidden state of one prompt (a float32 CPU tensor: [dim], or [num_prompt_tokens, dim] for the
    per-token tasks)."""

    data: object  # torch.Tensor; typed loosely so this module stays import-light


@dataclass
class PoolingRequestOutput:
    """What a pooling request returns (vLLM's): one `PoolingOutput` for the whole prompt."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class _PoolingTaskRequestOutput:
    """A pooling request's result typed for its task (vLLM's *RequestOutput classes): `outputs` wraps the pooled
    vector as a list of floats in the task's output class (`output_cls`)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    output_cls: ClassVar[type] = list

    @classmethod
    def from_base(cls, out: PoolingRequestOutput):
        data = out.outputs.data
        return cls(out.request_id, cls.output_cls([] if data is None else data.tolist()), out.prompt_token_ids,
                   out.finished, out.num_cached_tokens)


@dataclass
class EmbeddingRequestOutput(_PoolingTaskRequestOutput):
    """`LLM.embed`'s result per prompt (vLLM's): `.outputs.embedding` is a list of floats."""

    outputs: EmbeddingOutput
    output_cls: ClassVar[type] = EmbeddingOutput


@dataclass
class ClassificationOutput:
    """A classifier's class probabilities for one prompt (vLLM's): softmax over the labels, or the sigmoid of a
    single label's logit (raw logits with activation=False)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(_PoolingTaskRequestOutput):
    """`LLM.classify`'s result per prompt (vLLM's): `.outputs.probs` is a list of floats, one per label."""

    outputs: ClassificationOutput
    output_cls: ClassVar[type] = ClassificationOutput


@dataclass
class ScoringOutput:
    """The score of one text pair (vLLM's): a cross-encoder's probability, or the cosine similarity of two
    embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result per pair (vLLM's): `.outputs.score`; `prompt_token_ids`: the pair's prompt (a
    cross-encoder) or both texts' prompts one after the other (an embedding model)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ScoringRequestOutput:
        """From a cross-encoder's output (its one probability)."""
        data = out.outputs.data
        if data is None or data.numel() != 1:
            raise ValueError(f"a score is one value per pair; this output holds "
                             f"{0 if data is None else data.numel()} (a classifier of several labels?).")
        return cls(out.request_id, ScoringOutput(float(data.reshape(-1)[0])), out.prompt_token_ids, out.finished,
                   out.num_cached_tokens)
