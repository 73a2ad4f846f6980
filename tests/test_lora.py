"""Multi-LoRA (vLLM's --enable-lora): requests with different PEFT adapters, and none, share one batch.

The reference is transformers with the adapter merged by peft (`merge_and_unload`) on the same base weights:
each request's greedy tokens must equal its own adapter's reference, whatever shares its batch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from pagedllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from tiny_models import save_tiny_llama  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 300, 2, 9], list(range(40, 90)), [7, 7, 8], list(range(200, 230))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", enable_lora=True, max_loras=2)


def make_adapter(base_model, path: Path, seed: int, targets: list[str], rank: int = 8, **cfg):
    """A random PEFT adapter on `base_model` (a fresh copy), saved to `path`; → the merged reference model."""
    import copy

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base_model), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **cfg))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return model.merge_and_unload().eval()


def greedy_reference(model, prompt: list[int], n: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base dir, base HF model, {lora id: (LoRARequest, merged reference)})."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(root / "base")
    hf = transformers.LlamaForCausalLM.from_pretrained(base).float().eval()
    adapters = {}
    for lid, (seed, targets) in enumerate([(1, ALL), (2, ["q_proj", "v_proj"])], start=1):
        path = root / f"adapter{lid}"
        merged = make_adapter(hf, path, seed, targets)
        adapters[lid] = (LoRARequest(f"a{lid}", lid, str(path)), merged)
    return base, hf, adapters


@pytest.mark.parametrize("direct_forward", [True, False], ids=["direct", "modules"])
def test_mixed_batch_matches_merged_references_under_preemption(tiny, direct_forward, monkeypatch):
    """On the CPU's direct forward (the deltas added after each GEMM) and on the module path (forward hooks)."""
    from pagedllm.model.cpu_direct_forward import DIRECT_FORWARD_ENV

    monkeypatch.setenv(DIRECT_FORWARD_ENV, "1" if direct_forward else "0")
    base, hf, adapters = tiny
    loras = [None, adapters[1][0], adapters[2][0]]
    prompts = [p for p in PROMPTS for _ in loras]
    per_prompt = [r for _ in PROMPTS for r in loras]
    # device="cpu": the step paths asserted here are the CPU's (the CUDA test below covers the GPU).
    llm = LLM(base, **ENGINE, device="cpu", num_gpu_blocks_override=24, block_size=4, max_num_batched_tokens=32)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert (runner.direct_forward is not None) == direct_forward
    step_stats = runner.enable_step_stats()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=per_prompt, use_tqdm=False)
    assert {path for _, path, *_ in step_stats.records} == {"direct" if direct_forward else "eager"}
    for p, lora, out in zip(prompts, per_prompt, outs):
        ref = greedy_reference(hf if lora is None else adapters[lora.lora_int_id][1], p)
        assert list(out.outputs[0].token_ids) == ref, (lora, p[:5])
        assert out.lora_request == lora
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    # The adapters change the outputs: a test that could not fail would not say much.
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3


def test_prefix_cache_is_kept_apart_per_adapter(tiny):
    base, hf, adapters = tiny
    llm = LLM(base, **ENGINE, num_gpu_blocks_override=64, block_size=4, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    lora = adapters[1][0]
    with_lora = llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and with_lora.num_cached_tokens == 0  # the base model's blocks are not reused
    assert again.num_cached_tokens > 0
    ref = greedy_reference(adapters[1][1], PROMPTS[1])
    assert list(with_lora.outputs[0].token_ids) == list(again.outputs[0].token_ids) == ref


def test_adapters_beyond_max_cpu_loras_are_reloaded(tiny):
    base, _, adapters = tiny
    llm = LLM(base, **{**ENGINE, "max_loras": 1}, num_gpu_blocks_override=64)
    worker = llm.llm_engine.executor.driver_worker
    for lid in (1, 2, 1):
        lora, merged = adapters[lid]
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=lora, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == greedy_reference(merged, PROMPTS[0])
        assert worker.lora_manager.list_loras() == [lid]


def test_a_step_mixes_at_most_max_loras_adapters(tiny):
    """Two adapters, one slot: the scheduler keeps the other adapter's requests waiting (passing over them: a base
    request queued behind them still joins), so no step holds both, and every request gets its own adapter's tokens."""
    base, hf, adapters = tiny
    llm = LLM(base, **{**ENGINE, "max_loras": 1, "max_cpu_loras": 2}, num_gpu_blocks_override=64)
    manager = llm.llm_engine.executor.driver_worker.lora_manager
    steps: list[set[int]] = []
    set_mapping = manager.set_mapping

    def recording(lora_ids, num_tokens):
        steps.append(set(lora_ids))
        set_mapping(lora_ids, num_tokens)

    manager.set_mapping = recording
    loras = [adapters[1][0], adapters[2][0], None, adapters[1][0], adapters[2][0]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras, use_tqdm=False)
    for p, lora, out in zip(prompts, loras, outs):
        assert list(out.outputs[0].token_ids) == greedy_reference(hf if lora is None else adapters[lora.lora_int_id][1], p)
    assert max(len(s - {0}) for s in steps) == 1 and {1, 2} <= set().union(*steps)
    assert steps[0] == {0, 1}  # the base request behind the waiting adapter-2 request was not held up by it
    assert manager.num_slot_loads >= 2


def test_bad_adapters_and_configurations_are_clear_errors(tiny, tmp_path):
    base, hf, adapters = tiny
    plain = LLM(base, skip_tokenizer_init=True, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate({"prompt_token_ids": [1, 2]}, GREEDY, lora_request=adapters[1][0], use_tqdm=False)
    llm = LLM(base, **ENGINE, num_gpu_blocks_override=32, max_lora_rank=8)
    big = tmp_path / "rank16"
    make_adapter(hf, big, 3, ["q_proj"], rank=16)
    saved = tmp_path / "saves_head"
    make_adapter(hf, saved, 4, ["q_proj"], modules_to_save=["lm_head"])
    cases = [(LoRARequest("big", 7, str(big)), "rank 16, more than max_lora_rank=8"),
             (LoRARequest("nothing", 8, str(tmp_path / "missing")), "no adapter_config.json"),
             (LoRARequest("head", 9, str(saved)), "modules_to_save")]
    for lora, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, lora_request=lora, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=adapters[2][0], use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == greedy_reference(adapters[2][1], PROMPTS[0])
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/tmp")
    for kw, message in (({"speculative_config": {"method": "ngram"}}, "speculative decoding"),
                        ({"runner": "pooling"}, "pooling runner"),
                        ({"tensor_parallel_size": 2}, "tensor or pipeline parallelism"),
                        ({"pipeline_parallel_size": 2}, "tensor or pipeline parallelism")):
        with pytest.raises(ValueError, match=message):
            LLM(base, **ENGINE, num_gpu_blocks_override=32, **kw)


def test_bundled_model_with_an_adapter_matches_peft(tokenizer):
    """The real bundled model (dequantized, float32) with an adapter on every projection."""
    from transformers import AutoModelForCausalLM

    from pagedllm.model.gguf_loader import transformers_dense_gguf_kwargs
    from pagedllm.model.loader import default_model_path

    path = Path(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                              **transformers_dense_gguf_kwargs()).eval()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        merged = make_adapter(hf, Path(tmp), 5, ALL, rank=4)
        assert json.loads((Path(tmp) / "adapter_config.json").read_text())["r"] == 4
        llm = LLM(enable_lora=True, num_gpu_blocks_override=64)
        prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):")]
        lora = LoRARequest("smol", 1, tmp)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora, use_tqdm=False)
        base = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out, plain in zip(prompts, outs, base):
        assert list(out.outputs[0].token_ids) == greedy_reference(merged, p)
        assert list(plain.outputs[0].token_ids) == greedy_reference(hf, p)


@pytest.mark.cuda
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_cuda_mixed_batch_matches_merged_references(tiny, enforce_eager):
    """The adapters' GEMMs on the GPU, float32: captured in the decode, whole-step and piecewise graphs (the
    default), and eagerly."""
    base, hf, adapters = tiny
    loras = [None, adapters[1][0], adapters[2][0]]
    prompts = [p for p in PROMPTS for _ in loras]
    per_prompt = [r for _ in PROMPTS for r in loras]
    llm = LLM(base, **ENGINE, device="cuda", num_gpu_blocks_override=64, block_size=16, enforce_eager=enforce_eager)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert (runner.graph_runner is None) == enforce_eager
    stats = runner.enable_step_stats()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=per_prompt, use_tqdm=False)
    for p, lora, out in zip(prompts, per_prompt, outs):
        ref = greedy_reference(hf if lora is None else adapters[lora.lora_int_id][1], p)
        assert list(out.outputs[0].token_ids) == ref, (lora, p[:5])
    paths = {path for _, path, *_ in stats.records}
    assert ("eager" in paths) if enforce_eager else (paths <= {"graph", "whole", "piecewise"}), paths
