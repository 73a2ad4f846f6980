"""Mamba-2 and hybrid Mamba-2 / attention models through the whole engine: greedy tokens equal transformers' (float32)
with many sequences in one batch, chunked prefill, a pool small enough to preempt (recompute: the state slot is freed
and the prompt re-run from zeros), n > 1 (each child starts from a copy of its parent's state), and nothing leaks. The
layer math itself is checked in test_mamba2_layers.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_mamba2_layers import HYBRIDS, _mamba2_config

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPT_LENS = (1, 4, 9, 15, 22, 30)
MAX_TOKENS = 10
MAMBA1 = {"mamba": (transformers.MambaConfig, transformers.MambaForCausalLM),
          "falcon-mamba": (transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM)}
ENGINE_KW = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4, max_model_len=64)


def _random_hf(name: str, n_groups: int | None = None) -> torch.nn.Module:
    """A tiny random model of family `name` (`n_groups`: its Mamba layers' B/C groups, else the family's)."""
    if name == "mamba2":
        config = _mamba2_config(num_hidden_layers=3, **({"n_groups": n_groups} if n_groups else {}))
        model_cls = transformers.Mamba2ForCausalLM
    elif name in MAMBA1:  # Mamba-1 layers (one B / C for all channels: no groups)
        config_cls, model_cls = MAMBA1[name]
        config = config_cls(vocab_size=96, hidden_size=64, state_size=16, num_hidden_layers=3, expand=2,
                            conv_kernel=4, time_step_rank=8, tie_word_embeddings=False, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2)
    elif name == "jamba":  # Mamba-1 layers with attention (no RoPE) at 1 and 3, 4-expert MoE feed-forwards there
        config = transformers.JambaConfig(
            vocab_size=96, hidden_size=64, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, mamba_d_state=16, mamba_expand=2, mamba_dt_rank=8,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        model_cls = transformers.JambaForCausalLM
    else:
        config_cls, model_name, kwargs, _ = HYBRIDS[name]
        if n_groups:
            kwargs = {**kwargs, "n_groups" if name.startswith("nemotron") else "mamba_n_groups": n_groups}
        config = getattr(transformers, config_cls)(**kwargs)
        model_cls = getattr(transformers, model_name)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # wider than the default init, so greedy margins are not ties
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.05))
    return model


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, each from a whole forward pass over the prompt and the tokens so far (no cache:
    the reference does not rest on transformers' own recurrent-state cache, which older releases got wrong here)."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(p):])
    return out


@pytest.fixture(scope="module", params=["mamba2", "bamba", "granite-moe-nope", "granite-dense-rope", "nemotron-h",
                                        "nemotron-h-moe", "mamba", "falcon-mamba", "jamba"])
def built(request, tmp_path_factory) -> tuple[str, Path, list[list[int]], list[list[int]]]:
    name = request.param
    model = _random_hf(name)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return name, path, prompts, _hf_greedy(model, prompts)


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 1) -> list:
    # n > 1: a temperature so low that every draw is the argmax (random-weight margins are >= 1e-4 here, x 5e4)
    params = SamplingParams(temperature=0.0 if n == 1 else 2e-5, max_tokens=MAX_TOKENS, ignore_eos=True, n=n, seed=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _no_leaks(llm: LLM) -> None:
    bm = llm.llm_engine.scheduler.block_manager
    bm.check_invariants()
    assert not bm.state_slots and bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks


def test_greedy_matches_transformers_batched_and_chunked(built) -> None:
    name, path, prompts, want = built
    # 8-token steps: the longer prompts prefill over several steps beside other sequences' decodes
    llm = LLM(str(path), max_num_batched_tokens=8, max_num_seqs=8, **ENGINE_KW)
    outs = _greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == want, name
    assert llm.llm_engine.config.cache_config.has_recurrent_state
    _no_leaks(llm)


def test_preemption_and_forks_keep_transformers_tokens(built) -> None:
    """A pool of 36 blocks for 6 groups of 3 sequences needing ~77 at once: sequences are preempted and recomputed;
    n=3 (near-greedy) children each continue from a copy of their parent's state, so all three equal transformers'."""
    name, path, prompts, want = built
    llm = LLM(str(path), num_gpu_blocks_override=36, max_num_seqs=18, **ENGINE_KW)
    outs = _greedy(llm, prompts, n=3)
    for out, ref in zip(outs, want):
        assert [list(c.token_ids) for c in out.outputs] == [ref] * 3, name
    assert llm.llm_engine.scheduler.num_recompute_preemptions > 0
    _no_leaks(llm)


def test_warm_up_steps_leave_the_slots_alone(built) -> None:
    """The engine's warm-up steps (run at CUDA start so that no request compiles a kernel; here on the CPU) include a
    prefix-cache snapshot inside a chunk: they run in the scratch slot only, and transformers' tokens follow."""
    name, path, prompts, want = built
    llm = LLM(str(path), enable_prefix_caching=True, mamba_block_size=8, max_num_seqs=8, **ENGINE_KW)
    worker = llm.llm_engine.executor.driver_worker
    before = [(c.conv_state[:-1].clone(), c.ssm_state[:-1].clone()) for c in worker.mamba_caches]
    assert worker.model_runner.warm_up_steps(worker.cache_engine.gpu_cache) == ["steps prefill/mixed/decode"]
    scratch = [c.ssm_state[-1] for c in worker.mamba_caches]
    assert any(bool(s.abs().sum() > 0) for s in scratch)  # the warm-up ran its chunks (in the scratch slot)
    for (conv, ssm), cache in zip(before, worker.mamba_caches):
        assert torch.equal(conv, cache.conv_state[:-1]) and torch.equal(ssm, cache.ssm_state[:-1])
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts)] == want, name
    _no_leaks(llm)


def test_unsupported_features_are_clear_errors(built) -> None:
    _, path, _, _ = built
    with pytest.raises(ValueError, match="state-space"):
        LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **ENGINE_KW)
    with pytest.raises(ValueError, match="state-space"):
        LLM(str(path), preemption_mode="swap", **ENGINE_KW)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(str(path), mamba_block_size=8, **ENGINE_KW)
    with pytest.raises(ValueError, match="multiple of block_size 4"):
        LLM(str(path), enable_prefix_caching=True, mamba_block_size=6, **ENGINE_KW)


@pytest.mark.parametrize("batched", [8, 64])
def test_prefix_caching_resumes_from_state_snapshots(built, batched: int) -> None:
    """With prefix caching, a state snapshot every 8 tokens: prompts that share 17-21 tokens with an earlier one
    resume from its snapshot at 16 (in 8-token steps the snapshots fall at chunk ends; in 64-token steps inside the
    chunk) and keep transformers' tokens; snapshots are published only once written, and nothing leaks."""
    name, path, _, _ = built
    gen = torch.Generator().manual_seed(7)
    base = torch.randint(3, 90, (21,), generator=gen).tolist()
    first = base + [5, 6, 7]
    later = [base[:17] + [8, 9, 10, 11], base + [12], base[:9]]  # the last shares only up to the snapshot at 8
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = _hf_greedy(model, [first, *later])
    llm = LLM(str(path), enable_prefix_caching=True, mamba_block_size=8, max_num_batched_tokens=batched,
              max_num_seqs=8, **ENGINE_KW)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.snapshots is not None and bm.snapshots.num_slots == 8
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, [first])] == want[:1], name
    assert bm.snapshots.stats.num_planned == 4  # at 8, 16, 24 (the prompt) and 32 (a generated token)
    hits_before = bm.stats.prefix_cache_hits
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in later]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want[1:], name
    assert bm.stats.prefix_cache_hits - hits_before == 16 + 16 + 8
    assert bm.snapshots.stats.num_hits == 3
    _no_leaks(llm)
    # the logprobs too (greedy tokens of a random hybrid barely depend on its Mamba layers' state)
    plain = LLM(str(path), max_num_batched_tokens=batched, max_num_seqs=8, **ENGINE_KW)
    for got, ref in zip(outs, plain.generate(prompts, params, use_tqdm=False)):
        lp = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in (got, ref)]
        torch.testing.assert_close(torch.tensor(lp[0]), torch.tensor(lp[1]), atol=1e-4, rtol=0)


def test_shared_prefix_gets_a_snapshot_where_it_ends(built) -> None:
    """Prompts sharing a 13-token prefix, snapshots every 32 tokens (so none on the grid): the second prompt finds 12
    tokens of cached blocks but no state there, recomputes them and leaves a snapshot at 12 as it passes; the third
    resumes from it. Every output keeps transformers' tokens, and nothing leaks."""
    name, path, _, _ = built
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 90, (13,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 90, (6,), generator=gen).tolist() for _ in range(3)]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = _hf_greedy(model, prompts)
    llm = LLM(str(path), enable_prefix_caching=True, mamba_block_size=32, max_num_seqs=8, **ENGINE_KW)
    bm = llm.llm_engine.scheduler.block_manager
    got, hits = [], []
    for prompt in prompts:
        before = bm.stats.prefix_cache_hits
        got.append(list(_greedy(llm, [prompt])[0].outputs[0].token_ids))
        hits.append(bm.stats.prefix_cache_hits - before)
    assert got == want, name
    assert hits == [0, 0, 12]
    assert bm.snapshots.stats.num_hits == 1
    _no_leaks(llm)


def test_beam_search_matches_transformers(built) -> None:
    """Beam search forks and drops sequences every step: each kept beam continues from its parent's copied state."""
    name, path, prompts, _ = built
    from pagedllm.sampling_params import BeamSearchParams

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    chosen = prompts[1:4]
    want = []
    with torch.inference_mode():
        for p in chosen:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=3,
                                 do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
                                 early_stopping=True)
            want.append([o[len(p):].tolist() for o in out])
    llm = LLM(str(path), **ENGINE_KW)
    got = llm.beam_search([{"prompt_token_ids": p} for p in chosen],
                          BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    assert [[s.tokens[-6:] for s in r.sequences] for r in got] == want, name
    _no_leaks(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mamba2", "bamba", "granite-moe-nope", "granite-dense-rope", "nemotron-h",
                                  "nemotron-h-moe", "mamba", "falcon-mamba", "jamba"])
def test_cuda_greedy_matches_transformers(name: str, tmp_path: Path) -> None:
    """On the GPU (the Triton decode kernels, decode CUDA graphs for the hybrids, asynchronous scheduling), float32:
    transformers' tokens, batched and chunked, and with forks under preemption. One group of B/C per layer here:
    transformers releases before 5.2x normalised Mamba-2's gated norm over all groups at once (the CPU tests, on the
    current release, cover two groups)."""
    model = _random_hf(name, n_groups=1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    want = _hf_greedy(model, prompts)
    kw = {**ENGINE_KW, "device": "cuda"}
    # a fixed small pool: the default would size it to most of the GPU for a model this small
    llm = LLM(str(tmp_path), max_num_batched_tokens=8, max_num_seqs=8, num_gpu_blocks_override=256, **kw)
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts)] == want, name
    _no_leaks(llm)
    llm = LLM(str(tmp_path), num_gpu_blocks_override=36, max_num_seqs=18, **kw)
    for out, ref in zip(_greedy(llm, prompts, n=3), want):
        assert [list(c.token_ids) for c in out.outputs] == [ref] * 3, name
    _no_leaks(llm)
    # prefix caching: the second pass resumes every prompt of 8+ tokens from a state snapshot (16 snapshot slots:
    # the first pass writes 16 snapshots, generated tokens' included)
    llm = LLM(str(tmp_path), enable_prefix_caching=True, mamba_block_size=8, num_gpu_blocks_override=256,
              max_num_seqs=16, **kw)
    for _ in range(2):
        assert [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts)] == want, name
    assert llm.llm_engine.scheduler.block_manager.snapshots.stats.num_hits >= 4
    _no_leaks(llm)


def test_state_memory_caps_max_num_seqs_and_ssm_dtype(built, monkeypatch) -> None:
    """Where max_num_seqs slots of state would take more than half the memory left for state and KV, max_num_seqs is
    lowered to what fits (the block manager's slots with it); --mamba-ssm-cache-dtype sets the SSM state's dtype."""
    name, path, prompts, want = built
    from pagedllm.model.models.registry import get_model_class
    from pagedllm.model.loader import load_config
    from pagedllm.worker.worker import Worker

    shape = get_model_class(load_config(path)).mamba_state_shape(load_config(path))
    per_slot = shape.bytes_per_slot(torch.float32, torch.bfloat16)
    monkeypatch.setattr(Worker, "_memory_for_kv_and_state", lambda self: 2 * 5 * per_slot)
    llm = LLM(str(path), max_num_seqs=64, mamba_ssm_cache_dtype="bfloat16", skip_tokenizer_init=True,
              dtype="float32", device="cpu", block_size=4, max_model_len=64)
    engine = llm.llm_engine
    assert engine.config.scheduler_config.max_num_seqs == 4  # 5 slots: 4 sequences and the scratch slot
    assert engine.scheduler.block_manager.num_state_slots == 4
    caches = engine.executor.driver_worker.mamba_caches
    assert len(caches) == shape.num_layers and caches[0].ssm_state.dtype == torch.bfloat16
    assert caches[0].ssm_state.shape[0] == 5 and caches[0].conv_state.dtype == torch.float32
    outs = _greedy(llm, prompts)  # 6 requests through 4 slots
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    _no_leaks(llm)
