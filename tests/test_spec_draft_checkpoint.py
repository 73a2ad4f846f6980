"""Speculative decoding with a separate draft checkpoint (`speculative_config.model`): its own KV pool under the
target's block tables, exact outputs, and the errors for drafts that cannot serve."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.model.loader import DEFAULT_MODEL

from test_spec_decode import F32, _prompts, _run

GREEDY = SamplingParams(temperature=0, max_tokens=20)
# The bundled GGUF served quantized (its Q4_1 blocks, the CPU's int8 kernels) drafting for the float32 target.
QUANTIZED_DRAFT = {"model": DEFAULT_MODEL, "quantization": "gguf", "num_speculative_tokens": 3,
                   "draft_length_policy": "fixed"}


def _random_draft(path: Path, vocab_size: int = 49152, max_positions: int = 2048, seed: int = 0) -> str:
    """A 2-layer random Llama with the bundled model's vocabulary: a draft that is almost always wrong."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(tokenizer):
    prompts = _prompts(tokenizer)
    outs, _ = _run(prompts, GREEDY, num_gpu_blocks_override=64)
    return prompts, outs


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    return _random_draft(tmp_path_factory.mktemp("random_draft"))


def test_method_is_inferred_from_the_model():
    assert SpeculativeConfig.from_json({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.from_json({"num_speculative_tokens": 2}).method == "ngram"


@pytest.mark.parametrize("spec,match", [
    ({"method": "ngram", "model": "/m"}, "method 'ngram' proposes from the tokens alone"),
    ({"model": "/m", "draft_num_layers": 4}, "not both"),
    ({"method": "draft_model", "quantization": "gguf"}, "applies to a draft checkpoint"),
    ({"model": "/m", "quantization": "int3"}, "speculative_config.quantization"),
    ({"model": "/m", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2: .* allowed: 1"),
    ({"method": "ngram", "max_model_len": 64}, "a draft checkpoint's context"),
    ({"method": "ngram", "enforce_eager": True}, "enforce_eager applies to a draft checkpoint"),
])
def test_config_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_json(spec)


def test_quantized_draft_greedy_identical_and_accepted(reference):
    """The bundled model's Q4_1 blocks draft for its float32 dequantized self: plain decoding's tokens, most drafts
    accepted, no block leaked (`_run` checks), and the draft's pool has the target's block count."""
    prompts, ref = reference
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=64, quantization="none",
              speculative_config=QUANTIZED_DRAFT)
    worker = llm.llm_engine.executor.driver_worker
    draft = worker.draft_worker
    assert draft.quantization == "gguf" and worker.quantization is None
    assert draft.cache_engine.num_blocks[0] == worker.cache_engine.num_blocks[0] == 64
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == ref
    st = llm.stats()
    assert st["spec_decode_num_draft_tokens"] > 0
    assert st["spec_decode_num_accepted_tokens"] >= 0.9 * st["spec_decode_num_draft_tokens"]
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks


def test_a_truncated_copy_drafts(reference, tmp_path):
    """benchmarks/truncated_draft.py: the bundled model's first 4 layers as an HF directory (float32) draft for it;
    plain decoding's tokens whatever they accept."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("truncated_draft", Path(__file__).parents[1] / "benchmarks" /
                                                  "truncated_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    draft = module.write_truncated(None, tmp_path / "draft4", 4, torch.float32)
    assert '"num_hidden_layers": 4' in (draft / "config.json").read_text()
    with pytest.raises(ValueError, match="--layers must be in"):
        module.write_truncated(None, tmp_path / "bad", 30, torch.float32)
    prompts, ref = reference
    outs, st = _run(prompts, GREEDY, num_gpu_blocks_override=64,
                    speculative_config={"model": str(draft), "num_speculative_tokens": 3,
                                        "draft_length_policy": "fixed"})
    assert outs == ref
    assert st["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identical_under_preemption(reference, mode):
    """6 blocks of 16 tokens for three ~25-token prompts growing by 20: sequences are preempted, their tables
    change, and the draft starts again from the first position of its new blocks."""
    prompts, ref = reference
    outs, st = _run(prompts, GREEDY, num_gpu_blocks_override=6, preemption_mode=mode,
                    speculative_config=QUANTIZED_DRAFT)
    assert st["num_preemptions"] > 0
    assert outs == ref
    # Exact outputs hold whatever the draft proposes; its acceptance shows that its K/V followed the tables.
    assert st["spec_decode_num_accepted_tokens"] >= 0.9 * st["spec_decode_num_draft_tokens"] > 0


def test_greedy_identical_with_prefix_caching_and_n2(reference):
    """Prefix caching (blocks shared with cached prompts) and n = 2 (forked tables, copy-on-write)."""
    prompts, ref = reference
    llm = LLM(max_model_len=256, num_gpu_blocks_override=64, enable_prefix_caching=True, block_size=8, dtype=F32,
              speculative_config=QUANTIZED_DRAFT)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [[list(c.token_ids) for c in o.outputs] for o in outs] == ref
    outs = llm.generate([{"prompt_token_ids": prompts[0]}],
                        SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=20), use_tqdm=False)
    assert [list(c.token_ids) for c in outs[0].outputs] == [ref[0][0]] * 2
    st = llm.stats()
    assert st["prefix_cache_hits"] > 0
    assert st["spec_decode_num_accepted_tokens"] >= 0.9 * st["spec_decode_num_draft_tokens"] > 0
    bm = llm.llm_engine.scheduler.block_manager
    bm.check_invariants()
    assert not bm.block_tables


def test_random_draft_keeps_outputs_and_seeded_sampling(reference, random_draft):
    """A random 2-layer draft from an HF directory (wrong nearly always): greedy outputs unchanged, and a seeded
    sampled request draws the same tokens as without speculation (one uniform per emitted token)."""
    prompts, ref = reference
    spec = {"model": random_draft, "num_speculative_tokens": 3, "draft_length_policy": "fixed"}
    outs, st = _run(prompts, GREEDY, num_gpu_blocks_override=64, speculative_config=spec)
    assert outs == ref and st["spec_decode_num_draft_tokens"] > 0
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16)
    off, _ = _run(prompts, seeded, num_gpu_blocks_override=64)
    on, _ = _run(prompts, seeded, num_gpu_blocks_override=64, speculative_config=spec)
    assert on == off


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_with_a_draft(reference, random_draft, level):
    """Sleep frees the draft's pool (and weights, level 2) with the target's; after wake_up both serve again."""
    prompts, ref = reference
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=64, enable_sleep_mode=True,
              speculative_config={"model": random_draft, "num_speculative_tokens": 2, "draft_length_policy": "fixed"})
    draft = llm.llm_engine.executor.driver_worker.draft_worker
    llm.sleep(level=level)
    assert draft.sleep_level == level and draft.cache_engine.released
    llm.wake_up()
    assert draft.sleep_level == 0 and not draft.cache_engine.released
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == ref
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_drafts_that_cannot_serve_are_refused(tmp_path, random_draft):
    with pytest.raises(ValueError, match="vocabulary of 100 tokens, the target 49152"):
        LLM(max_model_len=256, num_gpu_blocks_override=16,
            speculative_config={"model": _random_draft(tmp_path / "v", vocab_size=100)})
    with pytest.raises(ValueError, match="max_model_len=128 is more than the 64 positions the draft"):
        LLM(max_model_len=256, num_gpu_blocks_override=16,
            speculative_config={"model": _random_draft(tmp_path / "short", max_positions=64), "max_model_len": 128})
    with pytest.raises(ValueError, match="speculative_config.model: Model path .* does not exist"):
        LLM(max_model_len=256, num_gpu_blocks_override=16, speculative_config={"model": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        LLM(max_model_len=256, num_gpu_blocks_override=16, tensor_parallel_size=2,
            speculative_config={"model": random_draft})


def test_the_draft_runs_like_the_target_unless_told():
    """The draft worker's config: the target's CUDA graph setting, or speculative_config.enforce_eager's."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.spec_decode.draft_checkpoint import draft_engine_config

    for target_eager, draft_eager, want in ((False, None, False), (True, None, True), (False, True, True)):
        spec = {"model": "/m", **({} if draft_eager is None else {"enforce_eager": draft_eager})}
        config = EngineArgs(enforce_eager=target_eager, speculative_config=spec).create_engine_config(256)
        assert draft_engine_config(config).model_config.enforce_eager is want


@pytest.mark.cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_draft_checkpoint_greedy_identical(tmp_path, enforce_eager):
    """On CUDA (float32; the target's steps in CUDA graphs, the draft's passes replaying its own, or eager with
    speculative_config.enforce_eager): a random 2-layer target with a copy of itself as the draft accepts nearly
    every draft, and a different random draft accepts few; both give plain decoding's greedy tokens."""
    target = _random_draft(tmp_path / "target")
    other = _random_draft(tmp_path / "other", seed=1)
    import shutil

    twin = shutil.copytree(target, tmp_path / "twin")
    prompts = [[5, 9, 3, 17, 22, 40, 7, 8, 11, 12, 13, 60], list(range(3, 30)), [99, 98, 97, 96, 95, 94]]
    kw = dict(model=target, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64, dtype=F32,
              device="cuda")

    def run(spec):
        llm = LLM(speculative_config=spec, **kw)
        replays = []
        if spec is not None:
            graphs = llm.llm_engine.executor.driver_worker.draft_worker.model_runner.graph_runner
            assert (graphs is None) == enforce_eager
            if graphs is not None:
                run_graph = graphs.run
                graphs.run = lambda *a, **k: replays.append(1) or run_graph(*a, **k)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        if not enforce_eager:  # the draft's graphs and kernels were all built at start-up (an eager draft's are not)
            assert not llm.llm_engine.executor.driver_worker.model_runner.compile_watch.events
        return [list(o.outputs[0].token_ids) for o in outs], llm.stats(), len(replays)

    ref, _, _ = run(None)
    for draft, min_rate in ((str(twin), 0.9), (other, 0.0)):
        outs, st, replays = run({"model": draft, "num_speculative_tokens": 3, "draft_length_policy": "fixed",
                                 "enforce_eager": enforce_eager})
        assert outs == ref
        assert st["spec_decode_num_draft_tokens"] > 0
        assert st["spec_decode_num_accepted_tokens"] >= min_rate * st["spec_decode_num_draft_tokens"]
        assert (replays > 0) != enforce_eager  # the draft's one-token passes replayed its decode graphs


def test_a_short_draft_drafts_within_its_context(reference, tmp_path):
    """A draft of 40 positions (its own config's 64, capped by speculative_config.max_model_len) for ~25-token
    prompts growing by 20: drafts while a sequence is within 40 tokens, decodes on without drafts past them, and the
    outputs are plain decoding's."""
    prompts, ref = reference
    spec = {"model": _random_draft(tmp_path / "short", max_positions=64), "max_model_len": 40,
            "num_speculative_tokens": 3, "draft_length_policy": "fixed"}
    llm = LLM(max_model_len=256, dtype=F32, num_gpu_blocks_override=64, speculative_config=spec)
    lengths = []
    propose = llm.llm_engine.spec_decoder.draft.propose

    def recording(seqs, k):
        lengths.extend(s.get_len() + n - 2 for s, n in zip(seqs, k))  # the last position the draft runs
        return propose(seqs, k)

    llm.llm_engine.spec_decoder.draft.propose = recording
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == ref
    assert max(lengths) == 39  # up to the draft's last position, never past it
    assert max(len(p) + 20 for p in prompts) > 40  # the sequences did go past the draft's context


def test_a_draft_model_is_kept_only_while_it_measures_faster(random_draft):
    """Drafts from a model cost passes the goodput rule does not fully price (BENCHMARKS.md §88.6): such an engine
    measures speculating and plain steps and runs the faster (spec_decode/mode.py), even without asynchronous
    scheduling; a synchronous n-gram engine speculates per sequence only."""
    kw = dict(max_model_len=256, dtype=F32, num_gpu_blocks_override=16)
    drafted = LLM(speculative_config={"model": random_draft, "num_speculative_tokens": 2}, **kw)
    assert not drafted.llm_engine.async_scheduling and drafted.llm_engine.spec_decoder.mode is not None
    ngram = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kw)
    assert ngram.llm_engine.spec_decoder.mode is None
