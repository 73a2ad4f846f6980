"""POST /v1/chat/completions: the model's chat template, then one engine request with n choices."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamResponse,
    TokenizeRequest,
    dump,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream, prompt_opens_thinking
from pagedllm.entrypoints.openai.serving_tools import ChatTools
from pagedllm.entrypoints.openai.tool_parsers import reads_harmony
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIError,
    ServingContext,
    error_from_exception,
    merge_streams,
    request_ids,
    sse,
)
from pagedllm.entrypoints.openai.stream_format import ChatChunker, ContinuousUsage
from pagedllm.multimodal.chat import needs_multimodal_render, render_multimodal_chat
from pagedllm.multimodal.inputs import MM_FEATURES_KEY
from pagedllm.multimodal.media import MediaLimits, load_image_url_async
from pagedllm.multimodal.processor import text_only_error
from pagedllm.outputs import RequestOutput
from pagedllm.reasoning import HARMONY
from pagedllm.tokenizer import apply_chat_template, check_chat_template_options


def render_messages(ctx: ServingContext, req: ChatCompletionRequest | TokenizeRequest,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of a request's conversation under the chat template (the request's template options applied);
    bad options are a 400 naming the option, bad messages one naming `messages`."""
    template = ctx.request_chat_template(req)
    messages = req.messages
    if not messages:
        raise OpenAIError("messages must contain at least one message.", param="messages")
    try:
        check_chat_template_options(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    except ValueError as e:
        raise OpenAIError(str(e), param="chat_template_kwargs" if "chat_template_kwargs" in str(e)
                          else "continue_final_message") from None
    plain = [m.model_dump(exclude_none=True) for m in messages]
    for m in plain:
        m.setdefault("content", "")
    kwargs = ctx.chat_template_kwargs(req.chat_template_kwargs)
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None and "reasoning_effort" not in (kwargs or {}):
        kwargs = {**(kwargs or {}), "reasoning_effort": effort}
    try:
        return apply_chat_template(ctx.tokenizer, plain, req.add_generation_prompt, template, tools,
                                   req.continue_final_message, kwargs, ctx.chat_template_content_format)
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from None
    except Exception as e:  # a template that fails to render on these messages (jinja raise_exception, ...)
        raise OpenAIError(f"the chat template could not render these messages: {e}", param="messages") from None


def output_splitter(ctx: ServingContext, tools: ChatTools) -> tuple[ReasoningParser | None, bool]:
    """The reasoning parser that splits a request's output before ChatTools reads its content, and whether that
    content carries harmony's tool calls (for a tool parser that reads them). ``--tool-call-parser openai`` alone
    still needs the harmony split (its reasoning is returned too, as vLLM does for GPT-OSS)."""
    parser = ctx.reasoning_parser
    harmony_calls = tools.mode == "auto" and reads_harmony(tools.parser_classes)
    if parser is None and harmony_calls and ctx.tool_call_parser is not None:
        parser = ReasoningParser(HARMONY)
    return parser, harmony_calls


def keep_special_tokens(ctx: ServingContext, req: ChatCompletionRequest) -> None:
    """A reasoning parser whose markers are special tokens (harmony's) reads text detokenized with them kept."""
    if ctx.reasoning_parser is not None and ctx.reasoning_parser.needs_special_tokens:
        req.skip_special_tokens = False


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def _image_prompt(self, req: ChatCompletionRequest) -> dict | None:
        """A conversation with image parts → a processed multimodal prompt (its images fetched or decoded, the
        model's processor run); None for a text-only conversation. Bad parts, URLs or images are a 400 naming
        `messages`, and so are images sent to a text-only model."""
        plain = [m.model_dump(exclude_none=True) for m in req.messages or []]
        processor = self.ctx.engine.mm_processor if has_parts(plain) else None
        if not needs_multimodal_render(plain, processor is not None):
            return None
        template = self.ctx.request_chat_template(req)  # (before any image is fetched)
        try:
            if processor is None:
                raise text_only_error()
            tools = self.ctx.chat_tools(req).template_tools()
            template = template or processor.chat_template
            text, refs = render_multimodal_chat(self.ctx.tokenizer, plain, processor.image_token, template,
                                                req.add_generation_prompt, tools, req.continue_final_message,
                                                self.ctx.chat_template_kwargs(req.chat_template_kwargs),
                                                self.ctx.chat_template_content_format)
            images = await asyncio.gather(*(load_image_url_async(r.url, self.ctx.media_limits or MediaLimits()) if r.image is None else _ready(r.image)
                                            for r in refs))
            return await asyncio.to_thread(processor.process, {"prompt": text, "multi_modal_data": {"image": images}},
                                           add_special_tokens=False)
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None

    def _validate(self, req: ChatCompletionRequest,
                  image_prompt: dict | None = None) -> tuple[str, list[int], int | None, int | None, ChatTools]:
        model = self.ctx.check_model(req.model)
        try:
            tools = self.ctx.chat_tools(req)
        except ValueError as e:
            raise OpenAIError(str(e), param="tool_choice") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(f"{max_param} must be at least 1, got {max_tokens}.", param=max_param)
        logprobs = None
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise OpenAIError("top_logprobs needs logprobs=true.", param="top_logprobs")
            limit = self.ctx.logprobs_limit
            if not 0 <= req.top_logprobs <= limit:
                raise OpenAIError(f"top_logprobs must be in [0, {limit}], got {req.top_logprobs}.",
                                  param="top_logprobs")
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        self.ctx.check_prompt_logprobs(req)
        self.ctx.check_n(req.n, req.best_of, req.stream, req.use_beam_search)
        self.ctx.check_logit_adjustments(req.logit_bias, req.allowed_token_ids)
        if image_prompt is None:
            ids = render_messages(self.ctx, req, tools.template_tools())
        else:
            ids = image_prompt["prompt_token_ids"]
        ids = self.ctx.truncate(ids, req.truncate_prompt_tokens)
        self.ctx.check_length(len(ids), max_tokens, "messages", max_param)
        self.ctx.check_fits_pool(len(ids), max_tokens, req, max_param)
        return model, ids, max_tokens, logprobs, tools

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     client_request_id: str | None = None) -> dict | AsyncIterator[str]:
        self.ctx.check_model(req.model)  # (before any image is fetched)
        image_prompt = await self._image_prompt(req)
        model, ids, max_tokens, logprobs, tools = self._validate(req, image_prompt)
        keep_special_tokens(self.ctx, req)
        params = self.ctx.sampling_params(req, max_tokens, logprobs, req.prompt_logprobs,
                                          structured_outputs=tools.constraint)
        request_id, engine_prefix = request_ids("chatcmpl", client_request_id)
        streams = await self.ctx.add_all([ids], params, engine_prefix, req.priority, req.cache_salt, model,
                                         mm_features=image_prompt[MM_FEATURES_KEY] if image_prompt else None)
        if req.stream:
            return self._stream(req, model, request_id, ids, streams, tools)
        final: RequestOutput | None = None
        try:
            async for _, out in merge_streams([s for _, s in streams]):
                final = out
        except Exception as e:
            raise error_from_exception(e) from None
        finally:
            self.ctx.abort_unfinished(streams)
        if final is None:
            raise OpenAIError("the request ended without output", status=500, type="server_error")
        choices, n_out = [], 0
        for comp in final.outputs:
            n_out += len(comp.token_ids)
            lp = None
            if logprobs is not None:
                lp = ChatChoiceLogprobs(content=self.ctx.chat_logprobs(comp.token_ids, comp.logprobs or [], logprobs,
                                                                          self.ctx.tokens_as_ids(req)))
            message, finish = self._message(comp, tools, ids, req.include_reasoning)
            message.role = self.ctx.chat_role(req)
            choices.append(ChatCompletionResponseChoice(
                index=comp.index, message=message, logprobs=lp, finish_reason=finish, stop_reason=comp.stop_reason,
                token_ids=list(comp.token_ids) if req.return_token_ids else None))
        usage = self.ctx.usage(len(ids), n_out, final.num_cached_tokens)
        prompt_logprobs = self.ctx.prompt_logprobs(final, req.prompt_logprobs, self.ctx.tokens_as_ids(req))
        return dump(ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                           prompt_logprobs=prompt_logprobs,
                                           prompt_token_ids=list(ids) if req.return_token_ids else None))

    def _message(self, comp, tools: ChatTools, prompt_ids: list[int],
                 include_reasoning: bool = True) -> tuple[ChatMessage, str | None]:
        """A choice's message: its reasoning apart (--reasoning-parser; dropped unless `include_reasoning`), then its
        content and tool calls."""
        parser, harmony_calls = output_splitter(self.ctx, tools)
        if parser is None:
            return tools.message(comp.text, comp.finish_reason)
        reasoning, content = parser.split(comp.text,
                                          prompt_opens_thinking(self.ctx.tokenizer, prompt_ids), harmony_calls)
        message, finish = tools.message(content or "", comp.finish_reason)
        message.reasoning = reasoning if include_reasoning else None
        if content is None and not message.tool_calls:
            message.content = None
        return message, finish

    async def _stream(self, req, model, request_id, ids, streams, tools: ChatTools) -> AsyncIterator[str]:
        created = int(time.time())
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        as_ids = self.ctx.tokens_as_ids(req)
        include_usage, continuous_usage = self.ctx.stream_usage(req.stream_options)
        role = self.ctx.chat_role(req)
        sent_text: dict[int, int] = {}
        sent_toks: dict[int, int] = {}
        done: set[int] = set()
        final: RequestOutput | None = None

        parser, harmony_calls = output_splitter(self.ctx, tools)
        opened = parser is not None and prompt_opens_thinking(self.ctx.tokenizer, ids)
        thinking: dict[int, ReasoningStream] = {}  # per choice, with --reasoning-parser
        chunker = ChatChunker(request_id, created, model)
        chunk, delta_chunk = chunker.chunk, chunker.delta_chunk
        usage_so_far = ContinuousUsage(continuous_usage, [len(ids)]).of

        try:
            prompt_ids = list(ids) if req.return_token_ids else None
            for i in range(req.n):
                yield chunk(i, role, "", usage=usage_so_far(0, 0), prompt_token_ids=prompt_ids)
            async for _, out in merge_streams([s for _, s in streams]):
                final = out
                for comp in out.outputs:
                    idx = comp.index
                    if idx in done:
                        continue
                    text, r_delta = comp.text, ""
                    if parser is not None:  # the reasoning goes apart; `text` is the content so far
                        stream = thinking.setdefault(idx, parser.stream(opened, harmony_calls))
                        r_delta, _ = stream.feed(comp.text, comp.finish_reason is not None)
                        text = stream.content
                    delta = text[sent_text.get(idx, 0):]
                    lo, n_tok = sent_toks.get(idx, 0), len(comp.token_ids)
                    lp = None
                    if top_k is not None and n_tok > lo:
                        lp = ChatChoiceLogprobs(content=self.ctx.chat_logprobs(
                            comp.token_ids[lo:], (comp.logprobs or [])[lo:], top_k, as_ids))
                    new_ids = list(comp.token_ids[lo:n_tok]) if req.return_token_ids else None
                    sent_text[idx], sent_toks[idx] = len(text), n_tok
                    finish = comp.finish_reason
                    usage = usage_so_far(0, n_tok)
                    if r_delta and req.include_reasoning:
                        yield chunk(idx, None, None, lp, usage=usage, token_ids=new_ids, reasoning=r_delta)
                        lp, new_ids = None, None
                    if tools.mode is not None:  # tool calls: deltas from the tool handler
                        for d in tools.deltas(idx, text, finish is not None):
                            yield delta_chunk(idx, d, lp, usage=usage, token_ids=new_ids)
                            lp, new_ids = None, None
                        if lp is not None or new_ids:
                            yield chunk(idx, None, None, lp, usage=usage, token_ids=new_ids)
                        finish = tools.stream_finish_reason(idx, finish)
                    elif delta or lp is not None or new_ids:
                        yield chunk(idx, None, delta, lp, usage=usage, token_ids=new_ids)
                    if comp.finish_reason is not None:
                        done.add(idx)
                        yield chunk(idx, None, None, None, finish, comp.stop_reason, usage=usage)
            if include_usage and final is not None:
                n_out = sum(len(c.token_ids) for c in final.outputs)
                usage = self.ctx.usage(len(ids), n_out, final.num_cached_tokens)
                yield sse(dump(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                            usage=usage)))
        except Exception as e:
            yield sse(self.ctx.mapped_error(e, f"chat completion stream {request_id}").body())
        finally:
            self.ctx.abort_unfinished(streams)
        yield sse("[DONE]")


async def _ready(value: Any) -> Any:
    return value


def has_parts(messages: list[dict]) -> bool:
    """Whether any message's content is a list of parts (only then may the model's processor be needed)."""
    return any(isinstance(m.get("content"), list) for m in messages)
