"""Structured outputs with a reasoning parser (vLLM's behaviour): the grammar constrains the answer after the model's
</think>, not its thinking, and applies from the first token when the prompt already closed the thinking block.

The bundled model has no <think> tokens, so the engine is told that two of its ordinary tokens are the markers: the
greedy run's own k-th token closes the "thinking", so the constrained run must agree with it up to there and obey
the grammar after it."""
from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def setup(tokenizer):
    llm = LLM(num_gpu_blocks_override=128, max_model_len=512, reasoning_parser="qwen3")
    manager = llm.llm_engine.structured_output
    assert manager.reasoning_tokens is None  # SmolLM2's vocabulary has no <think> token: told so, then stand-ins
    prompt = tokenizer.encode("The capital of France is")
    free = list(llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12),
                             use_tqdm=False)[0].outputs[0].token_ids)
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i] and free[i] not in prompt)
    start = next(t for t in range(1000, 2000) if t not in prompt and t not in free)
    manager.reasoning_tokens = (start, free[k])
    return llm, tokenizer, prompt, free, k, start


def _choice(max_tokens: int = 24, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(choice=CHOICES), **kw)


def test_thinking_is_free_and_the_answer_obeys_the_grammar(setup):
    llm, tokenizer, prompt, free, k, _ = setup
    # n=2 forks the sequences (and their grammar state); top_k=1 keeps both on the greedy path.
    outs = llm.generate({"prompt_token_ids": prompt}, _choice(n=2, temperature=1.0, top_k=1, seed=0), use_tqdm=False)
    assert len(outs[0].outputs) == 2
    for out in outs[0].outputs:
        ids = list(out.token_ids)
        assert ids[:k + 1] == free[:k + 1]  # unconstrained up to and with the end marker
        answer = tokenizer.decode(ids[k + 1:], skip_special_tokens=True)
        assert answer in CHOICES, answer
        assert out.finish_reason == "stop"


def test_a_prompt_that_closed_its_thinking_is_constrained_from_the_first_token(setup):
    llm, tokenizer, prompt, free, k, start = setup
    closed = prompt + [start, free[k]]
    out = llm.generate({"prompt_token_ids": closed}, _choice(), use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES, out.text
    # A prompt that opens a new block after an earlier closed one starts thinking again.
    reopened = closed + [start]
    out = llm.generate({"prompt_token_ids": reopened}, _choice(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert out.text not in CHOICES and out.finish_reason == "length"


def test_without_a_reasoning_parser_the_grammar_starts_at_once(setup):
    llm, _, prompt, _, _, _ = setup
    manager = llm.llm_engine.structured_output
    saved, manager.reasoning_tokens = manager.reasoning_tokens, None
    try:
        out = llm.generate({"prompt_token_ids": prompt}, _choice(), use_tqdm=False)[0].outputs[0]
    finally:
        manager.reasoning_tokens = saved
    assert out.text in CHOICES


def test_an_unknown_reasoning_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="reasoning parser 'r2' is not known; known: deepseek_r1, qwen3"):
        LLM(reasoning_parser="r2", num_gpu_blocks_override=16)
