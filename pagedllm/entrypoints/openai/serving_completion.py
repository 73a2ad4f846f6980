"""POST /v1/completions: one engine request per prompt, n choices each, streamed or whole."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from pagedllm.engine.prompt_embeds import load_prompt_embeds
from pagedllm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    dump,
)
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIError,
    ServingContext,
    final_outputs,
    merge_streams,
    request_ids,
    sse,
)
from pagedllm.entrypoints.openai.stream_format import CompletionChunker, ContinuousUsage
from pagedllm.outputs import RequestOutput


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _validate(self, req: CompletionRequest) -> tuple[str, list[str | None], list[list[int]]]:
        model = self.ctx.check_model(req.model)
        if req.suffix:
            raise OpenAIError("suffix is not supported.", param="suffix")
        limit = self.ctx.logprobs_limit
        if req.logprobs is not None and not 0 <= req.logprobs <= limit:
            raise OpenAIError(f"logprobs must be in [0, {limit}], got {req.logprobs}.", param="logprobs")
        self.ctx.check_prompt_logprobs(req)
        self.ctx.check_n(req.n, req.best_of, req.stream, req.use_beam_search)
        self.ctx.check_logit_adjustments(req.logit_bias, req.allowed_token_ids)
        if req.prompt is None and not req.prompt_embeds:
            raise OpenAIError("Field required: give `prompt` (text or token ids), or `prompt_embeds` (with "
                              "--enable-prompt-embeds).", param="prompt", code="missing")
        only_embeds = bool(req.prompt_embeds) and req.prompt in (None, "")  # vLLM's: an empty prompt adds nothing
        texts, ids = ([], []) if only_embeds else self.ctx.completion_prompts(req.prompt)
        kept = [self.ctx.truncate(prompt_ids, req.truncate_prompt_tokens) for prompt_ids in ids]
        # echo returns what the model saw: a truncated prompt's text is decoded from the ids it kept.
        texts = [t if len(k) == len(full) else None for t, k, full in zip(texts, kept, ids)]
        ids = kept
        for prompt_ids in ids:
            self.ctx.check_length(len(prompt_ids), req.max_tokens, "prompt", "max_tokens")
            self.ctx.check_fits_pool(len(prompt_ids), 1 if _echo_only(req) else req.max_tokens, req, "max_tokens")
        return model, texts, ids

    def _prompt_embeds(self, req: CompletionRequest, n_text_prompts: int) -> list:
        """The request's prompt_embeds, loaded and checked (a 400 naming what is wrong): the server's flag first,
        so that a server without it never deserializes a payload."""
        checker = self.ctx.engine.request_checker
        if not checker.enable_prompt_embeds:
            raise OpenAIError("prompt_embeds inputs are off on this server: start it with --enable-prompt-embeds.",
                              param="prompt_embeds")
        if req.echo:
            raise OpenAIError("echo is not supported with prompt_embeds: an embeddings prompt has no text or token "
                              "ids to echo.", param="echo")
        items = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else list(req.prompt_embeds)
        self.ctx.limits.check_prompt_count(len(items) + n_text_prompts)
        out = []
        for item in items:
            try:
                embeds = checker.prompt_embeds({"prompt_embeds": load_prompt_embeds(item)},
                                               req.truncate_prompt_tokens)
            except ValueError as e:
                raise OpenAIError(str(e), param="prompt_embeds") from None
            self.ctx.check_length(len(embeds), req.max_tokens, "prompt_embeds", "max_tokens")
            self.ctx.check_fits_pool(len(embeds), req.max_tokens, req, "max_tokens")
            out.append(embeds)
        return out

    async def create_completion(self, req: CompletionRequest,
                                client_request_id: str | None = None) -> dict | AsyncIterator[str]:
        """A response dict, or (stream=True) an async iterator of SSE lines. Raises OpenAIError."""
        model, texts, ids = self._validate(req)
        # Embeddings prompts come first (vLLM's order); their placeholder ids stand for them in the response.
        embeds = []
        if req.prompt_embeds:  # base64 and torch.load off the event loop
            embeds = await asyncio.to_thread(self._prompt_embeds, req, len(ids))
        engine_prompts = [*embeds, *ids]
        texts = [None] * len(embeds) + texts
        ids = [[0] * len(e) for e in embeds] + ids
        asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        prompt_logprobs = max(asked) if asked else None  # an echo's logprobs are the prompt's too
        # OpenAI's (and vLLM's) echo with max_tokens 0 scores the prompt: one token runs, none is returned.
        max_tokens = 1 if _echo_only(req) else req.max_tokens
        params = self.ctx.sampling_params(req, max_tokens, req.logprobs, prompt_logprobs)
        request_id, engine_prefix = request_ids("cmpl", client_request_id)
        streams = await self.ctx.add_all(engine_prompts, params, engine_prefix, req.priority, req.cache_salt, model)
        if req.stream:
            return self._stream(req, model, request_id, texts, ids, streams)
        finals = await final_outputs(self.ctx, streams)
        return dump(self._response(req, model, request_id, texts, finals))

    def _response(self, req, model, request_id, texts, finals) -> CompletionResponse:
        choices, n_prompt, n_out = [], 0, 0
        as_ids = self.ctx.tokens_as_ids(req)
        for i, out in enumerate(finals):
            if out is None:
                raise OpenAIError("the request ended without output", status=500, type="server_error")
            n_prompt += len(out.prompt_token_ids)
            prompt_logprobs = self.ctx.prompt_logprobs(out, req.prompt_logprobs, as_ids)
            prompt_text = texts[i] if texts[i] is not None else self.ctx.tokenizer.decode(out.prompt_token_ids)
            for comp in out.outputs:
                gen_ids, gen_text = ([], "") if _echo_only(req) else (list(comp.token_ids), comp.text)
                n_out += len(gen_ids)
                text = (prompt_text + gen_text) if req.echo else gen_text
                logprobs = None
                if req.logprobs is not None:
                    tok_ids, dicts = gen_ids, list(comp.logprobs or [])[:len(gen_ids)]
                    if req.echo:
                        tok_ids = list(out.prompt_token_ids) + tok_ids
                        dicts = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + dicts
                    logprobs = self.ctx.completion_logprobs(tok_ids, dicts, 0, as_ids, req.logprobs)
                choices.append(CompletionResponseChoice(
                    index=i * req.n + comp.index, text=text, logprobs=logprobs,
                    finish_reason=comp.finish_reason, stop_reason=comp.stop_reason, prompt_logprobs=prompt_logprobs,
                    prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
                    token_ids=gen_ids if req.return_token_ids else None))
        usage = self.ctx.usage(n_prompt, n_out, _cached_tokens(finals))
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(self, req, model, request_id, texts, ids, streams) -> AsyncIterator[str]:
        created = int(time.time())
        sent_text: dict[int, int] = {}
        sent_toks: dict[int, int] = {}
        offsets: dict[int, int] = {}
        done: set[int] = set()
        announced: set[int] = set()  # choices whose prompt token ids went out (return_token_ids)
        finals: list[RequestOutput | None] = [None] * len(streams)
        include_usage, continuous_usage = self.ctx.stream_usage(req.stream_options)

        chunk = CompletionChunker(request_id, created, model).chunk
        usage_so_far = ContinuousUsage(continuous_usage, [len(x) for x in ids]).of
        as_ids = self.ctx.tokens_as_ids(req)

        try:
            async for i, out in merge_streams([s for _, s in streams]):
                finals[i] = out
                for comp in out.outputs:
                    idx = i * req.n + comp.index
                    if idx in done:
                        continue
                    first = idx not in sent_text
                    prefix = ""
                    if first and req.echo:
                        prefix = texts[i] if texts[i] is not None else self.ctx.tokenizer.decode(ids[i])
                    gen_ids, gen_text = ([], "") if _echo_only(req) else (comp.token_ids, comp.text)
                    delta = prefix + gen_text[sent_text.get(idx, 0):]
                    n_tok = len(gen_ids)
                    lo = sent_toks.get(idx, 0)
                    tok_ids, dicts = list(gen_ids[lo:]), list((comp.logprobs or [])[lo:n_tok])
                    if first and req.echo:  # the echoed prompt's tokens lead the first chunk's logprobs
                        tok_ids = list(out.prompt_token_ids) + tok_ids
                        dicts = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + dicts
                    logprobs = None
                    if req.logprobs is not None and tok_ids:
                        logprobs = self.ctx.completion_logprobs(tok_ids, dicts, offsets.get(idx, 0), as_ids,
                                                                req.logprobs)
                        offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in logprobs.tokens)
                    sent_text[idx] = len(gen_text)
                    sent_toks[idx] = n_tok
                    if comp.finish_reason is not None:
                        done.add(idx)
                    new_ids = list(gen_ids[lo:n_tok]) if req.return_token_ids else None
                    if delta or logprobs is not None or comp.finish_reason is not None or new_ids:
                        prompt_ids = None
                        if req.return_token_ids and idx not in announced:
                            announced.add(idx)
                            prompt_ids = list(ids[i])
                        yield chunk(idx, delta, logprobs, comp.finish_reason, comp.stop_reason,
                                    usage_so_far(i, n_tok), new_ids, prompt_ids)
            if include_usage:
                n_prompt = sum(len(x) for x in ids)
                n_out = 0 if _echo_only(req) else sum(len(c.token_ids) for f in finals if f is not None
                                                       for c in f.outputs)
                usage = self.ctx.usage(n_prompt, n_out, _cached_tokens(finals))
                yield sse(dump(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                        usage=usage)))
        except Exception as e:
            yield sse(self.ctx.mapped_error(e, f"completion stream {request_id}").body())
        finally:
            self.ctx.abort_unfinished(streams)
        yield sse("[DONE]")


def _cached_tokens(finals: list[RequestOutput | None]) -> int:
    """Prompt tokens the prefix cache served, over the request's prompts."""
    return sum(f.num_cached_tokens for f in finals if f is not None)


def _echo_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the response is the prompt (and its logprobs), no completion."""
    return req.echo and req.max_tokens == 0
