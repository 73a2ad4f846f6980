"""OpenAI's harmony format (GPT-OSS) on detokenized text, for ``--reasoning-parser openai_gptoss`` and
``--tool-call-parser openai`` (vLLM's names).

An output continues the prompt's ``<|start|>assistant``, so its first message has no ``<|start|>``:
``<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>``. A header holds a
channel (``<|channel|>analysis``), maybe a recipient (``to=functions.NAME``, before or after the channel) and a
content type (``<|constrain|>json`` or a bare ``json``). As vLLM does: `analysis` messages are the reasoning; `final`
messages and `commentary` messages without a recipient (preambles shown to the user) are the content; messages to
``functions.NAME`` are tool calls (their body the arguments); several messages of one kind are joined by newlines.

Shape: this module splits the text once, for both parsers. The reasoning parser returns the reasoning and the
content; when a tool parser that reads harmony runs too (tool_choice "auto"), the content it hands to ChatTools is
the *tool view*: the content followed by each call re-rendered as a ``<|start|>assistant…`` message, so the `openai`
tool parser (tool_parsers/openai.py) streams the content up to the first ``<|start|>`` and turns the rest into
`tool_calls`, with ChatTools' usual machinery. Marker text never reaches `reasoning` or `content`.

The markers are special tokens of GPT-OSS's tokenizer: requests parsed here are detokenized with them kept."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_RECIPIENT = re.compile(r"to=([^\s<]+)")
#: How an output in harmony begins (after the prompt's ``<|start|>assistant``): its channel, or a recipient.
_OPENERS = (CHANNEL, "to=", " to=")


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    content_type: str | None
    body: str = ""
    ended: bool = False  # closed (<|end|>, <|call|>, <|return|> or the next header), not cut off

    @property
    def is_tool_call(self) -> bool:
        return self.recipient is not None and self.recipient.startswith(FUNCTIONS)

    @property
    def is_reasoning(self) -> bool:
        return self.channel == "analysis" and not self.is_tool_call

    @property
    def is_content(self) -> bool:
        """The answer, or a preamble (commentary to no one) shown to the user."""
        return self.channel == "final" or (self.channel in ("commentary", None) and self.recipient is None)


@dataclass(frozen=True)
class HarmonySplit:
    reasoning: str
    content: str
    calls: list[HarmonyMessage]

    def tool_view(self) -> str:
        """The content, then each call as a harmony message: what the `openai` tool parser reads."""
        return self.content + "".join(render_call(m) for m in self.calls)


def render_call(msg: HarmonyMessage) -> str:
    constrain = f" {CONSTRAIN}{msg.content_type}" if msg.content_type else ""
    return (f"{START}assistant{CHANNEL}{msg.channel or 'commentary'} to={msg.recipient}{constrain}{MESSAGE}"
            f"{msg.body}{CALL if msg.ended else ''}")


def is_harmony(text: str) -> bool | None:
    """Whether an output is in harmony (it begins with a header); None while its beginning cannot tell yet."""
    if text.startswith(_OPENERS):
        return True
    if any(opener.startswith(text) for opener in _OPENERS):
        return None
    return False


def split_harmony(text: str, finished: bool = True) -> HarmonySplit:
    """An output's reasoning, content and tool calls. While it runs (`finished` False) a tail that may be the start
    of a marker is held back, and so is a beginning that may still turn out to be a header. A finished output's
    last call counts without ``<|call|>`` (an end-of-sequence token, maybe not in the text) when its arguments are
    whole (valid JSON, for JSON); cut off by max_tokens, it is no call. Output that is not harmony is all content."""
    harmony = is_harmony(text)
    if harmony is None:
        harmony = False
        if not finished:
            text = ""
    if not harmony:
        return HarmonySplit("", text, [])
    if not finished:
        text = text[:len(text) - partial_marker_len(text)]
    messages = parse_messages(text)
    if finished and messages and messages[-1].is_tool_call and not messages[-1].ended:
        messages[-1].ended = whole_arguments(messages[-1])
    return HarmonySplit(
        reasoning=_join(m for m in messages if m.is_reasoning),
        content=_join(m for m in messages if m.is_content and not m.is_tool_call),
        calls=[m for m in messages if m.is_tool_call and (m.ended or not finished)])


def json_arguments(msg: HarmonyMessage) -> bool:
    """Whether a call's arguments are JSON: its content type says so, or it gives none (as vLLM assumes)."""
    return not msg.content_type or "json" in msg.content_type


def whole_arguments(msg: HarmonyMessage) -> bool:
    if not json_arguments(msg):
        return True
    try:
        json.loads(msg.body)
    except ValueError:
        return False
    return True


def parse_messages(text: str) -> list[HarmonyMessage]:
    """The messages of harmony text whose first header needs no ``<|start|>``; a message is listed once its header
    is complete (``<|message|>``), with the body written so far. Stray text between messages is dropped."""
    messages: list[HarmonyMessage] = []
    header: str | None = ""  # the header being read; None between messages
    current: HarmonyMessage | None = None  # the message whose body is being read
    pos = 0
    for match in [*_MARKER.finditer(text), None]:
        chunk = text[pos:match.start()] if match is not None else text[pos:]
        marker = match.group() if match is not None else None
        pos = match.end() if match is not None else len(text)
        if current is not None:
            current.body += chunk
            if marker in (END, RETURN, CALL, START, CHANNEL):  # a new header closes the message too
                current.ended, current = True, None
                header = "" if marker == START else CHANNEL if marker == CHANNEL else None
        elif header is not None:
            header += chunk
            if marker == MESSAGE:
                current = _message(header)
                messages.append(current)
                header = None
            elif marker in (CHANNEL, CONSTRAIN):
                header += marker
            elif marker is not None:
                header = "" if marker == START else None
        elif marker in (START, CHANNEL):
            header = "" if marker == START else CHANNEL
    return messages


def _message(header: str) -> HarmonyMessage:
    """A message from its header: ``assistant to=R<|channel|>C json`` or ``<|channel|>C to=R <|constrain|>json``."""
    found = _RECIPIENT.search(header)
    rest = _RECIPIENT.sub(" ", header)
    rest, _, constrained = rest.partition(CONSTRAIN)
    _, _, after_channel = rest.partition(CHANNEL)
    words = after_channel.split()
    content_type = (constrained.split() or [None])[0] or (words[1] if len(words) > 1 else None)
    return HarmonyMessage(channel=words[0] if words else None, recipient=found.group(1) if found else None,
                          content_type=content_type)


def partial_marker_len(text: str) -> int:
    """Length of the longest tail of `text` that is the start of a marker (not a whole one)."""
    cut = text.rfind("<", max(0, len(text) - len(CONSTRAIN)))
    if cut < 0:
        return 0
    tail = text[cut:]
    return len(tail) if any(m.startswith(tail) and m != tail for m in MARKERS) else 0


def _join(messages) -> str:
    return "\n".join(m.body for m in messages if m.body)
