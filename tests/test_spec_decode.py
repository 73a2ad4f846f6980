"""Speculative decoding: proposers, the rejection sampler's distribution, and exact engine outputs."""
from __future__ import annotations

import numpy as np
import random

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from pagedllm import LLM, SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.model.layers.sampler import SamplingRow
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.rejection_sampler import processed_logits, verify

# "fixed": every proposed token is verified, so the mechanics below (rollback, preemption, CoW) are exercised
# whatever the machine's timing; the default goodput policy is tested with the GGUF default below and in
# test_spec_draft_length.py.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "draft_length_policy": "fixed"}
# float32 everywhere (CPU's default already): exactness is a property of the algorithm, checked without
# bf16 rounding. In bf16 on CUDA the verification pass (k+1 query tokens per sequence, other GEMM shapes
# and attention kernels) rounds differently from a decode step, so near-tie argmaxes can flip and greedy
# outputs on/off may differ (measured: BENCHMARKS.md, spec-decode section of the gpu-fix session).
F32 = "float32"
DRAFT = {"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 20, "draft_length_policy": "fixed"}


# -- proposer and config -------------------------------------------------------------------------
def test_ngram_proposes_continuation_of_latest_match():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]
    assert p.propose([1, 2, 3, 7, 2, 3, 8, 9, 2, 3]) == [8, 9, 2]  # the latest earlier match
    assert p.propose([5, 6, 7]) == []  # nothing recurs
    assert p.propose([1, 2, 1], k=1) == [2]


def _brute_force_ngram(tokens: list[int], k: int, nmin: int, nmax: int) -> list[int]:
    """The proposer's rule, written out: longest suffix first, latest earlier match with k tokens after it,
    else the latest match."""
    for n in range(min(nmax, len(tokens) - 1), nmin - 1, -1):
        suffix = tokens[len(tokens) - n:]
        hits = [s for s in range(len(tokens) - n) if tokens[s: s + n] == suffix]
        if hits:
            full = [s for s in hits if s + n + k <= len(tokens)]
            start = (full or hits)[-1] + n
            return tokens[start: start + k]
    return []


def test_ngram_byte_search_equals_the_rule_on_random_sequences():
    """The byte search (token-boundary hits only) against a brute-force reference: small vocabularies
    (many overlapping and misaligned byte matches), large ids, planted repeats, every k and n range."""
    rng = random.Random(7)
    for _ in range(1500):
        vocab = rng.choice([2, 3, 7, 300, 70_000, 2**31 - 1])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 90))]
        if tokens and rng.random() < 0.5:
            s = rng.randrange(len(tokens))
            tokens += tokens[s: s + rng.randint(1, 8)]
        nmin = rng.randint(1, 3)
        nmax = rng.randint(nmin, 5)
        k = rng.randint(0, 6)
        assert NgramProposer(4, nmin, nmax).propose(tokens, k) == _brute_force_ngram(tokens, k, nmin, nmax)


def test_speculative_config_errors():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="unknown speculative_config"):
        SpeculativeConfig.from_json('{"method": "ngram", "k": 3}')
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=2)


def test_prompt_lookup_bounds_default_as_in_vllm():
    """A bound left out equals the one given; with neither, both are 5 (vLLM's SpeculativeConfig)."""
    def bounds(**kw):
        c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 4, **kw})
        return c.prompt_lookup_min, c.prompt_lookup_max

    assert bounds(prompt_lookup_max=4) == (4, 4)
    assert bounds(prompt_lookup_min=2) == (2, 2)
    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_min=1, prompt_lookup_max=3) == (1, 3)
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 2}').num_speculative_tokens == 2


# -- the rejection sampler: output distribution equals the target's ------------------------------
@pytest.mark.parametrize("top_p,random_q", [(1.0, False), (0.8, False), (1.0, True)])
def test_rejection_sampler_distribution_chi_square(top_p, random_q):
    """20 000 verifications of 2 drafts on a 6-token vocabulary, temperature 1: the first emitted token
    follows the target's (top-p processed) distribution, and so does the second once the first draft is
    accepted; with a one-hot q (the proposers here) and with a random q the drafts are drawn from."""
    g = torch.Generator().manual_seed(1234)
    vocab, k, draws = 6, 2, 20_000
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=1.0, top_p=top_p)
    drafts = [int(logits[0].argmax()), 3]
    rows = [SamplingRow(params, [0], drafts[:i]) for i in range(k + 1)]
    p = processed_logits(logits, rows).softmax(-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1) if random_q else None
    first = np.zeros(vocab, dtype=np.int64)
    second = np.zeros(vocab, dtype=np.int64)  # given the first draft was emitted
    for _ in range(draws):
        if q is not None:  # drafts are drawn from q
            drafts = torch.multinomial(q, 1, generator=g).flatten().tolist()
        res = verify(logits, rows, drafts, q, generator=g)
        first[res.token_ids[0]] += 1
        if len(res.token_ids) > 1:  # the first draft was accepted: the second token is drawn afresh
            second[res.token_ids[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        probs = probs.double().numpy()
        keep = probs > 0
        assert counts[~keep].sum() == 0  # nothing outside top-p
        expected = probs[keep] / probs[keep].sum() * counts.sum()
        assert chisquare(counts[keep], expected).pvalue > 0.01


@pytest.mark.parametrize("make_generator", [lambda s: random.Random(s), lambda s: torch.Generator().manual_seed(s)],
                         ids=["random.Random", "torch.Generator"])
def test_one_hot_drafts_emit_what_plain_sampling_would(make_generator):
    """With deterministic drafts, verification emits the tokens that plain decoding samples from the same rows with
    the same seed, and leaves the generator where plain decoding would: one uniform per emitted token. Drafts that
    match the plain samples for 0..k positions, and a wrong draft after them."""
    from pagedllm.model.layers.sampler import Sampler

    sampler = Sampler(batch_invariant=True)  # the torch ops: what a seeded row takes under VLLM_BATCH_INVARIANT=1
    g = torch.Generator().manual_seed(3)
    vocab, k = 300, 4
    params = SamplingParams(temperature=0.8, top_p=0.95)
    for trial in range(12):
        logits = torch.randn(k + 1, vocab, generator=g) * 2

        def plain(gen, upto):  # tokens sampled one step at a time, as decoding without speculation samples them
            out = []
            for i in range(upto):
                row = SamplingRow(params, [0], list(out), gen)
                out.append(sampler.launch(logits[i:i + 1].clone(), [row]).result()[0][0].token_ids[0])
            return out

        want_all = plain(make_generator(trial), k + 1)
        matched = trial % (k + 1)  # drafts right for this many positions, then one wrong (unless all k match)
        drafts = want_all[:matched] + [(t + 1) % vocab for t in want_all[matched:k]]
        gen = make_generator(trial)
        rows = [SamplingRow(params, [0], drafts[:i]) for i in range(k + 1)]
        res = verify(logits, rows, drafts, generator=gen)
        assert res.num_accepted == matched
        assert res.token_ids == want_all[:matched + 1]
        ref = make_generator(trial)
        plain(ref, matched + 1)
        if isinstance(gen, random.Random):
            assert gen.getstate() == ref.getstate()
        else:
            assert torch.equal(gen.get_state(), ref.get_state())


def test_rejection_sampler_greedy_is_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    rows = [SamplingRow(SamplingParams(temperature=0), [0], [])] * 3
    assert verify(logits, rows, [1, 0]).token_ids == [1, 0, 2]  # both accepted + bonus
    assert verify(logits, rows, [1, 2]).token_ids == [1, 0]  # second rejected, replaced by argmax
    assert verify(logits, rows, [2, 0]).num_accepted == 0


# -- the engine: exact greedy outputs --------------------------------------------------------------
def _prompts(tokenizer) -> list[list[int]]:
    texts = [
        "Copy the list exactly: apples, pears, plums, figs, dates, limes, kiwis. Copy: apples, pears,",
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
    ]
    return [tokenizer.encode(t) for t in texts]


def _run(prompts, params, **kw):
    llm = LLM(max_model_len=256, dtype=F32, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eng = llm.llm_engine
    bm = eng.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks  # nothing leaked
    bm.check_invariants()
    return [[list(c.token_ids) for c in o.outputs] for o in outs], eng.stats()


@pytest.fixture(scope="module")
def reference(tokenizer):
    prompts = _prompts(tokenizer)
    outs, _ = _run(prompts, SamplingParams(temperature=0, max_tokens=20), num_gpu_blocks_override=64)
    return prompts, outs


def test_requests_with_logit_adjustments_do_not_speculate(tokenizer, reference):
    """A logit_bias / allowed_token_ids request is served beside speculating ones without drafts of its own (the
    rejection sampler does not apply them): the plain requests keep plain decoding's tokens, and every token of the
    adjusted request obeys its bias."""
    prompts, want = reference
    banned = want[0][0][0]
    params = [SamplingParams(temperature=0, max_tokens=20)] * 2 + [
        SamplingParams(temperature=0, max_tokens=20, logit_bias={banned: -100.0})]
    outs, st = _run([prompts[1], prompts[2], prompts[0]], params, num_gpu_blocks_override=64,
                    speculative_config=NGRAM)
    assert outs[:2] == [want[1], want[2]]
    assert banned not in outs[2][0]
    assert st["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_greedy_identical_on_off(reference, spec):
    prompts, ref = reference
    outs, st = _run(prompts, SamplingParams(temperature=0, max_tokens=20), num_gpu_blocks_override=64,
                    speculative_config=spec)
    assert outs == ref
    assert st["spec_decode_num_draft_tokens"] > 0
    if spec is NGRAM:
        assert st["spec_decode_num_accepted_tokens"] > 0


def test_long_drafts_keep_verification_on_the_attention_token_path(reference):
    """The CPU attention kernel's tile path (chunks of 32+ tokens) computes in another order than a decode: with
    up to 40 drafts a verification chunk is 41 tokens, so the engine raises the tile threshold above it and
    greedy outputs stay identical."""
    prompts, ref = reference
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=64,
              speculative_config={**NGRAM, "num_speculative_tokens": 40})
    backend = llm.llm_engine.executor.driver_worker.model_runner.attn_backend
    if backend.name == "cpu-native":  # the CUDA and plain-torch backends have no tile path
        assert backend.min_tile_query_len == 42
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == ref


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identical_under_preemption(reference, mode):
    """6 blocks of 16 tokens for three ~25-token prompts growing by 20: sequences get preempted."""
    prompts, ref = reference
    outs, st = _run(prompts, SamplingParams(temperature=0, max_tokens=20), num_gpu_blocks_override=6,
                    preemption_mode=mode, speculative_config=NGRAM)
    assert st["num_preemptions"] > 0
    assert st["spec_decode_num_accepted_tokens"] > 0
    assert outs == ref


def test_greedy_identical_with_prefix_caching_and_n2(reference):
    """Prefix caching on, each prompt twice, and n=2 (top_k=1: both samples are the greedy path)."""
    prompts, ref = reference
    llm = LLM(max_model_len=256, num_gpu_blocks_override=64, enable_prefix_caching=True, block_size=8,
              speculative_config=NGRAM, dtype=F32)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20),
                            use_tqdm=False)
        assert [[list(c.token_ids) for c in o.outputs] for o in outs] == ref
    st = llm.stats()
    assert st["prefix_cache_hits"] > 0 and st["spec_decode_num_accepted_tokens"] > 0
    outs = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=20),
                        use_tqdm=False)
    assert [list(c.token_ids) for c in outs[0].outputs] == [ref[0][0]] * 2
    bm = llm.llm_engine.scheduler.block_manager
    bm.check_invariants()
    # Every block still referenced is a cached, freed one: no sequence holds any.
    assert not bm.block_tables


NGRAM_GPU = {"method": "ngram_gpu", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _device_loop(llm):
    return llm.llm_engine.device_spec


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_device_ngram_greedy_identical_and_overlapped(reference, async_scheduling):
    """`ngram_gpu`: proposal, verification and acceptance on the device, read one step late; same tokens. With
    asynchronous scheduling (as on CUDA) the mode is entered from the prompt step still in flight: the first
    token is copied into the device's history there, before the host has seen it."""
    prompts, ref = reference
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=64, speculative_config=NGRAM_GPU,
              async_scheduling=async_scheduling)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == ref
    st = llm.stats()
    assert st["spec_decode_num_accepted_tokens"] > 0 and st["spec_decode_num_device_steps"] > 0
    assert st["spec_decode_num_device_entries"] >= 1
    assert (_device_loop(llm).num_entries_in_flight > 0) == async_scheduling
    # The copying prompt alone: its 19 tokens after the first in far fewer steps (accepted on the device).
    loop = _device_loop(llm)
    before = loop.num_steps
    out = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=20),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ref[0][0]
    assert loop.num_steps - before <= 12
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
    bm.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_device_ngram_leaves_and_rejoins_around_other_requests(reference, async_scheduling):
    """A sampled request and a late greedy one make the engine drain the mode and run ordinary steps; greedy
    outputs stay exact with prefix caching on, and no block leaks."""
    prompts, ref = reference
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=64, enable_prefix_caching=True,
              speculative_config=NGRAM_GPU, async_scheduling=async_scheduling)
    eng = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=20)
    eng.add_request("g0", {"prompt_token_ids": prompts[0]}, greedy)
    eng.add_request("g1", {"prompt_token_ids": prompts[1]}, greedy)
    outputs = {}
    while _device_loop(llm).num_steps < 2:
        for o in eng.step():
            outputs[o.request_id] = o
    entries = _device_loop(llm).num_entries
    eng.add_request("s", {"prompt_token_ids": prompts[2]}, SamplingParams(temperature=1.0, seed=1, max_tokens=6))
    eng.add_request("g2", {"prompt_token_ids": prompts[2]}, greedy)
    while eng.has_unfinished_requests():
        for o in eng.step():
            outputs[o.request_id] = o
    assert [list(outputs[f"g{i}"].outputs[0].token_ids) for i in range(3)] == [r[0] for r in ref]
    assert len(outputs["s"].outputs[0].token_ids) == 6
    assert _device_loop(llm).num_entries > entries  # it came back once the sampled request finished
    bm = eng.scheduler.block_manager
    bm.check_invariants()
    assert not bm.block_tables


def test_device_ngram_admits_prompts_without_draining(reference):
    """Closed loop at two concurrent, greedy only: each new request's prompt runs as its own step while the mode
    keeps running the others, and joins from that step in flight. Same tokens; no block held afterwards."""
    from pagedllm.benchmarks.spec_decode import run_closed_loop

    prompts, ref = reference
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=64, speculative_config=NGRAM_GPU,
              async_scheduling=True)
    eng, loop = llm.llm_engine, _device_loop(llm)
    eng.spec_decoder.mode = None  # always speculate where the mode applies (no timing-based chooser)
    order = [0, 1, 2, 1, 0, 2]
    _, outs = run_closed_loop(eng, [prompts[i] for i in order], [SamplingParams(temperature=0, max_tokens=20)] * 6,
                              2, "adm")
    assert outs == [ref[i][0] for i in order]
    assert loop.num_admissions >= 3 and loop.num_entries < loop.num_admissions
    bm = eng.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
    bm.check_invariants()


def test_device_ngram_gives_way_when_the_pool_is_short(tokenizer):
    """Twelve blocks of 8 tokens hold two ~30-token prompts growing by 20, but not with 2 (k + 1) = 18 tokens of
    look-ahead each: the engine falls back to ordinary steps (no livelock), and the outputs are unchanged."""
    prompts = _prompts(tokenizer)[:2]
    params = SamplingParams(temperature=0, max_tokens=20)
    ref, _ = _run(prompts, params, num_gpu_blocks_override=64, block_size=8)  # (block size changes float sums)
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=12, block_size=8,
              speculative_config={**NGRAM_GPU, "num_speculative_tokens": 8}, async_scheduling=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == ref
    assert _device_loop(llm).num_pool_fallbacks > 0
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks


def test_device_ngram_needs_one_process():
    with pytest.raises(ValueError, match="ngram_gpu.*single-process"):
        LLM(max_model_len=256, dtype=F32, tensor_parallel_size=2, speculative_config=NGRAM_GPU)


def test_device_ngram_up_to_the_model_length(tokenizer):
    """Rows past max_model_len (the last k steps of a sequence that runs to the limit) write no KV and emit nothing."""
    prompt = _prompts(tokenizer)[0]
    params = SamplingParams(temperature=0, max_tokens=None)
    outs = []
    for spec in (None, {**NGRAM_GPU, "num_speculative_tokens": 8}):
        llm = LLM(max_model_len=48, dtype=F32, num_gpu_blocks_override=16, speculative_config=spec)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        outs.append((list(out.token_ids), out.finish_reason))
    assert outs[0] == outs[1] and len(prompt) + len(outs[0][0]) == 48
    assert _device_loop(llm).num_steps > 0


def _abort_mid_run(llm, prompts, started) -> None:
    """Queue every prompt (greedy, 40 tokens), step until `started()`, abort them all, run out: no block held."""
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=40))
    while not started():
        eng.step()
    eng.abort_request([str(i) for i in range(len(prompts))])
    while eng.has_unfinished_requests():
        eng.step()
    bm = eng.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
    bm.check_invariants()


def test_device_ngram_abort_and_stop_strings(reference, tokenizer):
    prompts, ref = reference
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=64, speculative_config=NGRAM_GPU,
              async_scheduling=True)  # (as on CUDA: entries from a step in flight, drains without a wait)
    _abort_mid_run(llm, prompts, lambda: _device_loop(llm).num_steps >= 2)
    bm = llm.llm_engine.scheduler.block_manager
    # A stop string inside an accepted draft ends the output where it would without speculation.
    stop = tokenizer.decode(ref[0][0][8:10])
    params = SamplingParams(temperature=0, max_tokens=20, stop=[stop])
    out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert tokenizer.decode(ref[0][0]).startswith(out.text)
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks


@pytest.mark.slow
def test_beam_search_unaffected(reference):
    prompts, _ = reference
    params = SamplingParams(use_beam_search=True, best_of=2, temperature=0, max_tokens=8)
    off, _ = _run(prompts[:1], params, num_gpu_blocks_override=64)
    on, st = _run(prompts[:1], params, num_gpu_blocks_override=64, speculative_config=NGRAM)
    assert on == off and st["spec_decode_num_drafts"] == 0  # beams never speculate


def test_abort_mid_speculation_frees_blocks(reference):
    prompts, _ = reference
    llm = LLM(max_model_len=256, num_gpu_blocks_override=64, speculative_config=NGRAM, dtype=F32)
    _abort_mid_run(llm, prompts, lambda: llm.llm_engine.stats()["spec_decode_num_drafts"] > 0)


@pytest.mark.slow
def test_off_for_large_batches(reference):
    prompts, ref = reference
    outs, st = _run(prompts, SamplingParams(temperature=0, max_tokens=20), num_gpu_blocks_override=64,
                    speculative_config={**NGRAM, "disable_by_batch_size": 2})
    assert outs == ref
    assert st["spec_decode_num_steps_off_by_batch"] > 0


# -- the engine: sampled outputs keep their distribution (small random model) ----------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    for p in hf.parameters():
        p.data.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny_spec")
    hf.save_pretrained(path)
    return str(path)


def test_engine_sampling_distribution_on_off(tiny_model):
    """1 500 requests of 4 tokens at temperature 1 on a random 8-token model with a repetitive prompt (the
    n-gram proposer always proposes): the 2nd..4th tokens' joint counts match speculation off (chi-square
    test of homogeneity on the 3rd token and on the 4th)."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    counts = {}
    for name, spec in (("off", None), ("on", {**NGRAM, "disable_by_batch_size": 4096})):
        llm = LLM(model=tiny_model, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=2048,
                  block_size=4, max_num_seqs=512, speculative_config=spec, seed=7, dtype=F32)
        outs = llm.generate([{"prompt_token_ids": prompt}] * 1500, params, use_tqdm=False)
        toks = np.array([o.outputs[0].token_ids for o in outs])
        counts[name] = [np.bincount(toks[:, j], minlength=8) for j in (2, 3)]
        if spec:
            assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(counts["off"], counts["on"]):
        table = np.stack([a, b])
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > 0.01


def test_metrics_render_spec_decode():
    from pagedllm.engine.metrics import EngineMetrics
    from pagedllm.spec_decode.metrics import SpecDecodeStats

    st = SpecDecodeStats(3)
    st.record(3, 2)
    st.record(2, 0)
    d = st.as_dict()
    assert d["spec_decode_num_draft_tokens"] == 5 and d["spec_decode_num_accepted_tokens"] == 2
    assert d["spec_decode_acceptance_rate_pos_0"] == 0.5 and d["spec_decode_acceptance_rate_pos_2"] == 0.0
    text = EngineMetrics("m", lambda: d).render().decode()
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_acceptance_rate_per_pos{model_name="m",position="1"} 0.5' in text


def test_penalties_min_tokens_logprobs_keep_meaning(reference):
    """Greedy with a repetition penalty, min_tokens and top-2 logprobs: the same tokens and logprobs on/off
    (verification applies the penalty over the history including the accepted drafts)."""
    prompts, _ = reference
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.05, min_tokens=4, logprobs=2)
    res = {}
    for name, spec in (("off", None), ("on", NGRAM)):
        llm = LLM(max_model_len=256, num_gpu_blocks_override=64, speculative_config=spec, dtype=F32)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        res[name] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        if spec:
            assert llm.stats()["spec_decode_num_drafts"] > 0
    for (t_off, lp_off), (t_on, lp_on) in zip(res["off"], res["on"]):
        assert t_on == t_off
        for a, b in zip(lp_off, lp_on):
            assert set(a) == set(b)
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < 1e-3
                assert a[tok].rank == b[tok].rank and a[tok].decoded_token == b[tok].decoded_token


def test_greedy_identical_on_off_with_gguf_quantized_weights(tokenizer, monkeypatch):
    """The CPU default serves the bundled GGUF quantized. A verification step has k+1 rows per sequence where a
    decode step has one; the GEMM gives a row the same bits in any batch (kernels/cpu_quant.py), so the default
    engine's greedy output is the same with speculation on and off, with no design pinned."""
    from pagedllm.benchmarks.copy_prompts import make_copy_prompts

    monkeypatch.delenv("PAGEDLLM_QUANT_GEMM", raising=False)
    prompts = make_copy_prompts(tokenizer, 6)
    params = SamplingParams(temperature=0, max_tokens=48)
    outs = {}
    for spec in (None, {**NGRAM, "draft_length_policy": "goodput"}):
        llm = LLM(max_model_len=1024, quantization="gguf", num_gpu_blocks_override=256, max_num_seqs=4,
                  speculative_config=spec, device="cpu")  # GGUF blocks are served on the CPU only
        weights = [m.gguf_weight for m in llm.llm_engine.executor.driver_worker.model.modules()
                   if getattr(m, "gguf_weight", None) is not None]
        assert weights and {w.gemm_method for w in weights} == {"auto"}
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[spec is not None] = [list(o.outputs[0].token_ids) for o in res]
        if spec:
            assert llm.llm_engine.stats()["spec_decode_num_accepted_tokens"] > 0
            # the goodput policy (the default) timed decode steps of several sizes: plain and verifying
            assert len(llm.llm_engine.spec_decoder.step_cost.times) >= 2
    assert outs[True] == outs[False]


def test_benchmark_slices_keep_their_concurrency():
    """The on/off benchmark's interleaved slices hold at least 2 × concurrency prompts where there are enough."""
    from pagedllm.benchmarks.spec_decode import slice_rounds

    assert slice_rounds(100, 4, 5) == 5
    assert slice_rounds(10, 4, 3) == 1  # 3 slices of 3-4 prompts would mostly run fewer than 4 sequences
    assert slice_rounds(24, 4, 3) == 3
    assert slice_rounds(10, 1, 3) == 3
    assert slice_rounds(1, 64, 5) == 1


def test_benchmark_reports_each_rounds_ratio():
    from pagedllm.benchmarks.spec_decode import _spread, round_ratios

    result = {"off": {"round_tok_s": [100.0, 200.0, 50.0]}, "on": {"round_tok_s": [150.0, 190.0, 60.0]}}
    assert round_ratios(result) == pytest.approx([1.5, 0.95, 1.2])
    assert _spread([1.5, 0.95, 1.2]) == "0.95-1.50 (median 1.20, 3 rounds)"


def test_benchmark_reports_how_many_outputs_batching_alone_changes(capsys):
    """The off engine's outputs at each later concurrency are held against the first: the agreement that batching
    alone leaves, next to the on/off `identical` count."""
    from pagedllm.benchmarks.spec_decode import print_batching_reference

    copy = {"1": {}, "4": {}, "8": {}}
    outputs = {"copy1": {"off": [[1, 2], [3], [4, 5]]}, "copy4": {"off": [[1, 2], [3, 9], [4, 5]]},
               "copy8": {"off": [[1, 2], [3], [4, 5]]}}
    print_batching_reference(copy, outputs)
    assert copy["4"]["identical_off_vs_concurrency_1"] == "2/3"
    assert copy["8"]["identical_off_vs_concurrency_1"] == "3/3"
    assert "identical_off_vs_concurrency_1" not in copy["1"]
    assert "4 vs 1 concurrent (batching alone): 2/3 identical" in capsys.readouterr().out
