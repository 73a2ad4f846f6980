"""vLLM's reasoning parsers (``--reasoning-parser``): a thinking model's output split into `reasoning` (what it
wrote between ``<think>`` and ``</think>``) and `content` (the answer after it), whole or as stream deltas.

``deepseek_r1``: output without ``</think>`` is all reasoning (R1 may omit ``<think>``, its template opens it).
``qwen3``: output is reasoning only inside a ``<think>`` block it opens; without one it is all content.
For both, a prompt that ends inside ``<think>`` (templates that open the block themselves) starts the output in
reasoning, and a block cut off by ``max_tokens`` is reasoning with no content.
``openai_gptoss``: GPT-OSS's harmony channels (harmony.py): `analysis` is the reasoning, `final` and preambles the
content; with `tool_calls`, the content handed on also carries the harmony tool calls, for the `openai` tool parser."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.harmony import split_harmony
from pagedllm.reasoning import HARMONY, THINK_END, THINK_START, check_reasoning_parser


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def __post_init__(self) -> None:
        check_reasoning_parser(self.name)

    @property
    def needs_special_tokens(self) -> bool:
        """Whether its markers are special tokens, which detokenization must keep (harmony's)."""
        return self.name == HARMONY

    def split(self, text: str, opened_in_prompt: bool = False,
              tool_calls: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; an empty part is None. `tool_calls`: the content is harmony's
        tool view (its calls after it, for the `openai` tool parser); other formats' calls are content anyway."""
        if self.name == HARMONY:
            parts = split_harmony(text)
            return parts.reasoning or None, (parts.tool_view() if tool_calls else parts.content) or None
        inside = opened_in_prompt or text.startswith(THINK_START)
        if not inside and self.name == "qwen3":
            return None, text or None
        body = text[len(THINK_START):] if text.startswith(THINK_START) else text
        end = body.find(THINK_END)
        if end >= 0:
            return body[:end] or None, body[end + len(THINK_END):] or None
        return body or None, None

    def stream(self, opened_in_prompt: bool = False, tool_calls: bool = False) -> "ReasoningStream":
        return ReasoningStream(self, opened_in_prompt, tool_calls)


class ReasoningStream:
    """Deltas of one choice's reasoning and content from its cumulative text. A tail that may still become a
    marker (``</thi``, or ``<th`` at the very start; a harmony marker anywhere) is held back until the next text
    decides it."""

    def __init__(self, parser: ReasoningParser, opened_in_prompt: bool, tool_calls: bool = False) -> None:
        self.parser, self.opened_in_prompt, self.tool_calls = parser, opened_in_prompt, tool_calls
        self.sent_reasoning = self.sent_content = 0
        self.content = ""  # the content so far (what a tool-call parser reads: harmony's tool view with tool_calls)

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) since the previous call, for the choice's text so far."""
        if self.parser.name == HARMONY:
            parts = split_harmony(text, finished)
            reasoning, content = parts.reasoning, parts.content
            self.content = parts.tool_view() if self.tool_calls else content
        else:
            reasoning, content = self._visible(text, finished)
            self.content = content
        r_delta, c_delta = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return r_delta, c_delta

    def _visible(self, text: str, finished: bool) -> tuple[str, str]:
        if finished:
            reasoning, content = self.parser.split(text, self.opened_in_prompt)
            return reasoning or "", content or ""
        if not self.opened_in_prompt and THINK_START.startswith(text):
            return "", ""  # "<th…": a marker or not, the next text tells
        started = text.startswith(THINK_START)
        if not (self.opened_in_prompt or started) and self.parser.name == "qwen3":
            return "", text  # qwen3 without a block: all content
        body = text[len(THINK_START):] if started else text
        end = body.find(THINK_END)
        if end >= 0:
            return body[:end], body[end + len(THINK_END):]
        return body[:len(body) - _marker_prefix_len(body)], ""


def _marker_prefix_len(text: str) -> int:
    """Length of the longest tail of `text` that begins THINK_END."""
    for n in range(min(len(THINK_END) - 1, len(text)), 0, -1):
        if THINK_END.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_thinking(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the rendered prompt ends inside a ``<think>`` block (the template opened it for the model; harmony
    has no such case)."""
    tail = tokenizer.decode(prompt_ids[-8:]) if prompt_ids else ""
    return tail.rstrip().endswith(THINK_START)
