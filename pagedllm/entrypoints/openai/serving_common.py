"""What the completion and chat handlers share: errors, validation, sampling params, stream helpers."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pagedllm.engine.async_engine import AsyncEngineFront, AsyncStream, EngineDeadError
from pagedllm.engine.sleep_mode import EngineSleepingError
from pagedllm.engine.prompt_embeds import PROMPT_EMBEDS_KEY
from pagedllm.entrypoints.openai.headers import client_request_id
from pagedllm.entrypoints.openai.protocol import (
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    UsageInfo,
    dump,
)
from pagedllm.entrypoints.openai.request_logger import OutputLoggingStream, RequestLogger
from pagedllm.entrypoints.openai.structured import structured_outputs_from_request
from pagedllm.logprobs import Logprob
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

#: Most log-probs per token a request may ask for, unless the engine says otherwise (vLLM's max_logprobs default).
MAX_LOGPROBS = 20
#: Most completions per prompt (OpenAI's limit), further capped by max_num_seqs.
MAX_N = 128
#: --log-error-stack's tracebacks of stream errors go where the server logs its own errors.
_error_logger = logging.getLogger("pagedllm.server")

# Request fields an engine-side ValueError may name first in its message (the error's `param`).
_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__} | {"priority", "cache_salt"}


class OpenAIError(Exception):
    """An error answered with an OpenAI-shaped body; `status` 400 for user mistakes."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict[str, Any]:
        return dump(ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                  code=self.code)))


def error_from_exception(exc: BaseException) -> OpenAIError:
    """Map engine/validation exceptions to OpenAI errors (never a stack trace in the body)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return OpenAIError(f"the engine is not available: {exc}", code="engine_unavailable", status=503,
                           type="server_error")
    if isinstance(exc, EngineSleepingError):  # sleep mode: a 503 the client may retry after POST /wake_up
        return OpenAIError(str(exc), code="engine_sleeping", status=503, type="server_error")
    if isinstance(exc, (ValueError, TypeError, NotImplementedError)):
        message = str(exc) or type(exc).__name__
        m = re.match(r"([a-z_]+)\b", message)
        param = m.group(1) if m and m.group(1) in _SAMPLING_FIELDS else None
        if param is None and "prompt" in message:
            param = "prompt"
        if param is None and "beam search" in message:
            param = "use_beam_search"
        code = "not_implemented" if isinstance(exc, NotImplementedError) else "invalid_value"
        return OpenAIError(message, param=param, code=code)
    return OpenAIError(f"the engine failed on this request: {type(exc).__name__}: {exc}", code="engine_error",
                       status=500, type="server_error")


def log_error_traceback(log: logging.Logger, err: OpenAIError, where: str, exc: BaseException | None = None) -> None:
    """--log-error-stack: log a server-side error response (status >= 500) with the full traceback of what caused
    it: `exc`, the exception it was mapped from, else the one `err` was raised while handling (the handlers raise
    ``error_from_exception(e) from None``, which hides `e` from a plain traceback), else `err` itself."""
    if err.status < 500:
        return
    origin: BaseException = exc if exc is not None else err
    while isinstance(origin, OpenAIError) and origin.__context__ is not None:
        origin = origin.__context__
    log.error("%s failed with %d %s: %s", where, err.status, err.code or err.type, err.message,
              exc_info=(type(origin), origin, origin.__traceback__))


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, client_id: str | None) -> tuple[str, str]:
    """(the response's id, the prefix of its engine request ids). A client's X-Request-Id names the response as
    in vLLM (``cmpl-<X-Request-Id>``); the engine ids add a random part, so two requests sent with one id never
    collide in the engine."""
    if not client_id:
        rid = random_id(prefix)
        return rid, rid
    try:
        client_id = client_request_id(client_id)
    except ValueError as e:
        raise OpenAIError(str(e), param="X-Request-Id") from None
    rid = f"{prefix}-{client_id}"
    return rid, f"{rid}-{uuid.uuid4().hex[:12]}"


@dataclass
class ServingContext:
    """What every handler needs: the engine, a tokenizer for the loop thread, names and limits."""

    engine: AsyncEngineFront  # AsyncMPClient (engine-core process) or AsyncLLMEngine (a thread)
    tokenizer: Any
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    max_n: int
    chat_template: str | None = None
    limits: Any = None  # RequestLimits (limits.py imports this module); None: the defaults
    #: The KV pool, for the admission check that a request can ever fit (None: not checked).
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    #: --return-tokens-as-token-ids: logprob tokens as "token_id:N" unless a request says otherwise.
    return_tokens_as_token_ids: bool = False
    #: --reasoning-parser: splits a thinking model's output into reasoning and content (None: off).
    reasoning_parser: Any = None
    #: --tool-call-parser: the one format tool_choice "auto" parses (None: every format in tool_parsers is tried).
    tool_call_parser: str | None = None
    #: The server's tool parsers by name: the built-in ones and --tool-parser-plugin's (None: the built-in ones).
    tool_parsers: dict | None = None
    #: --exclude-tools-when-tool-choice-none: a request with tool_choice "none" renders its prompt without its tools.
    exclude_tools_when_tool_choice_none: bool = False
    #: Most log-probs per token (the engine's max_logprobs; -1: up to the vocabulary).
    max_logprobs: int = MAX_LOGPROBS
    #: The model's generation-config defaults for fields a request leaves unset (engine/generation_defaults.py).
    default_sampling: dict = field(default_factory=dict)
    #: --lora-modules: model name → LoRARequest (a request naming it runs with that adapter).
    lora_modules: dict = field(default_factory=dict)
    #: --response-role: the role of the reply when the request adds the generation prompt (vLLM's).
    response_role: str = "assistant"
    #: --enable-prompt-tokens-details: usage gets prompt_tokens_details.cached_tokens (prefix cache hits).
    enable_prompt_tokens_details: bool = False
    #: --enable-force-include-usage: every stream ends with a usage chunk, as if stream_options.include_usage.
    enable_force_include_usage: bool = False
    #: --enable-log-requests: logs each request handed to the engine (None: off).
    request_logger: RequestLogger | None = None
    #: Limits on images named by URL (--allowed-media-domains); None: MediaLimits' defaults.
    media_limits: Any = None
    #: --default-chat-template-kwargs: template variables every chat request gets unless it sets them (vLLM's).
    default_chat_template_kwargs: dict | None = None
    #: --chat-template-content-format: how message content reaches the template ("auto", "string", "openai").
    chat_template_content_format: str = "auto"
    #: --trust-request-chat-template: a request may bring its own chat_template (vLLM's; off: a 400).
    trust_request_chat_template: bool = False
    #: --log-error-stack: a server-side error response (5xx, a stream's error event too) logs its traceback.
    log_error_stack: bool = False

    def __post_init__(self) -> None:
        if self.limits is None:
            from pagedllm.entrypoints.openai.limits import RequestLimits

            self.limits = RequestLimits()

    def mapped_error(self, exc: BaseException, where: str) -> OpenAIError:
        """error_from_exception(exc) for an error no exception handler sees (a stream's error event, a batch line),
        a server-side one's traceback logged under --log-error-stack."""
        err = error_from_exception(exc)
        if self.log_error_stack:
            log_error_traceback(_error_logger, err, where, exc)
        return err

    def chat_tools(self, req: Any) -> Any:
        """A chat request's tool handling (serving_tools.ChatTools) under this server's tool flags; ValueError for a
        bad tool_choice."""
        from pagedllm.entrypoints.openai.serving_tools import ChatTools

        return ChatTools(req, self.tool_call_parser, self.tool_parsers, self.exclude_tools_when_tool_choice_none)

    def chat_template_kwargs(self, requested: dict | None) -> dict | None:
        """A request's chat_template_kwargs over the server's defaults (the request's values win)."""
        if not self.default_chat_template_kwargs:
            return requested
        return {**self.default_chat_template_kwargs, **(requested or {})}

    def request_chat_template(self, req: Any) -> str | None:
        """The template a request renders with: its own chat_template (only with --trust-request-chat-template,
        else a 400), or the server's (--chat-template; None: the model's)."""
        own = getattr(req, "chat_template", None)
        if own is None:
            return self.chat_template
        if not self.trust_request_chat_template:
            raise OpenAIError("this server does not accept a chat_template in the request (a template runs code on "
                              "the server): start it with --trust-request-chat-template to allow one, or set the "
                              "template for every request with --chat-template.", param="chat_template")
        return own or self.chat_template

    @property
    def logprobs_limit(self) -> int:
        return self.max_logprobs if self.max_logprobs >= 0 else len(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    # -- response shape ------------------------------------------------------------------------------
    def usage(self, prompt_tokens: int, completion_tokens: int = 0, cached_tokens: int = 0) -> UsageInfo:
        """A response's usage; with --enable-prompt-tokens-details, the prompt tokens the prefix cache served."""
        details = PromptTokenUsageInfo(cached_tokens=cached_tokens) if self.enable_prompt_tokens_details else None
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    def stream_usage(self, stream_options: Any) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk) for a stream, as vLLM decides them:
        stream_options.include_usage or --enable-force-include-usage; continuous_usage_stats only with the
        former."""
        include = bool(stream_options and stream_options.include_usage) or self.enable_force_include_usage
        return include, include and bool(stream_options and stream_options.continuous_usage_stats)

    def chat_role(self, req: Any) -> str:
        """The reply's role (vLLM's): --response-role when the request adds the generation prompt, else the
        role of the message it continues."""
        if req.add_generation_prompt:
            return self.response_role
        return req.messages[-1].role

    # -- validation --------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names or model in self.lora_modules:
            return self.model_name if model is None else model
        served = [*self.served_model_names, *self.lora_modules]
        # 404, as vLLM and OpenAI answer an unknown model (the openai client raises NotFoundError)
        raise OpenAIError(f"The model `{model}` does not exist; this server serves {served}.",
                          param="model", code="model_not_found", status=404)

    def check_ids(self, token_ids: list[int], param: str) -> None:
        vocab = len(self.tokenizer)
        bad = [t for t in token_ids if t < 0 or t >= vocab]
        if bad:
            raise OpenAIError(f"token ids must be in [0, {vocab}), got {bad[:5]}", param=param)

    @property
    def runner(self) -> str:
        """The engine's runner: "generate", or "pooling" (an embedding model)."""
        return self.engine.request_checker.runner

    def check_runner(self, needed: str, route: str, what: str = "an embedding model") -> None:
        """400 for a route the model does not serve: generation routes on a pooling model, pooling routes (`what`
        they need) on a generating one."""
        if self.runner == needed:
            return
        if needed == "pooling":
            raise OpenAIError(f"{route} needs {what}, and this server's model generates text: start the server "
                              f"with --runner pooling to serve it as one.", code="model_not_supported")
        checker = self.engine.request_checker
        if checker.pooling_task == "token_classify":
            what, routes = "a token classification model", "/pooling"
        elif checker.pooling_task == "classify":
            what = "a classification model"
            routes = "/classify, /v1/score, /rerank and /pooling" if len(checker.labels) == 1 else \
                "/classify and /pooling"
        else:
            what, routes = "an embedding model", "/v1/embeddings, /v1/score, /rerank and /pooling"
        raise OpenAIError(f"{route} generates text, and this server runs {what} (--runner pooling): it serves "
                          f"{routes}.", code="model_not_supported")

    def check_pooling_task(self, task: str, route: str) -> None:
        """400 naming the model for a pooling task (PoolingParams.task) this server's model does not do: classify
        on an embedding model, score on a classifier of several labels, any of them on a generating model."""
        try:
            self.engine.request_checker.check_pooling_task(task)
        except ValueError as e:
            raise OpenAIError(f"{route}: {e}", param="model", code="model_not_supported") from None

    def completion_prompts(self, prompt: Any, add_special_tokens: bool = True,
                           param: str = "prompt") -> tuple[list[str | None], list[list[int]]]:
        """(texts, token ids) of a completion request's prompt(s) (or an embedding request's `input`), within the
        request limits."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif len(prompt) == 0:
            raise OpenAIError(f"{param} must not be empty: give a string, a list of strings, or token ids.",
                              param=param)
        elif all(isinstance(x, int) for x in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        self.limits.check_prompt_count(len(items))
        texts: list[str | None] = []
        ids: list[list[int]] = []
        total = 0
        for item in items:
            if isinstance(item, str):
                texts.append(item)
                ids.append(list(self.tokenizer.encode(item, add_special_tokens=add_special_tokens)))
            else:
                self.check_ids(item, param)
                texts.append(None)
                ids.append(list(item))
            total += len(ids[-1])
            self.limits.check_total_tokens(total)
        return texts, ids

    def truncate(self, token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (a 400 naming the field if k never fits)."""
        try:
            return self.engine.request_checker.truncate(token_ids, truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens") from None

    def check_logit_adjustments(self, logit_bias: dict[str, float] | None, allowed_token_ids: list[int] | None) -> None:
        """logit_bias keys (decimal token ids, checked by the protocol) and allowed_token_ids: inside the
        vocabulary."""
        if logit_bias:
            self.check_ids([int(k) for k in logit_bias], "logit_bias")
        if allowed_token_ids is not None:
            if not allowed_token_ids:
                raise OpenAIError("allowed_token_ids must list at least one token id.", param="allowed_token_ids")
            self.check_ids(allowed_token_ids, "allowed_token_ids")

    def check_fits_pool(self, n_prompt: int, max_tokens: int | None, req: Any, max_tokens_param: str) -> None:
        """400 for a request that could never finish in the KV pool, even alone (instead of a livelock)."""
        if self.block_size is None or self.num_gpu_blocks is None:
            return
        from pagedllm.entrypoints.openai.limits import check_fits_pool

        max_len = self.max_model_len if max_tokens is None else min(self.max_model_len, n_prompt + max_tokens)
        num_seqs = req.best_of if req.best_of is not None else req.n
        if req.use_beam_search:
            num_seqs = 2 * num_seqs
        check_fits_pool(n_prompt, max_len, num_seqs, self.block_size, self.num_gpu_blocks, max_tokens_param)

    def check_length(self, n_prompt: int, max_tokens: int | None, prompt_param: str, max_tokens_param: str) -> None:
        limit = self.max_model_len
        if n_prompt == 0:
            raise OpenAIError("the prompt is empty: give at least one token.", param=prompt_param)
        if self.runner == "pooling" and n_prompt > limit:  # a pooling request generates nothing: limit tokens fit
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has {n_prompt} "
                f"tokens. Please shorten the prompt (or pass truncate_prompt_tokens).",
                param=prompt_param, code="context_length_exceeded")
        if self.runner != "pooling" and n_prompt >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has {n_prompt} "
                f"tokens, which leaves no room for a completion. Please shorten the prompt.",
                param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                f"Please reduce the prompt or {max_tokens_param}.",
                param=max_tokens_param, code="context_length_exceeded")

    def check_prompt_logprobs(self, req: Any) -> None:
        """vLLM's `prompt_logprobs`: within the server's logprobs limit, and not with streaming (the prompt's
        log-probs are known only once its last chunk ran; vLLM refuses them with stream=True too)."""
        k = req.prompt_logprobs
        if k is None:
            return
        limit = self.logprobs_limit
        if not 0 <= k <= limit:
            raise OpenAIError(f"prompt_logprobs must be in [0, {limit}], got {k}.", param="prompt_logprobs")
        if req.stream:
            raise OpenAIError("prompt_logprobs is not available when stream is true.", param="prompt_logprobs")

    def check_n(self, n: int, best_of: int | None, stream: bool, use_beam_search: bool = False) -> None:
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > self.max_n:
                raise OpenAIError(f"{name} must be at most {self.max_n}, got {value}.", param=name)
        if stream and use_beam_search:
            raise OpenAIError("streaming is not supported with beam search (beams are re-ranked until the end).",
                              param="stream")
        if stream and best_of is not None and best_of != n:
            raise OpenAIError(f"best_of ({best_of}) must equal n ({n}) when streaming.", param="best_of")

    def sampling_params(self, req: Any, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams from a request; its ValueErrors become 400s naming the field.
        `structured_outputs` (from tool_choice) replaces the request's own constraint fields."""
        try:
            so, field = structured_outputs_from_request(req)
        except ValueError as e:
            raise OpenAIError(str(e), param=str(e).split(":")[0].split(" ")[0]) from None
        if structured_outputs is not None:
            if so is not None:
                raise OpenAIError(f"{field} cannot be combined with tool_choice 'required' or a named function.",
                                  param=field)
            so = structured_outputs
        defaults = self.default_sampling
        if "max_tokens" in defaults:  # the generation config's max_new_tokens caps every request (vLLM)
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])

        def unset(value: Any, name: str, fallback: Any) -> Any:
            return defaults.get(name, fallback) if value is None else value

        try:
            return SamplingParams(
                n=req.n, best_of=req.best_of, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=unset(req.repetition_penalty, "repetition_penalty", 1.0),
                # Beam search ranks beams by log-probs and samples nothing: absent, its temperature is 0 (this
                # engine's beam search needs that), not the sampling default.
                temperature=(0.0 if req.use_beam_search and req.temperature is None
                             else unset(req.temperature, "temperature", 1.0)),
                top_p=unset(req.top_p, "top_p", 1.0),
                top_k=unset(req.top_k, "top_k", 0),
                min_p=unset(req.min_p, "min_p", 0.0),
                seed=req.seed, use_beam_search=req.use_beam_search, length_penalty=req.length_penalty,
                early_stopping=req.early_stopping, stop=req.stop, stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
                max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                structured_outputs=so,
                logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
                allowed_token_ids=req.allowed_token_ids, truncate_prompt_tokens=req.truncate_prompt_tokens,
                bad_words=req.bad_words, extra_args=req.vllm_xargs,
            )
        except ValueError as e:
            raise error_from_exception(e) from None

    # -- engine --------------------------------------------------------------------------------------
    async def add_all(self, prompts: list[list[int] | Any], params: SamplingParams, prefix: str,
                      priority: int = 0, cache_salt: str | None = None,
                      model: str | None = None, mm_features: list | None = None,
                      prompt_extras: list[dict] | None = None) -> list[tuple[str, AsyncStream]]:
        """Add one request per prompt, token ids or a prompt-embeddings tensor (`model`: a --lora-modules name runs
        them with its adapter; `mm_features`: the prompts' images, processed; `prompt_extras`: more prompt fields
        per prompt, e.g. a BERT pair's token_type_ids); on any failure abort those already added and raise an
        OpenAIError."""
        lora = self.lora_modules.get(model)
        added: list[tuple[str, AsyncStream]] = []
        try:
            for i, ids in enumerate(prompts):
                rid = f"{prefix}-{i}"
                if self.request_logger is not None:
                    self._log_request(rid, ids, params, lora)
                prompt = {"prompt_token_ids" if isinstance(ids, list) else PROMPT_EMBEDS_KEY: ids}
                if cache_salt is not None:
                    prompt["cache_salt"] = cache_salt
                if mm_features:
                    prompt["mm_features"] = mm_features
                if prompt_extras:
                    prompt.update(prompt_extras[i])
                stream = await self.engine.add_request(rid, prompt, params, coalesce=True, priority=priority,
                                                       lora_request=lora)
                if self.request_logger is not None and self.request_logger.log_outputs:
                    stream = OutputLoggingStream(stream, rid, self.request_logger)
                added.append((rid, stream))
        except BaseException as e:
            self.engine.abort([rid for rid, _ in added])
            if isinstance(e, Exception):
                raise error_from_exception(e) from None
            raise
        return added

    def _log_request(self, request_id: str, ids: list[int] | Any, params: Any, lora: Any) -> None:
        if not isinstance(ids, list):  # prompt embeddings: no text, no ids
            self.request_logger.log_inputs(request_id, f"<prompt_embeds {tuple(ids.shape)}>", None, params, lora)
            return
        limit = self.request_logger.max_log_len
        # The logger cuts the text to `limit` characters; `limit` tokens decode to about that many or more.
        text = self.tokenizer.decode(ids if limit is None else ids[:limit])
        self.request_logger.log_inputs(request_id, text, ids, params, lora)

    def abort_unfinished(self, streams: list[tuple[str, AsyncStream]]) -> None:
        ids = [rid for rid, s in streams if not s.finished]
        if ids:
            self.engine.abort(ids)

    # -- logprobs --------------------------------------------------------------------------------------
    def tokens_as_ids(self, req: Any) -> bool:
        """vLLM's ``return_tokens_as_token_ids``: the request's choice, else the server's
        (--return-tokens-as-token-ids)."""
        own = getattr(req, "return_tokens_as_token_ids", None)
        return self.return_tokens_as_token_ids if own is None else own

    def token_str(self, token_id: int, as_id: bool = False) -> str:
        """A logprob entry's token: its text, or ``token_id:N`` (vLLM's form for tokens that are not whole
        characters, e.g. one byte of a multi-byte character)."""
        return f"token_id:{token_id}" if as_id else self.tokenizer.decode([token_id])

    def completion_logprobs(self, token_ids: list[int], dicts: list[dict[int, Logprob] | None],
                            offset: int, as_ids: bool, top_k: int) -> CompletionLogProbs:
        """OpenAI's completion logprobs; each position's `top_logprobs` holds the token and the `top_k` most
        likely (an echoed prompt's dicts may hold more: the request's `prompt_logprobs` can be larger)."""
        out = CompletionLogProbs()
        for tid, d in zip(token_ids, dicts):
            s = self.token_str(tid, as_ids)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if d is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_finite(d.get(tid)))
                if len(d) > top_k + 1:
                    top = dict(_most_likely(d, top_k))
                    d = {tid: d[tid], **top} if tid in d else top
                out.top_logprobs.append({self.token_str(t, as_ids): _finite(e) for t, e in d.items()})
        return out

    def prompt_logprobs(self, out: RequestOutput, k: int | None, as_ids: bool = False) -> PromptLogprobs | None:
        """vLLM's response shape of a request's prompt log-probs (None unless it asked, `k` per position): per
        position, the prompt token and the `k` most likely tokens, each with its log-prob, its rank (1: the
        most likely) and its text."""
        if k is None or out.prompt_logprobs is None:
            return None
        result: PromptLogprobs = []
        for tid, d in zip(out.prompt_token_ids, out.prompt_logprobs):
            if d is None:
                result.append(None)
                continue
            # The engine's dict holds the prompt token and the top tokens of a possibly larger k (an echo's
            # logprobs): keep the prompt token and the `k` most likely.
            entries = [(tid, d[tid]), *_most_likely(d, k)] if tid in d else _most_likely(d, k)
            result.append({str(t): PromptLogprob(logprob=_finite(e), rank=e.rank,
                                                 decoded_token=self.token_str(t, as_ids)) for t, e in entries})
        return result

    def chat_logprobs(self, token_ids: list[int], dicts: list[dict[int, Logprob]], top_k: int,
                      as_ids: bool = False) -> list[ChatTokenLogprob]:
        out = []
        for tid, d in zip(token_ids, dicts):
            s = self.token_str(tid, as_ids)
            out.append(ChatTokenLogprob(
                token=s, logprob=_finite(d.get(tid)), bytes=list(s.encode("utf-8")),
                top_logprobs=[ChatTopLogprob(token=(ts := self.token_str(t, as_ids)), logprob=_finite(e),
                                             bytes=list(ts.encode("utf-8"))) for t, e in _most_likely(d, top_k)],
            ))
        return out


def _most_likely(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The `k` most likely of a position's entries, most likely first."""
    return sorted(entries.items(), key=lambda kv: -kv[1].logprob)[:k]


def _finite(entry: Logprob | None) -> float:
    if entry is None:
        return -9999.0
    return max(float(entry.logprob), -9999.0)


async def final_outputs(ctx: ServingContext, streams: list[tuple[str, AsyncStream]]) -> list[Any]:
    """Each stream's last output, in order (None where a stream gave none); errors become OpenAI errors, and
    requests still running when this stops (an error, a cancelled handler) are aborted."""
    finals: list[Any] = [None] * len(streams)
    try:
        async for i, out in merge_streams([s for _, s in streams]):
            finals[i] = out
    except Exception as e:
        raise error_from_exception(e) from None
    finally:
        ctx.abort_unfinished(streams)
    return finals


async def merge_streams(streams: list[AsyncStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as outputs arrive; yields (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
