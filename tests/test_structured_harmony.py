"""Structured outputs with `--reasoning-parser openai_gptoss` (vLLM's behaviour): the grammar constrains only the
answer, which starts after harmony's ``<|channel|>final<|message|>``, a marker of several tokens.

As in test_structured_reasoning.py, the bundled model has no harmony tokens, so the engine is told that ordinary
tokens are the markers: three consecutive tokens of the greedy run end the "reasoning" there. The manager's own
paths (a partial marker, one that begins in the prompt, drafts, rewinds, forks) are checked on stand-in sequences."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.manager import StructuredOutputManager  # noqa: E402

CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def setup(tokenizer):
    llm = LLM(num_gpu_blocks_override=128, max_model_len=512, reasoning_parser="openai_gptoss")
    manager = llm.llm_engine.structured_output
    assert manager.reasoning_tokens is None  # SmolLM2 has no harmony tokens: told so, then stand-ins
    prompt = tokenizer.encode("The capital of France is")
    free = list(llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12),
                             use_tqdm=False)[0].outputs[0].token_ids)
    # The first place where three consecutive tokens appear for the first time, its last token new.
    k = next(i for i in range(4, len(free)) if free[i] not in free[:i] and free[i] not in prompt)
    end = tuple(free[k - 2:k + 1])
    start = next(t for t in range(1000, 2000) if t not in prompt and t not in free)
    manager.reasoning_tokens = ((start,), end)
    return llm, tokenizer, prompt, free, k, start, end


def _choice(max_tokens: int = 24, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(choice=CHOICES), **kw)


def test_reasoning_is_free_until_the_marker_sequence_then_the_grammar_holds(setup):
    llm, tokenizer, prompt, free, k, _, _ = setup
    outs = llm.generate({"prompt_token_ids": prompt}, _choice(n=2, temperature=1.0, top_k=1, seed=0), use_tqdm=False)
    assert len(outs[0].outputs) == 2
    for out in outs[0].outputs:
        ids = list(out.token_ids)
        assert ids[:k + 1] == free[:k + 1]  # unconstrained up to and with the whole end marker
        assert tokenizer.decode(ids[k + 1:], skip_special_tokens=True) in CHOICES
        assert out.finish_reason == "stop"


def test_a_prompt_that_opened_the_answer_is_constrained_from_the_first_token(setup):
    llm, _, prompt, _, _, start, end = setup
    opened = prompt + [start, *end]
    out = llm.generate({"prompt_token_ids": opened}, _choice(), use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES, out.text
    # A new message after the answer's (harmony: a later turn) starts in the reasoning again.
    out = llm.generate({"prompt_token_ids": opened + [start]}, _choice(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert out.text not in CHOICES and out.finish_reason == "length"


# -- the manager on stand-in sequences ------------------------------------------------------------------------------
E1, E2, E3, START, OTHER = 1001, 1002, 1003, 1004, 1005


@pytest.fixture(scope="module")
def grammar(tokenizer):
    manager = StructuredOutputManager("xgrammar", tokenizer, 49152, (tokenizer.eos_token_id,), num_threads=1,
                                      reasoning_tokens=(START, (E1, E2, E3)))
    return manager, manager.request(StructuredOutputsParams(choice=CHOICES)).result()


def _seq(prompt: list[int], out: list[int] | None = None, seq_id: int = 0):
    return SimpleNamespace(seq_id=seq_id, prompt_token_ids=prompt, output_token_ids=list(out or []), extra={},
                           is_finished=lambda: False)


def test_the_answer_starts_only_when_the_whole_marker_is_written(grammar, tokenizer):
    manager, compiled = grammar
    seq = _seq([1, START])
    thinking = []
    for tok in [OTHER, E3, E2, E3, E1, E2, OTHER, E1, E2, E3]:  # pieces and misordered parts of the marker first
        seq.output_token_ids.append(tok)
        assert manager.accept(seq, compiled) is False
        thinking.append(seq.extra["grammar"].thinking)
    assert thinking == [True] * 9 + [False]
    yes = tokenizer.encode("yes")
    for tok in yes:
        seq.output_token_ids.append(tok)
        manager.accept(seq, compiled)
    assert seq.extra["grammar"].num_tokens == 10 + len(yes) and not seq.extra["grammar"].failed
    # A fork keeps the state; a rewind (fewer outputs than the matcher took) replays the history.
    child = _seq(seq.prompt_token_ids, seq.output_token_ids, seq_id=1)
    manager.fork(seq, child)
    assert child.extra["grammar"].thinking is False and child.extra["grammar"].num_tokens == seq.extra["grammar"].num_tokens
    del seq.output_token_ids[10:]  # back to the whole marker: the answer has begun
    assert manager.sync(seq, compiled).thinking is False
    del seq.output_token_ids[9:]  # back before its last token: still reasoning
    assert manager.sync(seq, compiled).thinking is True


def test_a_marker_that_begins_in_the_prompt_and_the_prompt_state(grammar):
    manager, compiled = grammar
    spanning = _seq([1, START, E1, E2], [E3])
    assert manager.sync(spanning, compiled).thinking is False
    assert manager.sync(_seq([1, START, E1, E2, E3]), compiled).thinking is False  # the prompt opened the answer
    assert manager.sync(_seq([1, E1, E2, E3, START]), compiled).thinking is True  # a new message after it
    assert manager.sync(_seq([1, E2, E3]), compiled).thinking is True


def test_drafts_while_reasoning_stop_at_the_token_that_completes_the_marker(grammar):
    manager, compiled = grammar
    n, masks = manager.draft_masks(_seq([1, START], [OTHER, E1]), compiled, [E2, E3, OTHER, OTHER])
    assert n == 1 and masks.shape[0] == 2 and bool((masks == -1).all())
    assert manager.draft_masks(_seq([1, START, E1], []), compiled, [E2, E3])[0] == 1  # begun in the prompt
    assert manager.draft_masks(_seq([1, START], [OTHER]), compiled, [E3, E2, E3, OTHER])[0] == 4  # no whole marker
