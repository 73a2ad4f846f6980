"""Speculative decoding of grammar-constrained requests (vLLM's structured outputs with speculation): drafts are cut
to what the grammar accepts and every verification row is masked as plain constrained decoding masks it, so the
outputs are those of plain constrained decoding (bundled model, float32, CPU)."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.manager import StructuredOutputManager  # noqa: E402
from pagedllm.structured_output.sample_schemas import CONTACT_SCHEMA, extraction_requests  # noqa: E402

SO = StructuredOutputsParams
# every proposed token verified ("fixed"), so the masked verification runs whatever the machine's timing
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "draft_length_policy": "fixed"}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 20, "draft_length_policy": "fixed"}
REGEX = r"[a-z]+\.[a-z]+@example\.(com|org|net)"


def _run(prompts, params, spec=None, **kw):
    llm = LLM(max_model_len=512, dtype="float32", num_gpu_blocks_override=kw.pop("blocks", 96), speculative_config=spec,
              **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.llm_engine
    bm = eng.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks  # nothing leaked
    bm.check_invariants()
    return [[list(c.token_ids) for c in o.outputs] for o in outs], [[c.text for c in o.outputs] for o in outs], eng.stats()


def _params(**kw):
    return SamplingParams(max_tokens=kw.pop("max_tokens", 64), structured_outputs=SO(json=CONTACT_SCHEMA), **kw)


@pytest.fixture(scope="module")
def reference():
    prompts = extraction_requests(3, seed=1)
    toks, texts, _ = _run(prompts, _params(temperature=0))
    return prompts, toks, texts


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_greedy_constrained_outputs_identical_on_off(reference, spec):
    prompts, ref_toks, ref_texts = reference
    toks, texts, st = _run(prompts, _params(temperature=0), spec)
    assert toks == ref_toks
    for (text,) in texts:
        jsonschema.validate(json.loads(text), CONTACT_SCHEMA)
    assert st["spec_decode_num_draft_tokens"] > 0
    if spec is NGRAM:  # the answers copy their prompt
        assert st["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_and_mixed_batch_identical_on_off(reference):
    """Seeded random rows draw one uniform per emitted token, masked or not, so they emit plain decoding's tokens;
    an unconstrained neighbour keeps its own."""
    prompts = reference[0][:2] + ["The quick brown fox jumps over the lazy dog. The quick brown fox"]
    params = [_params(temperature=0.8, seed=7), _params(temperature=1.0, top_p=0.9, seed=11),
              SamplingParams(temperature=0, max_tokens=24)]
    off, _, _ = _run(prompts, params)
    on, texts, st = _run(prompts, params, NGRAM)
    assert on == off
    assert st["spec_decode_num_accepted_tokens"] > 0
    for (text,) in texts[:2]:
        jsonschema.validate(json.loads(text), CONTACT_SCHEMA)


def test_regex_and_choice_constraints_speculate(reference):
    prompts = [reference[0][0] + ' {"email": "', "Pick one of red, green or blue. I pick"]
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(regex=REGEX)),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=["red", "green", "blue"]))]
    off, _, _ = _run(prompts, params)
    on, texts, _ = _run(prompts, params, NGRAM)
    assert on == off
    assert re.fullmatch(REGEX, texts[0][0]), texts[0][0]
    assert texts[1][0] in ("red", "green", "blue")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_identical_under_preemption_and_n2(reference, mode):
    prompts = extraction_requests(4, seed=2)
    params = [_params(temperature=0), _params(temperature=0.7, seed=3, n=2), _params(temperature=0), _params(temperature=0)]
    kw = dict(blocks=24, preemption_mode=mode, swap_space=0.05)
    off, _, _ = _run(prompts, params, **kw)
    on, texts, st = _run(prompts, params, NGRAM, **kw)
    assert st["num_preemptions"] > 0
    assert on == off
    for out in texts:
        for text in out:
            jsonschema.validate(json.loads(text), CONTACT_SCHEMA)


def test_llguidance_backend_identical_on_off(reference):
    pytest.importorskip("llguidance")
    prompts = reference[0]
    off, _, _ = _run(prompts, _params(temperature=0), structured_outputs_backend="guidance")
    on, texts, st = _run(prompts, _params(temperature=0), NGRAM, structured_outputs_backend="guidance")
    assert on == off
    for (text,) in texts:
        jsonschema.validate(json.loads(text), CONTACT_SCHEMA)
    assert st["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_draft_masks_are_the_masks_of_plain_decoding(tokenizer, backend):
    """Row i of `draft_masks` equals the mask a matcher advanced over drafts[:i] gives; drafts stop at the first
    one the grammar rejects; the sequence's matcher is left where it was."""
    if backend == "guidance":
        pytest.importorskip("llguidance")
    vocab = 49152
    mgr = StructuredOutputManager(backend, tokenizer, vocab, (tokenizer.eos_token_id,), num_threads=1)
    compiled = mgr.request(SO(json=CONTACT_SCHEMA)).result()
    # the default JSON form: xgrammar's separators ", " and ": ", llguidance's none
    text = '{"name": "Ann Lee", "address": "1 A St"' if backend == "xgrammar" else '{"name":"Ann Lee","address":"1 A St"'
    answer = tokenizer.encode(text)
    seq = SimpleNamespace(seq_id=0, output_token_ids=answer[:3], prompt_token_ids=[1], extra={},
                          is_finished=lambda: False)
    drafts = answer[3:9]
    bad = tokenizer.encode("\n")[0]  # a raw newline: allowed neither in a JSON string nor between compact tokens
    n, masks = mgr.draft_masks(seq, compiled, drafts + [bad, answer[9]])
    assert n == len(drafts) and masks.shape[0] == n + 1
    for i in range(n + 1):
        fresh = SimpleNamespace(seq_id=1, output_token_ids=answer[:3 + i], prompt_token_ids=[1], extra={},
                                is_finished=lambda: False)
        want = mgr.fill([(fresh, compiled)]).clone()[0]
        assert torch.equal(masks[i], want), i
    # the sequence's own matcher still stands after its 3 tokens: the same masks again
    again = mgr.draft_masks(seq, compiled, drafts)
    assert again[0] == n and torch.equal(again[1], masks)
    assert seq.extra["grammar"].num_tokens == 3


def test_a_grammar_that_ends_stops_the_drafts(tokenizer):
    mgr = StructuredOutputManager("xgrammar", tokenizer, 49152, (tokenizer.eos_token_id,), num_threads=1)
    compiled = mgr.request(SO(choice=["yes", "no"])).result()
    seq = SimpleNamespace(seq_id=0, output_token_ids=[], prompt_token_ids=[1], extra={}, is_finished=lambda: False)
    yes = tokenizer.encode("yes")
    eos = tokenizer.eos_token_id
    n, masks = mgr.draft_masks(seq, compiled, yes + [eos, eos])
    assert n == len(yes) + 1  # the stop token ends the grammar: nothing after it is drafted
    assert masks.shape[0] == n + 1


@pytest.mark.cuda
def test_cuda_greedy_constrained_outputs_identical_on_off():
    """On CUDA (float32: bf16 verification rounds differently from a decode step): the Triton bitmask kernel masks
    the verification rows; synchronous speculation beside an asynchronous engine's plain steps."""
    prompts = extraction_requests(3, seed=1)
    kw = dict(device="cuda", gpu_memory_utilization=0.3)
    off, _, _ = _run(prompts, _params(temperature=0), **kw)
    on, texts, st = _run(prompts, _params(temperature=0), NGRAM, **kw)
    assert on == off
    for (text,) in texts:
        jsonschema.validate(json.loads(text), CONTACT_SCHEMA)
    assert st["spec_decode_num_accepted_tokens"] > 0
