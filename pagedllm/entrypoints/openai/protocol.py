"""Pydantic models of the OpenAI-compatible API (requests validated, responses shaped like OpenAI's)."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)


class OpenAIBaseModel(BaseModel):
    """Base of the response models."""

    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """Base of the request models: the contract is exact, as OpenAI's.

    Unknown fields are a 400 naming the field (a client asking for something we do not do must hear
    so); types are strict (``"stream": "yes"`` and ``"n": "2"`` are errors; an int is still a valid
    float); NaN and infinities are refused.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _valid_unicode(value: str) -> str:
    # JSON can carry lone UTF-16 surrogates ("\ud800"); they are not text and no tokenizer takes them.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text contains a lone UTF-16 surrogate ({value[e.start]!r} at index {e.start}), "
                         f"which is not valid Unicode") from None
    return value


#: A string that is valid Unicode (no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]
#: Seeds span a 64-bit signed integer, as vLLM's.
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


# -- errors -----------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- shared pieces -----------------------------------------------------------------------------------
class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    #: Prompt tokens whose KV the prefix cache already held (not computed again).
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    #: With --enable-prompt-tokens-details only; left out of the JSON otherwise.
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


# -- structured outputs and tool calling ----------------------------------------------------------------
class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsExtras(RequestModel):
    """Output constraints: OpenAI's `response_format`, vLLM's `structured_outputs` object
    ({json | regex | choice | grammar | json_object}) or its older `guided_*` spellings; at most one."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class SamplingExtras(StructuredOutputsExtras):
    """vLLM's extra sampling parameters, accepted by both endpoints."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    #: OpenAI's token-id → bias map; validated (keys are token ids, values in [-100, 100]).
    logit_bias: dict[str, float] | None = None
    #: vLLM's: only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    #: vLLM's: keep only the prompt's last k tokens (-1: as many as fit).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    #: vLLM's: words never generated.
    bad_words: list[str] | None = None
    #: vLLM's: arguments for the server's custom logits processors (SamplingParams.extra_args).
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: vLLM's: logprob tokens as "token_id:N" strings (absent: the server's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    #: vLLM's request priority: lower is served first, when the server runs --scheduling-policy priority.
    priority: int = 0
    #: vLLM's: log-probs of every prompt token after the first, plus this many most likely tokens per position.
    prompt_logprobs: int | None = None
    #: vLLM's: the response carries the prompt's token ids and each choice's generated token ids.
    return_token_ids: bool = False
    #: vLLM's: prefix-cache blocks are shared only among requests with the same salt (a long random secret).
    cache_salt: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids written as decimal strings (e.g. \"50256\"), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias values must be in [-100, 100], got {bias} for token {key}")
        return value


# -- completions ----------------------------------------------------------------------------------------
class CompletionRequest(SamplingExtras):
    model: str | None = None
    #: May be absent or "" when prompt_embeds gives the prompt(s) (serving_completion checks that one of them does).
    prompt: Text | list[Text] | list[int] | list[list[int]] | None = None
    #: vLLM's: prompts as embeddings, base64 of a torch.save()d tensor [num_tokens, hidden_size] (one, or a list);
    #: the server needs --enable-prompt-embeds. They run before the request's `prompt`s (choices in that order).
    prompt_embeds: str | list[str] | None = None
    #: Absent: 16 (OpenAI's and vLLM's default); explicit null: up to the context limit (as vLLM).
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, list) and value:
            kinds = {"text" if isinstance(x, str) else "token ids" if isinstance(x, (int, list)) else "other"
                     for x in value}
            nested = {isinstance(x, list) for x in value if not isinstance(x, str)}
            if len(kinds) > 1 or len(nested) > 1:
                raise ValueError("a prompt list must be all strings, all token ids, or all lists of token ids; "
                                 "this one mixes them")
        return value


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob, as its responses carry prompt log-probs (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per prompt position: None for the first token, else {token id: its log-prob}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: With return_token_ids: the prompt's ids (a stream: in a choice's first chunk) and the generated ids (a
    #: stream: each chunk's new ones).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponseChoice(CompletionStreamChoice):
    prompt_logprobs: PromptLogprobs | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionResponse(CompletionStreamResponse):
    choices: list[CompletionResponseChoice]


# -- chat -----------------------------------------------------------------------------------------------------
class ChatContentPart(RequestModel):
    # Other part types (image_url, input_audio, ...) carry their own fields; they are refused later
    # with a clear "only text" error.
    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None


#: OpenAI's message roles ("function" is its deprecated predecessor of "tool").
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessageParam(RequestModel):
    role: ChatRole
    content: Text | list[ChatContentPart] | None = None
    name: Text | None = None
    # Accepted so a conversation replayed from an OpenAI client validates; passed to the template.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessageParam":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs `content`")
        if self.content is None and not (self.tool_calls or self.refusal):
            raise ValueError("an 'assistant' message needs `content` (or `tool_calls`)")
        return self


class ChatCompletionRequest(SamplingExtras):
    model: str | None = None
    messages: list[ChatMessageParam]
    #: Absent: up to the context limit (vLLM's chat default; OpenAI's models likewise have none).
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    add_generation_prompt: bool = True
    #: vLLM's: end the prompt inside the last message so the model continues it (needs add_generation_prompt false)
    continue_final_message: bool = False
    #: vLLM's: a Jinja template for this request only; a 400 unless the server runs --trust-request-chat-template
    chat_template: Text | None = None
    #: vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    #: OpenAI's: how hard a reasoning model thinks; the chat template's `reasoning_effort` variable (gpt-oss's
    #: template writes it into the system message), unless chat_template_kwargs sets it
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    #: vLLM's (with --reasoning-parser): false drops the reasoning from the response
    include_reasoning: bool = True


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    #: vLLM's (--reasoning-parser): the model's thinking, apart from its answer.
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's new token ids


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: in a choice's first chunk


# -- models, tokenize -------------------------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: As a chat request's: needs --trust-request-chat-template
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model."""
    return model.model_dump(mode="json")
