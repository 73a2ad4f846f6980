"""Tokenizer loading, chat templates and incremental (streaming) detokenization."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

# Prompt tokens decoded in front of the first output token so that its leading space renders right.
INITIAL_PROMPT_CONTEXT = 5


def get_tokenizer(
    model_dir: str | os.PathLike[str] | None,
    tokenizer: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """Load a ``transformers`` tokenizer offline from ``tokenizer`` (default: the model directory).

    Either argument may also be a .gguf file or the default model name; it is prepared (converted
    once, cached) with :func:`pagedllm.model.loader.prepare_model_dir`.
    """
    from transformers import AutoTokenizer

    from pagedllm.model.loader import prepare_model_dir

    source = tokenizer if tokenizer is not None else model_dir
    path = Path(source).expanduser() if source is not None else None
    if path is None or not path.is_dir():  # a .gguf file or the default model name
        path = prepare_model_dir(None if source is None else str(source))
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"Could not load a tokenizer from {path}: {e}") from e


def _normalize_messages(messages: Sequence[Any], content_format: str = "string") -> list[dict[str, Any]]:
    """Validate chat messages. Content format "string": OpenAI-style lists of text parts are joined into one
    string, one part per line ("\\n" between parts, as vLLM joins them); "openai": every content becomes a list of
    text parts (a string one part)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role' (e.g. 'system', 'user', 'assistant')")
        if "content" not in m:
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'")
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(
                        f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}; only text is supported"
                    )
                parts.append(part["text"])
            content = "\n".join(parts) if content_format == "string" else [{"type": "text", "text": t} for t in parts]
        elif content is None:
            content = "" if content_format == "string" else []
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")
        elif content_format == "openai":
            content = [{"type": "text", "text": content}]
        out.append({**m, "content": content})
    return out


#: apply_chat_template's own parameters: chat_template_kwargs may not set them (they have fields of their own).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_chat_template_options(add_generation_prompt: bool, continue_final_message: bool,
                                chat_template_kwargs: dict[str, Any] | None) -> None:
    """vLLM's rules for the template options of a chat request; a ValueError names what is wrong."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: continuing the "
                         "final message opens no new turn; set add_generation_prompt=false.")
    if chat_template_kwargs is None:
        return
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise ValueError("chat_template_kwargs must be an object of template variables by name.")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & chat_template_kwargs.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {clash}: each is a parameter of its own.")


def render_chat_template(
    tokenizer: Any, messages: Sequence[Any], add_generation_prompt: bool = True, chat_template: str | None = None,
    tools: list[dict] | None = None, continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None, content_format: str = "auto",
) -> str:
    """The prompt text produced by the chat template (the model's own unless ``chat_template`` is given).
    ``continue_final_message``: the text ends inside the last message (no end of turn after it), so the model
    continues that message; ``chat_template_kwargs``: extra variables for the template (e.g. a Qwen3 template's
    ``enable_thinking``), as vLLM takes them; ``content_format``: vLLM's chat-template content format ("auto",
    "string" or "openai", see :mod:`pagedllm.chat_content_format`)."""
    from pagedllm.chat_content_format import resolve_content_format, template_text

    check_chat_template_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
    fmt = resolve_content_format(content_format, template_text(tokenizer, chat_template, tools)
                                 if content_format == "auto" else None)
    msgs = _normalize_messages(messages, fmt)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "This model's tokenizer has no chat template; pass chat_template=... (a Jinja template) "
            "or use a plain completion prompt instead"
        )
    text = tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
        continue_final_message=continue_final_message, **({"tools": tools} if tools else {}),
        **(chat_template_kwargs or {}),
    )
    if not isinstance(text, str):
        raise ValueError(f"Chat template rendering returned {type(text).__name__}, expected str")
    return text


def apply_chat_template(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
    tools: list[dict] | None = None, continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None, content_format: str = "auto",
) -> list[int]:
    """Render ``messages`` (and ``tools``, OpenAI function specs) with the chat template and tokenize
    (special tokens in the text are parsed); the options as in ``render_chat_template``."""
    text = render_chat_template(tokenizer, messages, add_generation_prompt, chat_template, tools,
                                continue_final_message, chat_template_kwargs, content_format)
    return list(tokenizer.encode(text, add_special_tokens=False))


# --------------------------------------------------------------------------------------------
# Incremental detokenization


@dataclass
class DetokenizeResult:
    """What one :meth:`IncrementalDetokenizer.append` released."""

    delta_text: str
    stop_str_matched: str | None = None


def _make_decode(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    """A fast ``ids -> text`` function equal to ``tokenizer.decode`` without clean-up of spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False,
    )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, correct for multi-byte UTF-8 characters split across tokens
    (never emits U+FFFD for an incomplete character; waits for the next token) and for stop strings.

    Uses vLLM's prefix/read offsets: each step decodes only a small window of recent tokens, so the
    cost per token is O(window). Text that could still become a stop string is held back.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a list of strings")
        self._decode = _make_decode(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stop or ()) if s))
        self._include_stop = include_stop_str_in_output
        # Token window: a few prompt tokens give the first output token its proper leading space.
        context = [int(t) for t in prompt_token_ids[-INITIAL_PROMPT_CONTEXT:]]
        prefix_text = self._decode(context) if context else ""
        if prefix_text.endswith("\ufffd"):  # prompt ends mid-character: do not glue output bytes onto it
            context, prefix_text = [], ""
        # Window of tokens decoded each step: _ids[:_read_offset] were already read (their text,
        # _prefix_len chars long, gives context); the rest is new.
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_len = len(prefix_text)
        self._text = ""  # all decoded output text (before stop truncation)
        self._released = 0  # chars of _text already handed out
        self._stop_matched: str | None = None
        self._finished = False

    # -- public ---------------------------------------------------------------------------
    @property
    def output_text(self) -> str:
        """Text released so far (held-back stop-string prefixes excluded, truncated at a matched stop)."""
        return self._text[: self._released]

    @property
    def stop_str_matched(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop_matched

    @property
    def finished(self) -> bool:
        """True after a stop-string match or :meth:`flush`; further appends are ignored."""
        return self._finished

    def append(self, new_token_ids: Sequence[int]) -> DetokenizeResult:
        """Add generated tokens; returns the newly releasable text and any stop-string match."""
        if self._finished or not new_token_ids:
            return DetokenizeResult("")
        self._ids.extend(int(t) for t in new_token_ids)
        old_len = len(self._text)
        self._text += self._decode_new(final=False)
        return self._release(old_len)

    def flush(self) -> str:
        """At the end of generation (no stop matched): release held-back and undecodable text."""
        if self._finished:
            return ""
        tail = self._decode_new(final=True)
        old_len = len(self._text)
        self._text += tail
        delta = self._release(old_len, hold_back=False).delta_text
        self._finished = True
        return delta

    # -- internals ------------------------------------------------------------------------
    def _decode_new(self, final: bool) -> str:
        """Text of the tokens after the read offset; '' while an incomplete character is pending."""
        if self._read_offset >= len(self._ids):
            return ""
        new_text = self._decode(self._ids)
        if not final and (len(new_text) < self._prefix_len or new_text.endswith("\ufffd")):
            return ""  # wait for the bytes that complete the character
        delta = new_text[self._prefix_len:]
        # Slide the window: the tokens just read become the prefix of the next step.
        window = self._ids[self._read_offset:]
        self._ids, self._read_offset = window, len(window)
        self._prefix_len = len(self._decode(window))
        return delta

    def _release(self, old_len: int, hold_back: bool = True) -> DetokenizeResult:
        """Check stop strings in the new text and move the release point forward."""
        text = self._text
        if self._stop:
            match_pos, match = -1, None
            for s in self._stop:
                # A new match must end inside the new text (earlier text was already checked).
                pos = text.find(s, max(old_len - len(s) + 1, 0))
                if pos != -1 and (match is None or pos < match_pos):
                    match_pos, match = pos, s
            if match is not None:
                end = match_pos + len(match) if self._include_stop else match_pos
                self._text = text[:end]
                delta = self._text[self._released:]
                self._released = len(self._text)
                self._stop_matched = match
                self._finished = True
                return DetokenizeResult(delta, match)
        release_to = len(text)
        if hold_back and self._stop and not self._include_stop:
            release_to -= self._held_back_len(text)
        release_to = max(release_to, self._released)
        delta = text[self._released:release_to]
        self._released = release_to
        return DetokenizeResult(delta)

    def _held_back_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
