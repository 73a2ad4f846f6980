"""Prompt-embedding inputs (vLLM's EmbedsPrompt, --enable-prompt-embeds), offline and through the server.

References: the model's own embedding rows of a token prompt must give exactly that token prompt's greedy tokens
(bundled model), and arbitrary embeddings must give transformers' `generate(inputs_embeds=...)` greedy tokens on
the same random tiny Llama, token for token (through chunked prefill, preemption by recompute, the prefix cache
and tensor parallelism).
"""
from __future__ import annotations

import base64
import io
import signal

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tiny_models import TINY_ENGINE_KW, save_tiny_llama

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXTS = ["The capital of France is", "def fibonacci(n):\n    "]


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _b64(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


# -- the bundled model: its own embedding rows are its token prompts -----------------------------------------------
@pytest.fixture(scope="module")
def bundled():
    return LLM(enable_prompt_embeds=True, num_gpu_blocks_override=64, max_model_len=512)


def _embed(llm: LLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return llm.llm_engine.executor.driver_worker.model.embed_input_ids(torch.tensor(ids)).clone()


@pytest.fixture(scope="module")
def by_ids(bundled):
    """(the token prompts of TEXTS, their outputs)."""
    ids = [bundled.get_tokenizer().encode(t) for t in TEXTS]
    return ids, bundled.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)


def test_token_embeddings_give_the_token_prompts_tokens(bundled, by_ids):
    ids, by_ids = by_ids
    by_embeds = bundled.generate([{"prompt_embeds": _embed(bundled, i)} for i in ids], GREEDY, use_tqdm=False)
    assert _tokens(by_embeds) == _tokens(by_ids)
    assert [o.outputs[0].text for o in by_embeds] == [o.outputs[0].text for o in by_ids]
    # vLLM's placeholder prompt ids for an embeds prompt: one 0 per row.
    assert [o.prompt_token_ids for o in by_embeds] == [[0] * len(i) for i in ids]
    assert all(o.prompt is None for o in by_embeds)


def test_mixed_batch_leaves_token_prompts_unchanged(bundled, by_ids):
    ids, outputs = by_ids
    alone = _tokens(outputs)
    tok = bundled.get_tokenizer()
    noise = torch.Generator().manual_seed(3)
    other = _embed(bundled, tok.encode("Once upon a time"))
    other = other + 0.02 * torch.randn(other.shape, generator=noise)
    mixed = bundled.generate([{"prompt_token_ids": ids[0]}, {"prompt_embeds": other}, ids[1]], GREEDY,
                             use_tqdm=False)
    assert _tokens(mixed)[0] == alone[0] and _tokens(mixed)[2] == alone[1]
    assert mixed[1].prompt_token_ids == [0] * len(other)


def test_prompt_logprobs_are_not_available_for_embeds(bundled):
    """vLLM returns no prompt logprobs for an embeds prompt (no prompt token ids to score); the outputs stand."""
    tok = bundled.get_tokenizer()
    ids = tok.encode(TEXTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    out_ids, out_embeds = bundled.generate([ids, {"prompt_embeds": _embed(bundled, ids)}], params, use_tqdm=False)
    assert out_ids.prompt_logprobs is not None and out_embeds.prompt_logprobs is None
    assert out_embeds.outputs[0].token_ids == out_ids.outputs[0].token_ids
    assert len(out_embeds.outputs[0].logprobs) == 4


@pytest.mark.parametrize("embeds, fragment", [
    (torch.zeros(4), "shape [num_tokens, hidden_size=576]"),
    (torch.zeros(2, 3, 576), "got shape (2, 3, 576)"),
    (torch.zeros(3, 100), "hidden size 100, but this model's is 576"),
    (torch.zeros(0, 576), "empty"),
    (torch.zeros(3, 576, dtype=torch.int64), "floating-point"),
    (torch.zeros(512, 576), "at most 511 prompt tokens"),
    ([[0.0] * 576], "must be a torch.Tensor"),
])
def test_bad_embeddings_are_a_clear_value_error(bundled, embeds, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        bundled.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not both"):
        bundled.generate({"prompt_embeds": torch.zeros(2, 576), "prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    assert not bundled.llm_engine.has_unfinished_requests()


# -- a tiny random Llama against transformers' generate(inputs_embeds=...) -------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-embeds"))


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def _perturbed_prompts(hf, lengths: list[int], seed: int) -> list[torch.Tensor]:
    """The embeddings of random token prompts plus noise of about their own size: inputs no token gives."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(0, hf.config.vocab_size, (n,), generator=g)
            rows = hf.get_input_embeddings()(ids)
            out.append((rows + rows.std() * torch.randn(rows.shape, generator=g)).contiguous())
    return out


def _hf_greedy(hf, prompts: list[torch.Tensor], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for e in prompts:
            seq = hf.generate(inputs_embeds=e[None].float(), attention_mask=torch.ones(1, len(e), dtype=torch.long),
                              do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
            out.append(seq[0, -max_tokens:].tolist())
    return out


def test_matches_transformers_inputs_embeds(tiny_dir, tiny_hf):
    """Chunked prefill (12-token steps) splits the longer prompts; a bfloat16 input is cast to the float32 model."""
    prompts = _perturbed_prompts(tiny_hf, [5, 19, 33], seed=0)
    prompts[1] = prompts[1].to(torch.bfloat16)
    ref = _hf_greedy(tiny_hf, [p.float() for p in prompts])
    llm = LLM(tiny_dir, enable_prompt_embeds=True, max_num_batched_tokens=12, max_num_seqs=4, **TINY_ENGINE_KW)
    assert _tokens(llm.generate([{"prompt_embeds": p} for p in prompts], GREEDY, use_tqdm=False)) == ref


def test_gemma3_matches_transformers_inputs_embeds(tmp_path):
    """Gemma's `inputs_embeds` are scaled embeddings (transformers' Gemma3TextScaledWordEmbedding); on the hybrid KV
    cache (local and global groups) with a 12-token step budget and a window of 8."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], attn_implementation="eager",
        initializer_range=0.1)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf.generation_config.eos_token_id = None
    prompts = _perturbed_prompts(hf, [5, 19, 33], seed=3)
    llm = LLM(str(tmp_path), enable_prompt_embeds=True, max_num_batched_tokens=12, max_num_seqs=4,
              **{**TINY_ENGINE_KW, "num_gpu_blocks_override": 128})
    assert llm.llm_engine.scheduler.block_manager.num_groups == 3
    assert _tokens(llm.generate([{"prompt_embeds": p} for p in prompts], GREEDY, use_tqdm=False)) == _hf_greedy(
        hf, prompts)


def test_preemption_by_recompute_reruns_the_same_embeddings(tiny_dir, tiny_hf):
    prompts = _perturbed_prompts(tiny_hf, [30, 27, 34, 25], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _hf_greedy(tiny_hf, prompts, max_tokens=24)
    kw = {**TINY_ENGINE_KW, "num_gpu_blocks_override": 20}
    llm = LLM(tiny_dir, enable_prompt_embeds=True, preemption_mode="recompute", **kw)
    out = _tokens(llm.generate([{"prompt_embeds": p} for p in prompts], params, use_tqdm=False))
    assert llm.llm_engine.scheduler.num_recompute_preemptions > 0
    assert out == ref


def test_prefix_cache_keys_blocks_by_the_embeddings(tiny_dir, tiny_hf):
    """Two embeds prompts of equal length have equal placeholder ids; each must get its own output, and only equal
    embeddings may hit the cache."""
    a, b = _perturbed_prompts(tiny_hf, [26, 26], seed=2)
    ref = _hf_greedy(tiny_hf, [a, b])
    llm = LLM(tiny_dir, enable_prompt_embeds=True, enable_prefix_caching=True, **TINY_ENGINE_KW)
    out_a = llm.generate({"prompt_embeds": a}, GREEDY, use_tqdm=False)[0]
    out_b = llm.generate({"prompt_embeds": b}, GREEDY, use_tqdm=False)[0]
    again_a = llm.generate({"prompt_embeds": a.clone()}, GREEDY, use_tqdm=False)[0]
    assert [list(o.outputs[0].token_ids) for o in (out_a, out_b, again_a)] == [ref[0], ref[1], ref[0]]
    assert out_b.num_cached_tokens == 0
    assert again_a.num_cached_tokens == 24  # its 3 full blocks of 8


def test_tensor_parallel_ranks_get_the_embeddings(tiny_dir, tiny_hf):
    """The step message carries the rows to the other rank (executor/embeds_codec.py)."""
    prompts = _perturbed_prompts(tiny_hf, [9, 21], seed=4)
    ref = _hf_greedy(tiny_hf, prompts)
    llm = LLM(tiny_dir, enable_prompt_embeds=True, tensor_parallel_size=2, distributed_executor_backend="mp",
              max_num_batched_tokens=16, **TINY_ENGINE_KW)
    try:
        out = _tokens(llm.generate([{"prompt_embeds": p} for p in prompts], GREEDY, use_tqdm=False))
    finally:
        llm.llm_engine.executor.shutdown()
    assert out == ref


def test_without_the_flag_an_embeds_prompt_is_refused(tiny_dir):
    llm = LLM(tiny_dir, **TINY_ENGINE_KW)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        llm.generate({"prompt_embeds": torch.zeros(3, 256)}, GREEDY, use_tqdm=False)
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # the engine still serves


def test_step_codec_carries_the_rows():
    from pagedllm.executor.step_codec import decode_request, encode_request
    from pagedllm.worker.model_input import ExecuteModelRequest, SequenceChunk

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = torch.randn(3, 8).to(dtype)
        req = ExecuteModelRequest([SequenceChunk(1, [7], 9, [1, 2], True),
                                   SequenceChunk(2, [0, 0, 0, 4], 0, [3], True, prompt_embeds=rows)], [(1, 2)])
        back = decode_request(encode_request(req))
        assert back.chunks[0].prompt_embeds is None
        assert back.chunks[1].prompt_embeds.dtype == dtype and torch.equal(back.chunks[1].prompt_embeds, rows)
        assert [c.token_ids for c in back.chunks] == [[7], [0, 0, 0, 4]] and back.blocks_to_swap_in == [(1, 2)]


def test_base64_loader_never_unpickles_objects(tmp_path):
    from pagedllm.engine.prompt_embeds import load_prompt_embeds

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(ValueError, match="could not be loaded"):
        load_prompt_embeds(_b64(Payload()))
    assert not marker.exists()
    with pytest.raises(ValueError, match="not valid base64"):
        load_prompt_embeds("not base64!")
    with pytest.raises(ValueError, match="one tensor"):
        load_prompt_embeds(_b64({"a": torch.zeros(2)}))
    assert torch.equal(load_prompt_embeds(_b64(torch.ones(2, 3))), torch.ones(2, 3))


# -- the server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    from conftest_server import SMALL_SERVER_ARGS, RemoteServer

    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-prompt-embeds"])
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def _complete(server, **body):
    import httpx

    from conftest_server import MODEL_NAME

    return httpx.post(server.url("/v1/completions"),
                      json={"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, **body}, timeout=120)


def test_server_completions_with_base64_embeddings(server, bundled):
    ids = [bundled.get_tokenizer().encode(t) for t in TEXTS]
    by_ids = _complete(server, prompt=ids)
    assert by_ids.status_code == 200, by_ids.text
    embeds = [_b64(_embed(bundled, i)) for i in ids]
    one = _complete(server, prompt_embeds=embeds[0], return_token_ids=True)
    assert one.status_code == 200, one.text
    assert one.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]
    assert one.json()["choices"][0]["prompt_token_ids"] == [0] * len(ids[0])
    assert one.json()["usage"]["prompt_tokens"] == len(ids[0])
    from conftest_server import stream_chunks

    chunks = stream_chunks(server, "/v1/completions", {"prompt_embeds": embeds[0], "max_tokens": 8, "temperature": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == one.json()["choices"][0]["text"]
    # A list of embeddings and a text prompt: the embeddings' choices first (vLLM's order).
    mixed = _complete(server, prompt_embeds=[embeds[1], embeds[0]], prompt=TEXTS[0])
    assert mixed.status_code == 200, mixed.text
    texts = [c["text"] for c in sorted(mixed.json()["choices"], key=lambda c: c["index"])]
    first, second = (c["text"] for c in by_ids.json()["choices"])
    assert texts == [second, first, first]


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt_embeds": "%%% not base64"}, "prompt_embeds", "not valid base64"),
    ({"prompt_embeds": _b64({"weights": torch.zeros(2, 576)})}, "prompt_embeds", "one tensor"),
    ({"prompt_embeds": _b64(torch.zeros(3, 100))}, "prompt_embeds", "hidden size 100"),
    ({"prompt_embeds": _b64(torch.zeros(3, 576, dtype=torch.int32))}, "prompt_embeds", "floating-point"),
    ({"prompt_embeds": _b64(torch.zeros(1030, 576, dtype=torch.float16))}, "prompt_embeds", "1030 rows"),
    ({"prompt_embeds": _b64(torch.zeros(3, 576)), "echo": True}, "echo", "echo is not supported"),
    ({"max_tokens": 4}, "prompt", "field required"),
])
def test_server_bad_embeddings_are_a_400(server, body, param, fragment):
    r = _complete(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"].lower(), err


def test_server_without_the_flag_refuses_embeddings():
    pytest.importorskip("fastapi")
    from conftest_server import SMALL_SERVER_ARGS, RemoteServer

    srv = RemoteServer(SMALL_SERVER_ARGS)
    try:
        r = _complete(srv, prompt_embeds=_b64(torch.zeros(3, 576)))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt_embeds"
        assert "--enable-prompt-embeds" in r.json()["error"]["message"]
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


# -- CUDA: steps with prompt-embedding rows run eagerly, the others replay their graphs ---------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_embeds_steps_beside_graph_steps(tiny_dir, tiny_hf):
    prompts = _perturbed_prompts(tiny_hf, [6, 21, 40], seed=5)
    ref = _hf_greedy(tiny_hf, prompts)
    token_prompts = [[5, 17, 300, 42], list(range(100, 130))]
    llm = LLM(tiny_dir, enable_prompt_embeds=True, skip_tokenizer_init=True, dtype="float32", device="cuda",
              num_gpu_blocks_override=64, block_size=16, max_model_len=256)
    assert llm.llm_engine.executor.driver_worker.model_runner.graph_runner is not None  # graphs captured
    alone = _tokens(llm.generate(token_prompts, GREEDY, use_tqdm=False))
    mixed = llm.generate([{"prompt_embeds": p} for p in prompts] + token_prompts, GREEDY, use_tqdm=False)
    assert _tokens(mixed) == ref + alone
    with torch.inference_mode():
        rows = tiny_hf.get_input_embeddings()(torch.tensor(token_prompts[1]))
    assert _tokens(llm.generate({"prompt_embeds": rows.to(torch.bfloat16).float()}, GREEDY, use_tqdm=False)) == \
        _tokens(llm.generate({"prompt_embeds": rows.to(torch.bfloat16)}, GREEDY, use_tqdm=False))
    assert _tokens(llm.generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)) == [alone[1]]
