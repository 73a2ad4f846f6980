"""vLLM's reasoning parsers: whole outputs split into reasoning and content, and the same split streamed from
cumulative text in any chunking (markers cut across chunks included)."""
from __future__ import annotations

import itertools

import pytest

from pagedllm.entrypoints.openai.reasoning import ReasoningParser

CASES = [  # (parser, text, opened in the prompt) → (reasoning, content)
    ("qwen3", "<think>Let me add.</think>The sum is 4.", False, ("Let me add.", "The sum is 4.")),
    ("qwen3", "The sum is 4.", False, (None, "The sum is 4.")),
    ("qwen3", "No block, stray </think> here", False, (None, "No block, stray </think> here")),
    ("qwen3", "<think>cut off by max_tok", False, ("cut off by max_tok", None)),
    ("qwen3", "opened by the template</think>Answer", True, ("opened by the template", "Answer")),
    ("qwen3", "<think></think>Only an answer", False, (None, "Only an answer")),
    ("deepseek_r1", "thinking without the opener</think>Answer", False, ("thinking without the opener", "Answer")),
    ("deepseek_r1", "<think>a</think>", False, ("a", None)),
    ("deepseek_r1", "all reasoning, no end", False, ("all reasoning, no end", None)),
    ("qwen3", "<th", False, (None, "<th")),
    ("deepseek_r1", "<think>ends near a marker </thi", False, ("ends near a marker </thi", None)),
]


@pytest.mark.parametrize("name,text,opened,want", CASES)
def test_whole_and_streamed_splits_agree(name, text, opened, want):
    parser = ReasoningParser(name)
    assert parser.split(text, opened) == want
    for cuts in itertools.islice(itertools.combinations(range(1, len(text)), 3), 0, None, 7):
        stream = parser.stream(opened)
        reasoning = content = ""
        bounds = [*cuts, len(text)]
        for i, end in enumerate(bounds):
            r, c = stream.feed(text[:end], finished=i == len(bounds) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == want, cuts


def test_streamed_deltas_hold_back_a_cut_marker():
    stream = ReasoningParser("qwen3").stream()
    assert stream.feed("<thi", False) == ("", "")
    assert stream.feed("<think>I am </th", False) == ("I am ", "")
    assert stream.feed("<think>I am </think>Done", False) == ("", "Done")


def test_unknown_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="'granite' is not known; known: deepseek_r1, qwen3"):
        ReasoningParser("granite")


def test_responses_reasoning_effort_becomes_the_chat_requests():
    from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses

    req = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "medium"}})
    chat = OpenAIServingResponses._chat_request(object.__new__(OpenAIServingResponses), req,
                                                [{"role": "user", "content": "hi"}], None)
    assert chat.reasoning_effort == "medium"
    assert OpenAIServingResponses._chat_request(object.__new__(OpenAIServingResponses),
                                                ResponsesRequest.model_validate({"input": "hi"}),
                                                [{"role": "user", "content": "hi"}], None).reasoning_effort is None
