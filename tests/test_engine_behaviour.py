"""Sampling semantics and bad input on the real bundled model."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_gpu_blocks_override=256, max_model_len=1024)


@pytest.fixture(autouse=True)
def _no_leaks(llm):
    yield
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"], "KV blocks leaked"
    llm.llm_engine.scheduler.block_manager.check_invariants()


PROMPTS = ["Once upon a time", "The best way to learn a language is", "My favourite food is"]


def _texts(outs):
    return [o.outputs[0].text for o in outs]


def test_seeded_sampling_reproduces_and_differs_by_seed(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234)
    a = llm.generate(PROMPTS, p, use_tqdm=False)
    # Same seeds in a different batch composition give the same tokens.
    b = llm.generate(PROMPTS[::-1] + ["unrelated filler prompt"], p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b[:3][::-1]]
    c = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=99), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, seed=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_stop_string_ends_output_and_is_excluded(llm):
    base = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    full = base[0].outputs[0].text
    assert "Paris" in full
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert out.text == full[: full.index("Paris")]
    inc = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32, stop=["Paris"],
                       include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert inc.text == full[: full.index("Paris") + len("Paris")]


def test_stop_token_ids(llm):
    base = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # As vLLM: the stop token is in token_ids, its text only with include_stop_str_in_output.
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(base.token_ids[:first])
    inc = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_tok],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert inc.text == tok.decode(base.token_ids[: first + 1]) != out.text


def test_eos_text_is_not_in_the_output_even_with_special_tokens_kept(llm):
    p = "What is the capital of France?"  # the instruct model ends this raw prompt with <|im_end|> (EOS) at once
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, skip_special_tokens=False),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [2] and out.finish_reason == "stop" and out.text == ""
    inc = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, skip_special_tokens=False,
                                           include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert inc.text == "<|im_end|>"


def test_eos_min_tokens_and_ignore_eos(llm):
    # This raw prompt makes the instruct model emit <|im_end|> (EOS) at once.
    p = "What is the capital of France?"
    eos = llm.generate([p], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert eos.finish_reason == "stop" and len(eos.token_ids) == 1
    mt = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(mt.token_ids) >= 5 and 2 not in mt.token_ids[:5]
    ig = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(ig.token_ids) == 10 and ig.finish_reason == "length"


def test_logit_bias_and_allowed_token_ids(llm):
    """OpenAI's logit_bias and vLLM's allowed_token_ids on the bundled model: +100 forces a token, -100 bans the
    greedy one, allowed_token_ids bounds every sample; a plain request in the same batch keeps its tokens."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(PROMPTS, greedy, use_tqdm=False)
    first = plain[0].outputs[0].token_ids[0]
    forced = tok.encode(" banana")[0]
    allowed = [tok.encode(w)[0] for w in (" yes", " no", " maybe")]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={first: -100.0}),
              SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
              greedy]
    outs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [forced] * 6
    assert outs[1].outputs[0].token_ids[0] != first
    assert all(set(c.token_ids) <= set(allowed) for c in outs[2].outputs)
    assert outs[3].outputs[0].token_ids == plain[2].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, "):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**9: 1.0}), use_tqdm=False)


def test_bad_words_never_appear(llm):
    """vLLM's bad_words on the bundled model: words of the plain greedy output, one and several tokens long, never
    appear once banned (as the text starts or after a space), and the rest of the batch is unchanged."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(PROMPTS, greedy, use_tqdm=False)
    words = plain[0].outputs[0].text.split()[:3]
    banned = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=words)
    outs = llm.generate(PROMPTS[:2], [banned, greedy], use_tqdm=False)
    ids = outs[0].outputs[0].token_ids
    for w in words:
        for form in (w, " " + w):
            seq = tok.encode(form, add_special_tokens=False)
            assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (form, outs[0].outputs[0].text)
    assert outs[0].outputs[0].text != plain[0].outputs[0].text
    assert outs[1].outputs[0].token_ids == plain[1].outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: the request runs on the prompt's last k tokens, exactly as a prompt of just
    those tokens; -1 keeps as many as fit; a k that could never fit, or below -1 / 0, is a clear error."""
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    greedy = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    cut = llm.generate(PROMPTS[1], SamplingParams(truncate_prompt_tokens=4, **greedy), use_tqdm=False)[0]
    alone = llm.generate({"prompt_token_ids": ids[-4:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-4:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    long = (ids * 200)[:1500]  # longer than max_model_len 1024
    out = llm.generate({"prompt_token_ids": long}, SamplingParams(truncate_prompt_tokens=-1, **greedy),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-1023:] and len(out.outputs[0].token_ids) == 1  # one slot left
    with pytest.raises(ValueError, match="truncate_prompt_tokens=5000 exceeds the longest prompt"):
        llm.generate(PROMPTS[1], SamplingParams(truncate_prompt_tokens=5000), use_tqdm=False)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be at least 1, or -1"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_logprobs_and_prompt_logprobs(llm):
    out = llm.generate(["The sky is"], SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    tok_text = llm.get_tokenizer().decode
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        # vLLM's Logprob records: greedy picks the most likely token, rank 1; the top 3 rank 1, 2, 3 in order;
        # each carries its token's text.
        assert tok in lp and lp[tok].logprob == max(e.logprob for e in lp.values()) and lp[tok].rank == 1
        assert [e.rank for e in lp.values()] == [1, 2, 3]
        assert all(e.decoded_token == tok_text([t]) for t, e in lp.items())
    assert abs(sum(comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids)) - comp.cumulative_logprob) < 1e-4
    assert out.prompt_logprobs[0] is None and all(d is not None for d in out.prompt_logprobs[1:])
    ids = out.prompt_token_ids
    for pos, d in enumerate(out.prompt_logprobs[1:], 1):  # the prompt token with its own rank, then the top 2
        actual, others = d[ids[pos]], [e for t, e in d.items() if t != ids[pos]]
        assert actual.rank >= 1 + sum(e.logprob > actual.logprob for e in others)
        assert [e.rank for e in others] == [r for r in (1, 2) if r != actual.rank]
        assert actual.decoded_token == tok_text([ids[pos]])
    for field in ("logprobs", "prompt_logprobs"):  # vLLM's --max-logprobs, 20 by default
        with pytest.raises(ValueError, match=f"{field}=21 is more than this engine returns per token: at most 20"):
            llm.generate(["The sky is"], SamplingParams(max_tokens=2, **{field: 21}), use_tqdm=False)


def test_max_logprobs_sets_the_cap_or_lifts_it(tmp_path):
    from tiny_models import save_tiny_llama

    kw = dict(model=save_tiny_llama(tmp_path), skip_tokenizer_init=True, num_gpu_blocks_override=32, max_model_len=64)
    with pytest.raises(ValueError, match="at most 2"):
        LLM(**kw, max_logprobs=2).generate({"prompt_token_ids": [3, 4]}, SamplingParams(logprobs=3), use_tqdm=False)
    out = LLM(**kw, max_logprobs=-1).generate({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2, logprobs=100),
                                              use_tqdm=False)[0].outputs[0]
    assert all(len(d) >= 100 for d in out.logprobs)
    with pytest.raises(ValueError, match="max_logprobs must be an int >= 0, or -1"):
        LLM(**kw, max_logprobs=-2)


def test_parallel_sampling_n(llm):
    out = llm.generate(["Write a word:"], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert llm.get_tokenizer().decode(out.prompt_token_ids).startswith("<|im_start|>system")


def test_chat_continues_the_final_message_and_passes_template_kwargs(llm):
    """vLLM's LLM.chat options: continue_final_message ends the prompt inside the assistant's message (its greedy
    tokens are those of generate on that prompt); chat_template_kwargs are template variables."""
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour I pick is"}]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.chat(conv, greedy, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\nThe colour I pick is")
    again = llm.generate({"prompt_token_ids": out.prompt_token_ids}, greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == again.outputs[0].token_ids
    template = "{{ greeting }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(conv[:1], greedy, use_tqdm=False, chat_template=template, chat_template_kwargs={"greeting": "hi"})
    assert tok.decode(out[0].prompt_token_ids) == "hi:Name a colour."
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{{ messages[0]['content'] }}"
    out = llm.chat(conv[:1], greedy, use_tqdm=False, chat_template=with_tools, tools=tools)
    assert tok.decode(out[0].prompt_token_ids) == "[get_weather]Name a colour."
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(conv, greedy, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        llm.chat(conv, greedy, chat_template_kwargs={"add_generation_prompt": False})


@pytest.mark.parametrize(
    "kwargs,field",
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"n": 0}, "n"), ({"top_k": -5}, "top_k"), ({"min_p": 2.0}, "min_p")],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_give_clear_errors_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 1500}], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([{"prompt_token_ids": [10**9]}], SamplingParams(max_tokens=4), use_tqdm=False)
    # A bad prompt in the middle of a batch aborts nothing else and leaks nothing.
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": [5] * 1500}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0
    out = llm.generate(["Still working?"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].finished and len(out[0].outputs[0].token_ids) >= 1


def test_missing_model_and_corrupt_gguf(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="does not exist|not found|No such"):
        LLM(model=str(tmp_path / "nope"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        LLM(model=str(bad))


def test_prompt_that_can_never_fit_the_pool_is_rejected():
    small = LLM(num_gpu_blocks_override=4, max_model_len=1024)  # 64 token slots
    with pytest.raises(ValueError, match="KV pool"):
        small.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=4), use_tqdm=False)
    out = small.generate([{"prompt_token_ids": [5] * 40}], SamplingParams(max_tokens=100, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 40


def test_vllm_cpu_kvcache_space_sizes_the_pool(monkeypatch):
    """vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) sizes the CPU KV pool exactly (not capped to what max_num_seqs needs, as
    the free-memory default is); 0 means the default; a bad value or a space too small for one block is a clear
    error."""
    from pagedllm.worker.worker import CPU_KVCACHE_SPACE_ENV

    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "0.0625")  # 64 MiB
    llm = LLM(max_model_len=256, max_num_seqs=2)
    worker = llm.llm_engine.executor.driver_worker
    assert llm.stats()["kv_blocks_total"] == (64 << 20) // worker.cache_block_size_bytes()
    assert llm.stats()["kv_blocks_total"] > 2 * 256 // 16  # more than the two sequences' need: the user's size
    out = llm.generate(["Hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "0")
    assert LLM(max_model_len=256, max_num_seqs=2).stats()["kv_blocks_total"] == 2 * 256 // 16  # the default
    for bad, match in (("lots", "expected the CPU KV cache's size in GiB"), ("-1", "a number >= 0"),
                       ("0.0000001", "holds no KV block")):
        monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, bad)
        with pytest.raises(ValueError, match=match):
            LLM(max_model_len=256, max_num_seqs=2)


def test_cli_generate_prints_a_completion():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--prompt", "What is the capital of France?",
         "--max-tokens", "16", "--json", "--num-gpu-blocks-override", "64"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--model", "/no/such/model"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def test_final_only_requests_yield_no_partial_outputs(llm):
    """RequestOutputKind (vLLM's): a FINAL_ONLY request yields one output, when it finishes; a CUMULATIVE one
    yields every step's. LLM.generate asks for FINAL_ONLY on copies of the caller's params."""
    from pagedllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    final = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    cumulative = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("final", PROMPTS[0], final)
    engine.add_request("cumulative", PROMPTS[0], cumulative)
    seen: dict[str, list] = {"final": [], "cumulative": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert len(seen["cumulative"]) > 1 and not seen["cumulative"][0].finished
    assert seen["final"][0].outputs[0].token_ids == seen["cumulative"][-1].outputs[0].token_ids
    assert len(seen["final"][0].outputs[0].token_ids) == 6
    mine = SamplingParams(temperature=0, max_tokens=4)
    out = llm.generate(PROMPTS[:1], mine, use_tqdm=False)[0]
    assert mine.output_kind is RequestOutputKind.CUMULATIVE and len(out.outputs[0].token_ids) == 4


def _run_to_end(engine, requests: dict) -> dict[str, list]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    seen: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def test_delta_outputs_add_up_to_the_cumulative_ones(llm):
    """RequestOutputKind.DELTA (vLLM's): each output carries only each completion's new token ids, text and
    logprobs; joined, they are the cumulative output of the same request, for one completion and for n = 2
    seeded samples, through a stop string (its held-back text) and with logprobs; prompt logprobs come in the
    first output only; the last output is the finished one."""
    from pagedllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    common = dict(max_tokens=24, logprobs=2, prompt_logprobs=1, stop=[" the"], seed=7)
    requests = {}
    for name, extra in (("greedy", dict(temperature=0.0)), ("n2", dict(temperature=1.0, n=2))):
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
            requests[f"{name}-{kind.name}"] = (PROMPTS[1], SamplingParams(output_kind=kind, **common, **extra))
    seen = _run_to_end(engine, requests)
    for name, n in (("greedy", 1), ("n2", 2)):
        deltas, full = seen[f"{name}-DELTA"], seen[f"{name}-CUMULATIVE"][-1]
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1]) and full.finished
        assert deltas[0].prompt_logprobs == full.prompt_logprobs and deltas[0].prompt_logprobs is not None
        assert all(d.prompt_logprobs is None for d in deltas[1:])
        assert len(deltas) > 3 and all(len(c.token_ids) <= 1 for d in deltas for c in d.outputs)
        joined: dict[int, dict] = {}
        for d in deltas:
            for c in d.outputs:
                j = joined.setdefault(c.index, {"ids": [], "text": "", "lps": [], "finish": []})
                j["ids"] += c.token_ids
                j["text"] += c.text
                j["lps"] += c.logprobs
                j["finish"].append(c.finish_reason)
                j["cum"], j["stop"] = c.cumulative_logprob, c.stop_reason
        assert sorted(joined) == list(range(n))
        for c in full.outputs:
            j = joined[c.index]
            assert (j["ids"], j["text"], j["lps"]) == (c.token_ids, c.text, c.logprobs)
            assert (j["cum"], j["stop"]) == (c.cumulative_logprob, c.stop_reason)
            # the finish reason arrives once, in the completion's last delta
            assert [f for f in j["finish"] if f is not None] == [c.finish_reason] and j["finish"][-1] == c.finish_reason
    assert any(c.stop_reason == " the" for out in seen.values() for c in out[-1].outputs), "no stop string hit"
