"""Batch invariance on the CPU.

By default (GGUF weights served quantized) a request gets the same greedy tokens and logprobs, bit for bit,
whatever shares its steps: alone, or batched with a long prompt whose chunk takes torch's attention (the choice
of attention is per chunk, not per step).

With VLLM_BATCH_INVARIANT=1 (pagedllm/batch_invariance.py) its tokens and logprobs are also the same after a
prefix-cache hit and under chunked prefill, and batched with long prompts on float32 weights: on the bundled
model with float32 and GGUF-quantized weights and float32 and FP8 KV pools. Also the kernels' pieces of it, and a
clear error where the mode cannot be given."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.batch_invariance import BATCH_INVARIANT_ENV, batch_invariant_from_env, unsupported_reason
from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm
from pagedllm.model.layers.attention import NO_TILE_PATH

KERNELS = cpu_kernels.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the CPU path runs torch")


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("ON", True), ("0", False), ("", False),
                                            ("off", False)])
def test_the_environment_variable(monkeypatch, value, expected):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, value)
    assert batch_invariant_from_env() is expected
    assert ModelConfig().batch_invariant is expected


def test_a_bad_value_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "maybe")
    with pytest.raises(ValueError, match=r"VLLM_BATCH_INVARIANT='maybe'.*use 1 .* or 0"):
        ModelConfig()


def test_unsupported_configurations_are_named():
    assert unsupported_reason("cuda", "bfloat16", None, False, False) is None
    assert "FP8 weights" in unsupported_reason("cuda", "bfloat16", None, False, False, fp8_weights=True)
    assert "tensor_parallel_size=1" in unsupported_reason("cuda", "bfloat16", None, False, False,
                                                          tensor_parallel_size=2)
    assert "native CPU kernels" in unsupported_reason("cpu", "float32", None, False, True)
    assert "dtype='float32'" in unsupported_reason("cpu", "bfloat16", None, True, False)
    assert "native float32 GEMM" in unsupported_reason("cpu", "float32", None, True, False)
    assert unsupported_reason("cpu", "float32", "gguf", True, False) is None
    assert unsupported_reason("cpu", "float32", None, True, True) is None


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=["f32", "e4m3"])
def test_token_path_gives_every_token_of_a_long_chunk_its_lone_bits(cache_dtype):
    """A 70-token chunk after 20 cached tokens, all on the token path, against each token as a one-token chunk
    over the same keys (what a decode, or a prefix-cache hit that leaves one token, computes)."""
    g = torch.Generator().manual_seed(3)
    hq, hk, d, bs, ctx, qlen = 9, 3, 64, 16, 20, 70
    nb = -(-(ctx + qlen) // bs)
    kc = torch.randn(nb, bs, hk, d, generator=g).to(cache_dtype)
    vc = torch.randn(nb, bs, hk, d, generator=g).to(cache_dtype)
    q = torch.randn(qlen, hq, d, generator=g)
    table = torch.randperm(nb, generator=g).to(torch.int32).view(1, nb)
    chunk = torch.empty_like(q)
    KERNELS.paged_attention(chunk, q, kc, vc, table, torch.tensor([ctx + qlen], dtype=torch.int32),
                            torch.tensor([0, qlen], dtype=torch.int32), 0.125, min_tile_query_len=NO_TILE_PATH,
                            k_scale=0.5, v_scale=0.7)
    for i in range(qlen):
        alone = torch.empty_like(q[i:i + 1])
        KERNELS.paged_attention(alone, q[i:i + 1].clone(), kc, vc, table, torch.tensor([ctx + i + 1], dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32), 0.125, k_scale=0.5, v_scale=0.7)
        assert torch.equal(chunk[i], alone[0]), f"token {i}"


@needs_kernels
def test_native_gemm_for_every_row_count_gives_each_row_its_lone_bits():
    gemm = load_f32_gemm()
    if gemm is None:
        pytest.skip("the native float32 GEMM could not be built")
    every = gemm.for_every_row_count()
    assert every.max_rows >= 1 << 40 and every.isa == gemm.isa and every.max_rows > gemm.max_rows
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=g)
    x = torch.randn(gemm.max_rows + 37, 96, generator=g)  # past the default limit, with a partial row tile
    panels = every.pack(w)
    y = every.linear(x, panels, 200, None)
    for i in (0, 11, 12, gemm.max_rows, x.shape[0] - 1):
        assert torch.equal(y[i], every.linear(x[i:i + 1], panels, 200, None)[0]), f"row {i}"


def test_cpu_outputs_do_not_depend_on_what_shares_the_step(tokenizer):
    long_prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 70)[:600]  # > 512: torch SDPA
    shorts = [tokenizer.encode(t) for t in ("The capital of France is", "List three primary colors:",
                                            "def fibonacci(n):")]
    prompts = [{"prompt_token_ids": p} for p in [long_prompt, *shorts]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    runs = {}
    for seqs in (1, 4):
        llm = LLM(quantization="gguf", max_num_seqs=seqs, max_model_len=1024, num_gpu_blocks_override=256,
                  device="cpu")
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[seqs] = [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in
                                                      zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                      for o in outs]
    assert runs[4] == runs[1]


CHAT_TARGET = "The capital of France is"


def _chat(tok, content: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def _tokens_and_logprobs(llm: LLM, prompts: list[str], index: int) -> tuple[list[int], list[float]]:
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    out = llm.generate(prompts, sp, use_tqdm=False)[index].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


@needs_kernels
@pytest.mark.parametrize("quantization,kv_cache_dtype", [("none", "auto"), (None, "fp8")],
                         ids=["float32-weights-f32-kv", "gguf-weights-fp8-kv"])
def test_outputs_do_not_depend_on_batch_chunking_or_prefix_cache(monkeypatch, quantization, kv_cache_dtype):
    """Without the mode the FP8 run's second answer (after the chat template's blocks were cached by another
    request) read "L'aujourcé" against "L'Allema de" alone on this model (BENCHMARKS.md §54)."""
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    kw = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_model_len=512, device="cpu")
    llm = LLM(enable_prefix_caching=True, num_gpu_blocks_override=256, **kw)
    tok = llm.get_tokenizer()
    target = _chat(tok, CHAT_TARGET)
    alone = _tokens_and_logprobs(llm, [target], 0)
    _tokens_and_logprobs(llm, [_chat(tok, "List three colours:")], 0)  # caches the template's blocks
    assert _tokens_and_logprobs(llm, [target], 0) == alone  # a prefix-cache hit: a shorter first chunk
    # batched with three ~150-token prompts: steps of several hundred rows (oneDNN's row counts by default)
    longs = [_chat(tok, "word " * 150 + str(i)) for i in range(3)]
    assert _tokens_and_logprobs(llm, [*longs, target], 3) == alone
    del llm
    chunked = LLM(max_num_batched_tokens=16, num_gpu_blocks_override=128, **kw)  # the prompt in 16-token chunks
    assert _tokens_and_logprobs(chunked, [target], 0) == alone


@needs_kernels
def test_configurations_without_invariance_are_refused(monkeypatch):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    with pytest.raises(ValueError, match=r"VLLM_BATCH_INVARIANT=1: .*float32 \(or GGUF-quantized\) weights"):
        LLM(dtype="bfloat16", max_model_len=256, num_gpu_blocks_override=16, device="cpu")
    with pytest.raises(ValueError, match=r"VLLM_BATCH_INVARIANT=1: speculative method 'ngram_gpu'.*use method 'ngram'"):
        LLM(max_model_len=256, num_gpu_blocks_override=16, device="cpu",
            speculative_config={"method": "ngram_gpu", "num_speculative_tokens": 4})
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "onednn")
    with pytest.raises(ValueError, match=r"VLLM_BATCH_INVARIANT=1: .*native float32 GEMM"):
        LLM(quantization="none", max_model_len=256, num_gpu_blocks_override=16, device="cpu")


@needs_kernels
def test_recompute_preemption_keeps_outputs_bit_for_bit(monkeypatch):
    """A pool too small for the batch preempts by recompute: a preempted request's prompt and generated tokens come
    back as one long chunk, which by default takes the attention kernel's tile path (its tokens were decoded on
    the token path). With the mode every output, logprobs included, equals that of a pool large enough for all."""
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")

    def run(blocks: int):
        llm = LLM(kv_cache_dtype="fp8", max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=blocks,
                  preemption_mode="recompute", device="cpu")
        tok = llm.get_tokenizer()
        prompts = [_chat(tok, p) for p in ("The capital of France is", "List three colours:", "def fibonacci(n):",
                                           "Once upon a time, in a small village by the sea,", "The quick brown fox")]
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
        outs = [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in llm.generate(prompts, sp, use_tqdm=False)]
        return outs, llm.llm_engine.stats()

    want, _ = run(128)
    got, stats = run(20)
    assert stats["num_recompute_preemptions"] > 0, stats
    assert got == want


def _ids_and_logprobs(llm: LLM, prompts: list[list[int]], index: int, max_tokens: int = 12):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)[index].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_outputs_do_not_depend_on_batch_chunking_prefix_cache_or_speculation(monkeypatch, kv_cache_dtype):
    """The bundled model in bfloat16 on CUDA: a request's tokens and logprobs are bit for bit the same alone, after
    a prefix-cache hit, batched with long prompts, in 64-token chunks, eagerly instead of in CUDA graphs, and with
    n-gram speculation (whose verifications add query rows to every GEMM). Without the mode the batched run's logprobs differ (BENCHMARKS.md
    §54: the split-KV decode splits a long context by the step's sequence count)."""
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    kw = dict(skip_tokenizer_init=True, device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              max_model_len=1024)
    g = torch.Generator().manual_seed(1)
    # 600 tokens: the split-KV decode kernel would split this context by the step's sequence count
    target = [int(t) for t in torch.randint(1, 30000, (600,), generator=g)]
    longs = [[int(t) for t in torch.randint(1, 30000, (300,), generator=g)] for _ in range(15)]
    llm = LLM(enable_prefix_caching=True, num_gpu_blocks_override=1024, **kw)
    alone = _ids_and_logprobs(llm, [target], 0)
    _ids_and_logprobs(llm, [target[:-7] + [5, 6, 7]], 0)  # caches all but the last block
    assert _ids_and_logprobs(llm, [target], 0) == alone
    assert _ids_and_logprobs(llm, [*longs, target], 15) == alone
    del llm
    chunked = LLM(max_num_batched_tokens=64, num_gpu_blocks_override=256, **kw)
    assert _ids_and_logprobs(chunked, [target], 0) == alone
    del chunked
    # The engines above replay CUDA graphs (decode buckets pad the batch with rows; prompt steps replay token
    # buckets): an eager engine gives the same bits.
    eager = LLM(enforce_eager=True, num_gpu_blocks_override=256, **kw)
    assert _ids_and_logprobs(eager, [*longs[:3], target], 3) == alone
    del eager
    repeat = (target[:20] * 30)[:600]  # a prompt the n-gram proposer can copy from
    plain = LLM(num_gpu_blocks_override=256, **kw)
    want = _ids_and_logprobs(plain, [repeat], 0, max_tokens=40)
    del plain
    spec = LLM(num_gpu_blocks_override=256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "draft_length_policy": "fixed"}, **kw)
    assert _ids_and_logprobs(spec, [repeat], 0, max_tokens=40) == want
    assert spec.llm_engine.stats().get("spec_decode_num_draft_tokens", 0) > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_weights_refuse_the_mode(monkeypatch, tmp_path):
    from tiny_models import save_tiny_llama

    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    with pytest.raises(ValueError, match=r"VLLM_BATCH_INVARIANT=1: .*FP8 weights"):
        LLM(model=save_tiny_llama(tmp_path), skip_tokenizer_init=True, device="cuda", quantization="fp8",
            max_model_len=256, num_gpu_blocks_override=16)


def test_invariant_sampler_gives_a_row_its_lone_result_in_any_batch():
    """Sampler(batch_invariant=True): a seeded row's token and logprob, and a greedy row's logprob, are the same alone
    and beside rows that would otherwise move the batch to another path (top-p, best_of samples, a random row
    beside greedy ones)."""
    import random as _random

    from pagedllm.model.layers.sampler import Sampler, SamplingRow

    sampler = Sampler(batch_invariant=True)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5000, generator=g) * 3
    seeded = SamplingParams(temperature=0.8, seed=5)
    greedy = SamplingParams(temperature=0)
    others = {"top_p": SamplingParams(temperature=1.0, top_p=0.9), "best_of": SamplingParams(temperature=1.0, n=3)}

    def sample(rows, x):
        return [(s.token_ids, s.logprobs) for s in sampler.launch(x, rows).result()[0]]

    def row(params, seed=None, n=1):
        return SamplingRow(params, [1, 2], [], _random.Random(seed) if seed is not None else None, n)

    alone_seeded = sample([row(seeded, 7)], logits[:1])[0]
    alone_greedy = sample([row(greedy)], logits[1:2])[0]
    for name, params in others.items():
        n = 3 if name == "best_of" else 1
        got = sample([row(seeded, 7), row(greedy), row(params, 3, n)], logits[:3])
        assert got[0] == alone_seeded, name
        assert got[1] == alone_greedy, name


@needs_kernels
def test_speculation_keeps_greedy_tokens_and_logprobs_bit_for_bit(monkeypatch):
    """The mode keeps speculation exact on the CPU: n-gram verified rows give a greedy request plain decoding's tokens
    and logprobs. The default CPU path gives this too (verifications take the token path there as well); this guards
    the paths the mode changes (every chunk on the token path, the sampler's torch ops)."""
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    kw = dict(device="cpu", max_model_len=512, num_gpu_blocks_override=128)
    plain = LLM(**kw)
    repeat = plain.get_tokenizer().encode("The capital of France is Paris. The capital of Spain is Madrid. " * 6)
    want = _ids_and_logprobs(plain, [repeat], 0, max_tokens=40)
    del plain
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3, "draft_length_policy": "fixed"}, **kw)
    assert _ids_and_logprobs(spec, [repeat], 0, max_tokens=40) == want
    assert spec.llm_engine.stats()["spec_decode_num_draft_tokens"] > 0


@needs_kernels
def test_speculation_keeps_seeded_samples_token_for_token(monkeypatch):
    """Seeded sampled requests (temperature 0.8, top-p 0.95) get plain decoding's tokens and logprobs with n-gram
    speculation under the mode: verification samples each row as the sampler does and draws one uniform per emitted
    token (spec_decode/rejection_sampler.py). Before, it drew k + 1 per verification, so a seeded request's text
    depended on which steps speculated, hence on what shared them (found by benchmarks/soak.py, BENCHMARKS §56)."""
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    kw = dict(device="cpu", max_model_len=512, num_gpu_blocks_override=128)
    plain = LLM(**kw)
    tok = plain.get_tokenizer()
    prompts = [tok.encode(t * 5) for t in ("The capital of France is Paris. The capital of Spain is Madrid. ",
                                           "def add(a, b):\n    return a + b\n\n", "one two three four five six ")]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=40, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]

    def tokens(llm):  # and their logprobs, bit for bit
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                for c in (o.outputs[0] for o in outs)]

    want = tokens(plain)
    del plain
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3, "draft_length_policy": "fixed"}, **kw)
    assert tokens(spec) == want
    stats = spec.llm_engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
