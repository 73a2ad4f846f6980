"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it): one conversation turn through the chat
template; GET /v1/responses/{id} reads a stored response back.

A request becomes the chat request it amounts to (input items → messages, `text.format` → `response_format`,
flat function tools → chat tools), so it shares the chat endpoint's template, tool parsing and constraints.
Responses are stored only when the server runs with ``--enable-responses-api-store`` (vLLM's
``VLLM_ENABLE_RESPONSES_API_STORE``): in memory, the most recent ones, so `previous_response_id` can continue a
conversation."""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, SamplingExtras
from pagedllm.entrypoints.openai.protocol_responses import INCLUDE_LOGPROBS, ResponsesRequest
from pagedllm.entrypoints.openai.reasoning import prompt_opens_thinking
from pagedllm.entrypoints.openai.responses_input import input_messages
from pagedllm.entrypoints.openai.serving_chat import (
    keep_special_tokens,
    output_splitter,
    render_messages,
)
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIError,
    ServingContext,
    error_from_exception,
    merge_streams,
    request_ids,
)
from pagedllm.entrypoints.openai.serving_tools import ChatTools
from pagedllm.outputs import CompletionOutput, RequestOutput

#: Chat-side parameter names → the Responses API's, for errors raised by the shared checks.
_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
#: vLLM's extra fields that mean nothing for a response (it has no prompt log-probs or token ids to return).
_REFUSED_EXTRAS = ("prompt_logprobs", "return_token_ids")


@dataclass
class StoredResponse:
    body: dict[str, Any]
    #: The conversation it continues plus its own output, as chat messages (its instructions excluded:
    #: OpenAI does not carry them over to the next turn).
    messages: list[dict[str, Any]]


class ResponseStore:
    """The most recent `capacity` stored responses, by id (older ones are dropped first)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)


class OpenAIServingResponses:
    def __init__(self, ctx: ServingContext, store: ResponseStore | None = None) -> None:
        self.ctx = ctx
        self.store = store  # None: --enable-responses-api-store is off

    # -- retrieval ---------------------------------------------------------------------------------
    def retrieve(self, response_id: str) -> dict[str, Any]:
        item = self.store.get(response_id) if self.store is not None else None
        if item is None:
            hint = "" if self.store is not None else " (this server stores no responses: start it with " \
                                                     "--enable-responses-api-store)"
            raise OpenAIError(f"Response with id '{response_id}' not found{hint}.", param="response_id",
                              code="not_found", status=404)
        return item.body

    # -- creation ----------------------------------------------------------------------------------
    async def create_response(self, req: ResponsesRequest,
                              client_request_id: str | None = None) -> dict | AsyncIterator[str]:
        history, chat, ids, max_tokens, logprobs, tools = self._validate(req)
        try:
            params = self.ctx.sampling_params(chat, max_tokens, logprobs, None, structured_outputs=tools.constraint)
        except OpenAIError as e:
            raise _renamed(e, req) from None
        rid, engine_prefix = request_ids("resp", client_request_id)
        response_id = "resp_" + rid[len("resp-"):]
        try:
            streams = await self.ctx.add_all([ids], params, engine_prefix, req.priority, req.cache_salt, chat.model)
        except OpenAIError as e:
            raise _renamed(e, req) from None
        shape = _Shape(self.ctx, req, response_id, chat.model or self.ctx.model_name, ids, logprobs, tools,
                       stored=req.store and self.store is not None)
        if req.stream:
            return self._stream(req, shape, history, streams)
        final: RequestOutput | None = None
        try:
            async for _, out in merge_streams([s for _, s in streams]):
                final = out
        except Exception as e:
            raise _renamed(error_from_exception(e), req) from None
        finally:
            self.ctx.abort_unfinished(streams)
        if final is None:
            raise OpenAIError("the request ended without output", status=500, type="server_error")
        body = shape.response(final.outputs[0], final.num_cached_tokens)
        self._keep(req, body, history, final.outputs[0].text)
        return body

    def _validate(self, req: ResponsesRequest):
        """→ (the conversation before the new turn's output, the equivalent chat request, prompt token ids,
        max_tokens, top log-probs per token or None, the tool handler)."""
        self.ctx.check_model(req.model)
        if req.background:
            raise OpenAIError("background responses are not supported: omit `background` or set it to false.",
                              param="background")
        for name in _REFUSED_EXTRAS:
            if getattr(req, name):
                raise OpenAIError(f"{name} is not available on /v1/responses (use /v1/completions or "
                                  f"/v1/chat/completions).", param=name)
        unknown = [x for x in req.include or [] if x != INCLUDE_LOGPROBS]
        if unknown:
            raise OpenAIError(f"include values {unknown} are not supported; this server returns "
                              f"{INCLUDE_LOGPROBS!r}.", param="include")
        if req.max_output_tokens is not None and req.max_output_tokens < 1:
            raise OpenAIError(f"max_output_tokens must be at least 1, got {req.max_output_tokens}.",
                              param="max_output_tokens")
        limit = self.ctx.logprobs_limit
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= limit:
            raise OpenAIError(f"top_logprobs must be in [0, {limit}], got {req.top_logprobs}.", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if INCLUDE_LOGPROBS in (req.include or []) else None
        history = self._previous(req.previous_response_id) + input_messages(req.input)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
        chat = self._chat_request(req, messages, logprobs)
        try:
            tools = self.ctx.chat_tools(chat)
        except ValueError as e:
            raise OpenAIError(str(e), param="tool_choice") from None
        keep_special_tokens(self.ctx, chat)
        self.ctx.check_n(1, None, req.stream, req.use_beam_search)
        self.ctx.check_logit_adjustments(req.logit_bias, req.allowed_token_ids)
        try:
            ids = render_messages(self.ctx, chat, tools.template_tools())
        except OpenAIError as e:
            raise _renamed(e, req) from None
        ids = self.ctx.truncate(ids, req.truncate_prompt_tokens)
        self.ctx.check_length(len(ids), req.max_output_tokens, "input", "max_output_tokens")
        self.ctx.check_fits_pool(len(ids), req.max_output_tokens, chat, "max_output_tokens")
        return history, chat, ids, req.max_output_tokens, logprobs, tools

    def _previous(self, response_id: str | None) -> list[dict[str, Any]]:
        if response_id is None:
            return []
        if self.store is None:
            raise OpenAIError("previous_response_id needs stored responses: start the server with "
                              "--enable-responses-api-store.", param="previous_response_id")
        item = self.store.get(response_id)
        if item is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", param="previous_response_id",
                              code="not_found", status=404)
        return [dict(m) for m in item.messages]

    def _chat_request(self, req: ResponsesRequest, messages: list[dict[str, Any]],
                      logprobs: int | None) -> ChatCompletionRequest:
        fields: dict[str, Any] = {name: getattr(req, name) for name in SamplingExtras.model_fields}
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type != "text":
            if req.response_format is not None:
                raise OpenAIError("give the output format once: text.format or response_format, not both.",
                                  param="text.format")
            fields["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": {"name": fmt.name, "description": fmt.description,
                                                       "schema": fmt.json_schema, "strict": fmt.strict}}
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                 for t in req.tools or []]
        choice = req.tool_choice
        fields.update(
            model=req.model, messages=messages, max_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, stream=req.stream, logprobs=logprobs is not None,
            top_logprobs=logprobs, seed=req.seed, stop=req.stop, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, user=req.user, chat_template_kwargs=req.chat_template_kwargs,
            tools=tools or None, parallel_tool_calls=req.parallel_tool_calls,
            reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
            tool_choice=(choice if isinstance(choice, str) or choice is None
                         else {"type": "function", "function": {"name": choice.name}}))
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValueError as e:  # pydantic's ValidationError: a message the conversion made is not a chat message
            raise OpenAIError(f"the input does not form a valid conversation: {e}", param="input") from None

    def _keep(self, req: ResponsesRequest, body: dict[str, Any], history: list[dict[str, Any]], text: str) -> None:
        if self.store is None or not req.store:
            return
        turn: list[dict[str, Any]] = []
        for item in body["output"]:
            if item["type"] == "reasoning":  # thinking is not replayed into the next turn
                continue
            if item["type"] == "message":
                turn.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
            else:  # a function call: the next turn sends its output as a function_call_output item
                turn.append({"role": "assistant", "content": "", "tool_calls": [
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}}]})
        if not turn:
            turn = [{"role": "assistant", "content": text}]
        self.store.put(body["id"], StoredResponse(body=body, messages=history + turn))

    # -- streaming ---------------------------------------------------------------------------------
    async def _stream(self, req: ResponsesRequest, shape: "_Shape", history: list[dict[str, Any]],
                      streams) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.send("response.created", response=shape.body([], "in_progress", None, None))
        yield events.send("response.in_progress", response=shape.body([], "in_progress", None, None))
        final: RequestOutput | None = None
        # With tools or a reasoning parser, the output's items are known only at the end.
        plain = shape.tools.mode is None and shape.parser is None
        msg_id = _new_id("msg")
        sent_text, sent_toks, started = 0, 0, False
        try:
            async for _, out in merge_streams([s for _, s in streams]):
                final = out
                comp = out.outputs[0]
                if not plain:
                    continue
                if not started:
                    started = True
                    yield events.send("response.output_item.added", output_index=0, item={
                        "type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                        "content": []})
                    yield events.send("response.content_part.added", item_id=msg_id, output_index=0,
                                      content_index=0, part=_text_part("", [] if shape.logprobs is not None else None))
                delta = comp.text[sent_text:]
                new_lps = shape.token_logprobs(comp, sent_toks)
                if delta or new_lps:
                    yield events.send("response.output_text.delta", item_id=msg_id, output_index=0,
                                      content_index=0, delta=delta, logprobs=new_lps)
                sent_text, sent_toks = len(comp.text), len(comp.token_ids)
            if final is None:
                raise OpenAIError("the request ended without output", status=500, type="server_error")
            body = shape.response(final.outputs[0], final.num_cached_tokens, msg_id=msg_id)
            for index, item in enumerate(body["output"]):
                if item["type"] == "message":
                    part = item["content"][0]
                    if not started:
                        yield events.send("response.output_item.added", output_index=index,
                                          item={**item, "status": "in_progress", "content": []})
                        yield events.send("response.content_part.added", item_id=item["id"], output_index=index,
                                          content_index=0, part=_text_part("", [] if "logprobs" in part else None))
                        if part["text"]:
                            yield events.send("response.output_text.delta", item_id=item["id"],
                                              output_index=index, content_index=0, delta=part["text"],
                                              logprobs=part.get("logprobs") or [])
                    yield events.send("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=part.get("logprobs") or [])
                    yield events.send("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part)
                elif item["type"] == "reasoning":
                    text = item["content"][0]["text"]
                    yield events.send("response.output_item.added", output_index=index,
                                      item={**item, "status": "in_progress", "content": []})
                    yield events.send("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text)
                    yield events.send("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text)
                else:
                    yield events.send("response.output_item.added", output_index=index,
                                      item={**item, "status": "in_progress", "arguments": ""})
                    yield events.send("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=item["arguments"])
                    yield events.send("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"])
                yield events.send("response.output_item.done", output_index=index, item=item)
            self._keep(req, body, history, final.outputs[0].text)
            yield events.send("response.completed" if body["status"] == "completed" else "response.incomplete",
                              response=body)
        except Exception as e:
            err = _renamed(self.ctx.mapped_error(e, f"response stream {shape.id}"), req)
            yield events.send("error", code=err.code, message=err.message, param=err.param)
            yield events.send("response.failed", response={
                **shape.body([], "failed", None, None),
                "error": {"code": err.code or "server_error", "message": err.message}})
        finally:
            self.ctx.abort_unfinished(streams)


class _Shape:
    """One request's response object: its fixed fields, and the output built from the engine's result."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, response_id: str, model: str,
                 prompt_ids: list[int], logprobs: int | None, tools: ChatTools, stored: bool) -> None:
        self.ctx, self.req, self.id, self.model, self.stored = ctx, req, response_id, model, stored
        self.n_prompt, self.logprobs, self.tools = len(prompt_ids), logprobs, tools
        self.parser, self.harmony_calls = output_splitter(ctx, tools)
        self.opened = self.parser is not None and prompt_opens_thinking(ctx.tokenizer, prompt_ids)
        self.created_at = int(time.time())

    def body(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
             incomplete: dict[str, str] | None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
        choice = req.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": self.stored,
            "temperature": req.temperature, "top_p": req.top_p, "top_logprobs": req.top_logprobs,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice is not None
            else ("auto" if req.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled", "usage": usage, "user": req.user,
        }

    def response(self, comp: CompletionOutput, num_cached_tokens: int, msg_id: str | None = None) -> dict[str, Any]:
        reasoning, text = None, comp.text
        if self.parser is not None:
            reasoning, content = self.parser.split(comp.text, self.opened,
                                                   self.harmony_calls)
            text = content or ""
        message, finish = self.tools.message(text, comp.finish_reason)
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        item_status = "incomplete" if incomplete else "completed"
        output: list[dict[str, Any]] = []
        if reasoning:
            output.append({"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": item_status,
                           "content": [{"type": "reasoning_text", "text": reasoning}]})
        if message.content or not message.tool_calls:
            lps = self.token_logprobs(comp, 0)
            output.append({"type": "message", "id": msg_id or _new_id("msg"), "status": item_status,
                           "role": "assistant", "content": [_text_part(message.content or "", lps)]})
        for call in message.tool_calls or []:
            output.append({"type": "function_call", "id": _new_id("fc"), "call_id": call.id,
                           "name": call.function.name, "arguments": call.function.arguments,
                           "status": item_status})
        n_out = len(comp.token_ids)
        # Whatever --enable-prompt-tokens-details says (it governs chat and completions' prompt_tokens_details):
        # the Responses schema requires input_tokens_details, and vLLM's serving_responses always fills it in.
        usage = {"input_tokens": self.n_prompt, "input_tokens_details": {"cached_tokens": num_cached_tokens},
                 "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.n_prompt + n_out}
        return self.body(output, "incomplete" if incomplete else "completed", usage, incomplete)

    def token_logprobs(self, comp: CompletionOutput, start: int) -> list[dict[str, Any]] | None:
        """The output text's token log-probs from token `start` on (None unless the request included them)."""
        if self.logprobs is None:
            return None
        entries = self.ctx.chat_logprobs(comp.token_ids[start:], (comp.logprobs or [])[start:], self.logprobs,
                                         self.ctx.tokens_as_ids(self.req))
        return [e.model_dump(mode="json") for e in entries]


class _EventWriter:
    """Server-sent events as OpenAI writes them for responses: an `event:` line, then the JSON with its `type`
    and a `sequence_number` counting from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _renamed(err: OpenAIError, req: ResponsesRequest) -> OpenAIError:
    """An error of a shared check, or of the engine's constraint compile (which names vLLM's
    `structured_outputs`), with the parameter names of the Responses API."""
    fmt = req.text.format if req.text is not None else None
    if err.param == "structured_outputs" and fmt is not None and fmt.type != "text":
        err.param = "text.format"
    elif err.param in _PARAM_NAMES:
        err.param = _PARAM_NAMES[err.param]
    return err
