"""Beam search inside the engine equals Hugging Face transformers' beam search (real model, float32)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.tokenizer import apply_chat_template

MAX_TOKENS = 8
EOS = 2


@pytest.fixture(scope="module")
def llm():
    return LLM(num_gpu_blocks_override=160, block_size=8, max_model_len=512, swap_space=0.02)


@pytest.fixture(autouse=True)
def _all_blocks_free(llm):
    yield
    bm = llm.llm_engine.scheduler.block_manager
    bm.check_invariants()
    assert not llm.llm_engine.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
    assert all(c == 0 for c in bm.gpu_pool.ref_counts) and all(c == 0 for c in bm.cpu_pool.ref_counts)


@pytest.fixture(scope="module")
def beam_prompts(llm) -> list[list[int]]:
    """4 plain continuations (no EOS within MAX_TOKENS) + 4 chat turns that end early with EOS."""
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):\n    ",
             "Once upon a time, in a small village by the sea,", "List three primary colors:"]
    chats = ["What is 2+2? Answer with one number.", "Say hi.", "Name a color.",
             "Is the sky blue? Answer yes or no."]
    return [tok.encode(t) for t in texts] + [
        apply_chat_template(tok, [{"role": "user", "content": c}], True, None) for c in chats
    ]


def _hf_beam(hf_model, prompts, width, length_penalty, early_stopping):
    """HF beam search over the batch (left-padded), as (tokens up to and including EOS, score) lists."""
    b, longest = len(prompts), max(map(len, prompts))
    ids = torch.full((b, longest), EOS)
    mask = torch.zeros((b, longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids, attention_mask=mask, num_beams=width, num_return_sequences=width, do_sample=False,
            max_new_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping,
            pad_token_id=EOS, return_dict_in_generate=True, output_scores=True,
        )
    seqs = out.sequences[:, longest:].view(b, width, -1).tolist()
    scores = out.sequences_scores.view(b, width).tolist()
    result = []
    for i in range(b):
        beams = []
        for j in range(width):
            s = seqs[i][j]
            beams.append((s[: s.index(EOS) + 1] if EOS in s else s, scores[i][j]))
        result.append(beams)
    return result


@pytest.mark.slow
@pytest.mark.parametrize(
    "width,length_penalty,early_stopping",
    [(2, 1.0, False), (4, 1.0, False), (2, 2.0, "never"), (4, 0.5, True)],
)
def test_beam_search_matches_hf(llm, hf_model, beam_prompts, width, length_penalty, early_stopping):
    ref = _hf_beam(hf_model, beam_prompts, width, length_penalty, early_stopping)
    params = SamplingParams(use_beam_search=True, best_of=width, n=width, temperature=0.0, max_tokens=MAX_TOKENS,
                            length_penalty=length_penalty, early_stopping=early_stopping)
    outs = llm.generate([{"prompt_token_ids": p} for p in beam_prompts], params, use_tqdm=False)
    eos_finished = 0
    for i, (out, hf) in enumerate(zip(outs, ref)):
        ours = [c.token_ids for c in out.outputs]
        assert ours == [t for t, _ in hf], f"prompt {i}: pagedllm {ours} != hf {[t for t, _ in hf]}"
        for c, (_, hf_score) in zip(out.outputs, hf):
            assert c.cumulative_logprob / len(c.token_ids) ** length_penalty == pytest.approx(hf_score, abs=2e-3)
            assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS else "length")
            eos_finished += c.token_ids[-1] == EOS
        assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=True)
    # The workload exercises both ways a hypothesis ends, so length_penalty matters.
    assert 0 < eos_finished < len(beam_prompts) * width


def test_beam_search_api_and_block_sharing(llm, beam_prompts):
    """LLM.beam_search equals the SamplingParams route; beams share blocks and copy on write."""
    prompt = beam_prompts[2]  # 15 tokens: the last block is partly filled, so the first forks must CoW
    engine = llm.llm_engine
    before = llm.stats()
    engine.add_request("b", {"prompt_token_ids": prompt},
                       SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0.0, max_tokens=6))
    engine.step()  # prefill + first beam step: 4 beams forked from one prompt
    s = llm.stats()
    n_prompt_blocks = -(-len(prompt) // 8)
    assert s["kv_blocks_shared"] == n_prompt_blocks
    assert s["kv_blocks_saved_by_sharing"] == 3 * n_prompt_blocks
    group = engine.scheduler.running[0]
    assert len(group.seqs) == 4 and len({len(x.output_token_ids) for x in group.seqs}) == 1
    engine.step()
    assert llm.stats()["num_cow_copies"] - before["num_cow_copies"] >= 3
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and len(final.outputs) == 2
    via_api = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=4, max_tokens=6))[0]
    assert [s.tokens[len(prompt):] for s in via_api.sequences[:2]] == [c.token_ids for c in final.outputs]
    assert len(via_api.sequences) == 4
    scores = [s.score for s in via_api.sequences]
    assert scores == sorted(scores, reverse=True)


def test_beam_search_rejects_bad_params(llm):
    with pytest.raises(ValueError, match="temperature"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7))
    with pytest.raises(ValueError, match="penalties"):
        llm.generate("hi", SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, presence_penalty=0.5))
    with pytest.raises(ValueError, match="best_of"):
        llm.generate("hi", SamplingParams(use_beam_search=True, best_of=1000, temperature=0.0))


@pytest.mark.parametrize("include", [False, True])
def test_beam_search_stops_beams_at_stop_strings(llm, include):
    """A beam whose text reaches a stop string becomes a finished hypothesis (vLLM semantics: the text
    ends before the stop string unless include_stop_str_in_output)."""
    tok = llm.get_tokenizer()
    params = SamplingParams(use_beam_search=True, best_of=3, n=3, temperature=0.0, max_tokens=24, stop=[","],
                            include_stop_str_in_output=include)
    outs = llm.generate(["List three primary colors:", "The capital of France is"], params, use_tqdm=False)
    colors, capital = outs
    for c in colors.outputs:
        assert c.finish_reason == "stop" and c.stop_reason == ","
        full = tok.decode(c.token_ids)
        assert "," in full and len(c.token_ids) < 24
        assert c.text == (full[: full.index(",") + 1] if include else full[: full.index(",")])
    # Beams that never produce the stop string run to the length limit, untouched.
    assert all(c.finish_reason == "length" and "," not in c.text for c in capital.outputs)


def test_beam_search_logprobs_are_vllm_records(llm, beam_prompts):
    """With `logprobs`, each beam position holds the chosen token's Logprob (its rank in the whole vocabulary)
    and the top tokens ranked 1, 2; the chosen log-probs add up to the beam's cumulative log-prob."""
    out = llm.generate([{"prompt_token_ids": beam_prompts[0]}],
                       SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=5, logprobs=2),
                       use_tqdm=False)[0]
    text = llm.get_tokenizer().decode
    for comp in out.outputs:
        assert len(comp.logprobs) == len(comp.token_ids)
        for tok, entries in zip(comp.token_ids, comp.logprobs):
            chosen, others = entries[tok], [e for t, e in entries.items() if t != tok]
            assert next(iter(entries)) == tok and chosen.rank >= 1
            assert [e.rank for e in others] == [r for r in (1, 2) if r != chosen.rank]
            assert all(e.logprob >= chosen.logprob for e in others if e.rank < chosen.rank)
            assert all(e.decoded_token == text([t]) for t, e in entries.items())
        total = sum(entries[tok].logprob for tok, entries in zip(comp.token_ids, comp.logprobs))
        assert total == pytest.approx(comp.cumulative_logprob, abs=1e-3)
