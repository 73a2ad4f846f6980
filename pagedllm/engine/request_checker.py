"""The checks a request must pass before it is queued, from the configuration alone.

`LLMEngine.add_request` runs them, and so does the async front on the caller's side (`check_request`),
so a bad request is refused with a clear error before it reaches the engine loop. The checker is
plain data: the API server process gets it from the engine-core process and checks requests without
an engine of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.kv_cache_groups import blocks_for_sequence

from pagedllm.engine.prompt_embeds import PROMPT_EMBEDS_KEY, checked_prompt_embeds, is_embeds_prompt
from pagedllm.pooling_params import PoolingParams, check_step_ids
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestChecker:
    vocab_size: int
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20  # -1: no cap
    runner: str = "generate"  # or "pooling": requests take PoolingParams
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] | None = None  # engine/pooling.matryoshka_dimensions
    # runner "pooling": "embed" (an embedding model), "classify" (a classifier) or "token_classify" (a token
    # classifier)
    pooling_task: str | None = None
    labels: tuple[str, ...] = ()  # a classifier's label names by class index (its config's id2label)
    cls_classifier: bool = False  # the classifier's head reads the CLS row only (encoders): no token_classify
    sliding_window: int | None = None  # the window every layer shares: blocks behind it are freed (BlockManager)
    # A hybrid model's KV cache groups' windows (core/kv_cache_groups.py); None: one group with `sliding_window`.
    group_windows: tuple[int | None, ...] | None = None
    enable_prompt_embeds: bool = False  # prompts may be embeddings (engine/prompt_embeds.py)
    logits_processors: tuple[type, ...] = ()  # custom LogitsProcessor classes: each validates a request's params
    pooling_type: str | None = None  # runner "pooling": its pooler config's (STEP takes step_tag_id and its kin)

    @property
    def max_seq_len(self) -> int:
        """Longest a sequence may grow alone in the pool: the model's limit, or less where the pool cannot hold its
        blocks: every block of a full-attention group's table, and a sliding group's window plus one step's chunk
        (its blocks behind the window are freed)."""
        windows = self.group_windows or (self.sliding_window,)
        chunk = min(self.max_num_batched_tokens or self.max_model_len, self.max_model_len)

        def blocks_needed(length: int) -> int:
            return blocks_for_sequence(windows, length, self.block_size, chunk)

        if blocks_needed(self.max_model_len) <= self.num_gpu_blocks:
            return self.max_model_len
        lo, hi = 0, self.max_model_len  # blocks_needed grows with the length: the longest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if blocks_needed(mid) <= self.num_gpu_blocks else (lo, mid - 1)
        return lo

    def check_pooling_params(self, params: PoolingParams | None) -> PoolingParams:
        """A pooling request's parameters (None: the defaults); ValueError on a generating engine, on
        SamplingParams, or on `dimensions` the model was not trained for."""
        if self.runner != "pooling":
            raise ValueError("this model generates text (runner 'generate'), so it returns no embeddings: start the "
                             "engine with runner='pooling' (--runner pooling) to serve it as an embedding model.")
        if params is None:
            return PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"this model runs the pooling runner: it returns one embedding per prompt (LLM.embed, "
                             f"/v1/embeddings), not generated text; pass PoolingParams, not {type(params).__name__}.")
        self.check_pooling_task(params.task)
        self.check_step_params(params)
        if self.pooling_task in ("classify", "token_classify"):
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise ValueError(f"{name} applies to embedding models, and this one is a classifier (its "
                                     f"outputs are class probabilities): leave {name} unset (activation=False "
                                     f"gives the raw logits).")
            return params
        if params.activation is not None:
            raise ValueError("activation applies to classification models, and this one is an embedding model: "
                             "leave activation unset (normalize=False gives the embedding unnormalized).")
        dims, allowed = params.dimensions, self.matryoshka_dimensions
        if dims is not None:
            if allowed is None:
                raise ValueError(f"dimensions={dims}: this model does not support Matryoshka representation (its "
                                 f"embeddings have {self.hidden_size} values, and a cut one would be a poor "
                                 f"embedding); leave dimensions unset.")
            if dims > self.hidden_size or (allowed and dims not in allowed):
                sizes = list(allowed) if allowed else f"1 to {self.hidden_size}"
                raise ValueError(f"dimensions={dims} is not a size this model's embeddings come in: {sizes}.")
        return params

    def check_step_params(self, params: PoolingParams) -> None:
        """A request's `step_tag_id` / `returned_token_ids` (vLLM's): for a STEP-pooling model only, a token of the
        vocabulary and columns of the model's outputs (its labels)."""
        given = [k for k in ("step_tag_id", "returned_token_ids") if getattr(params, k) is not None]
        if not given:
            return
        if self.pooling_type != "STEP":
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{' and '.join(given)} {verb} to STEP pooling (a process reward model such as "
                             f"Qwen2ForProcessRewardModel, or a token classifier with pooler_config pooling_type "
                             f"'STEP'), and this model pools {self.pooling_type or 'nothing'}: leave them unset.")
        check_step_ids(params.step_tag_id, params.returned_token_ids, self.vocab_size, len(self.labels))

    def check_pooling_task(self, task: str | None) -> None:
        """ValueError, saying what to use instead, for a pooling task (PoolingParams.task) this model does not do:
        "classify" needs a classifier; "score" needs a classifier of one label (a cross-encoder) or an
        embedding model; "embed" and "token_embed" need an embedding model; "token_classify" a token classifier or
        a decoder's sequence classifier (its head applies to every token); a token classifier does
        "token_classify" (and "encode") only."""
        if self.runner != "pooling":
            raise ValueError(f"{task or 'pooling'} needs a pooling model, and this model generates text (runner "
                             f"'generate'): start the engine with runner='pooling' (--runner pooling).")
        n = len(self.labels)
        if self.pooling_task == "token_classify":
            if task not in (None, "encode", "token_classify"):
                raise ValueError(f"{task} is not a task of this model: it is a token classifier ({n} labels) and "
                                 f"returns class probabilities for every prompt token (task 'token_classify': "
                                 f"LLM.reward, LLM.encode(pooling_task='token_classify'), POST /pooling); load it "
                                 f"with convert='embed' (--convert embed) for embeddings of its hidden states.")
        elif self.pooling_task == "classify":
            if task in ("embed", "token_embed"):
                raise ValueError(f"this model is a classifier ({n} labels): it returns class probabilities "
                                 f"(LLM.classify, /classify), not embeddings; load it with convert='embed' "
                                 f"(--convert embed) for embeddings of its hidden states.")
            if task == "score" and n != 1:
                raise ValueError(f"scoring a text pair needs a cross-encoder (a classifier with one label, "
                                 f"num_labels=1) or an embedding model; this classifier has {n} labels: use "
                                 f"LLM.classify (/classify) for its class probabilities.")
            if task == "token_classify" and self.cls_classifier:
                raise ValueError("token_classify needs a head that applies to every token (a *ForTokenClassification "
                                 "model, or a decoder's *ForSequenceClassification), and this encoder's "
                                 "classification head reads the CLS token only: use LLM.classify (/classify).")
        elif task in ("classify", "token_classify"):
            raise ValueError(f"{task} needs a sequence-classification model (an architecture such as "
                             f"LlamaForSequenceClassification, with its `score` head) or a token classifier (such as "
                             f"BertForTokenClassification), and this model is an embedding model: use LLM.embed "
                             f"(/v1/embeddings) for its vectors, LLM.encode(pooling_task='token_embed') for every "
                             f"token's, or LLM.score (/v1/score) for cosine similarities.")

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        for cls in self.logits_processors:
            cls.validate_params(params)
        # A group's sequences run in lockstep, so all of them must fit in one step.
        width = params.best_of or params.n
        limit = min(self.max_num_seqs, self.max_num_batched_tokens or self.max_model_len)
        if width > limit:
            raise ValueError(
                f"best_of={width} sequences must run in one step, but this engine allows at most {limit} "
                f"(max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens})."
            )
        if params.use_beam_search and (
            params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
        ):
            raise ValueError("beam search scores raw log-probabilities: penalties must keep their defaults.")
        for name, asked in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if asked is not None and self.max_logprobs != -1 and asked > self.max_logprobs:
                raise ValueError(f"{name}={asked} is more than this engine returns per token: at most "
                                 f"{self.max_logprobs} (max_logprobs, vLLM's --max-logprobs; -1 lifts the cap).")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size}), got {sorted(bad)[:5]}.")

    def check_priority(self, priority: int) -> None:
        """A request's priority: an int, and other than 0 only under the priority scheduling policy (as vLLM)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer (lower is served first), got {priority!r}.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs priority scheduling, which this engine does not run: "
                             f"start it with scheduling_policy='priority' (--scheduling-policy priority), "
                             f"or leave priority at 0.")

    def check_prompt_ids(self, token_ids: list[int]) -> None:
        if len(token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token.")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        limit = self.max_seq_len
        if self.runner == "pooling" and len(token_ids) > limit:  # a pooling request generates nothing
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but this engine fits at most {limit} prompt tokens "
                f"(max_model_len={self.max_model_len}, KV pool={self.num_gpu_blocks} blocks); shorten it, or pass "
                f"truncate_prompt_tokens to keep its last tokens."
            )
        if self.runner != "pooling" and len(token_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but this engine fits at most {limit - 1} "
                f"prompt tokens (max_model_len={self.max_model_len}, "
                f"KV pool={self.num_gpu_blocks} blocks) plus one generated token."
            )

    def check_request(self, prompt, params: SamplingParams | PoolingParams | None, priority: int = 0) -> None:
        """What can be checked without tokenizing: the parameters and priority, and the ids of a token-id prompt
        (a text prompt's ids are checked once the engine has tokenized it)."""
        self.check_priority(priority)
        if self.runner == "pooling" or isinstance(params, PoolingParams):
            params = self.check_pooling_params(params)
        else:
            params = params or SamplingParams()
            self.check_params(params)
        prompt_cache_salt(prompt)
        if is_embeds_prompt(prompt):
            self.prompt_embeds(prompt, params.truncate_prompt_tokens)
            return
        ids = prompt_token_ids(prompt)
        if ids is not None:
            self.check_prompt_ids(self.truncate(ids, params.truncate_prompt_tokens))

    def prompt_embeds(self, prompt: dict, truncate_prompt_tokens: int | None = None):
        """An embeds prompt's tensor [num_tokens, hidden_size], checked (ValueError naming what is wrong) and
        truncated to its last `truncate_prompt_tokens` rows (-1: as many as fit)."""
        n = prompt.get(PROMPT_EMBEDS_KEY)
        n = int(n.shape[-2]) if getattr(n, "ndim", 0) >= 2 else 0
        keep = None
        if truncate_prompt_tokens is not None and self.enable_prompt_embeds:
            keep = len(self.truncate(range(n), truncate_prompt_tokens))
        return checked_prompt_embeds(prompt, self.enable_prompt_embeds, self.hidden_size, self.max_seq_len, keep)

    def truncate(self, token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (vLLM's field; -1: as many as fit with one generated
        token); ValueError when more could never fit."""
        k = truncate_prompt_tokens
        if k is None:
            return token_ids
        limit = self.max_seq_len - 1
        if k == -1:
            k = limit
        elif k > limit:
            raise ValueError(f"truncate_prompt_tokens={k} exceeds the longest prompt this engine takes ({limit} "
                             f"tokens: max_model_len={self.max_model_len}, KV pool={self.num_gpu_blocks} blocks, "
                             f"less one generated token); pass at most {limit}, or -1.")
        return token_ids[-k:] if len(token_ids) > k else token_ids


def prompt_token_ids(prompt) -> list[int] | None:
    """The token ids of a token-id prompt (a list, or a dict with ``prompt_token_ids``); None for text."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")


def prompt_cache_salt(prompt) -> str | None:
    """A dict prompt's ``cache_salt`` (vLLM's): its blocks are cached and found only under that salt, so tenants
    who do not share it cannot probe each other's prompts through prefix-cache timing. None when absent."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}.")
    return salt
