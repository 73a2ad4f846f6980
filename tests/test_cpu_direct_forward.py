"""The CPU direct forward (model/cpu_direct_forward.py) against the module path it replaces: bit-identical,
with GGUF linears (served quantized) and with dense float32 ones (oneDNN's packed GEMMs)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.model.cpu_direct_forward import (
    DIRECT_FORWARD_ENV,
    DirectForward,
    LlamaDirectForward,
    direct_forward_enabled,
)
from pagedllm.worker.model_input import SequenceChunk


@pytest.fixture(scope="module", params=["gguf", "none"])
def llm(request):
    from pagedllm import LLM

    return LLM(quantization=request.param, num_gpu_blocks_override=128, max_num_seqs=4)


def _runner(llm):
    return llm.llm_engine.executor.driver_worker.model_runner


def _generate(llm, prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1 if i == 0
                             else None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def _assert_direct_equals_module_path(llm, prompts) -> DirectForward:
    """Every step of `prompts` runs the direct forward (of any family), and the module path gives exactly the same
    outputs."""
    runner = _runner(llm)
    direct = runner.direct_forward
    assert isinstance(direct, DirectForward)
    stats = runner.enable_step_stats()
    try:
        got = _generate(llm, prompts)  # prefill, mixed and decode steps of up to 4 sequences, prompt logprobs
        paths = {path for _, path, *_ in stats.records}
        runner.direct_forward = None
        ref = _generate(llm, prompts)
    finally:
        runner.direct_forward = direct
        runner.step_stats = None
    assert paths == {"direct"}
    assert got == ref  # token ids, sampled and prompt log-probs: exactly equal
    return direct


def attach_q8_0_linears(model) -> int:
    """Every decoder linear served as Q8_0 GGUF blocks, as ``--quantization gguf`` leaves a model (quantized here from
    the float32 weights: no GGUF file needed; biases kept, added after the C GEMM); gated (gate_up/down) or plain
    (fc1/fc2) MLPs → how many."""
    import gguf

    from pagedllm.kernels.cpu_quant import GGUFWeight

    n = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *((mlp.gate_up_proj, mlp.down_proj)
                    if hasattr(mlp, "gate_up_proj") else (mlp.fc1, mlp.fc2))):
            lin.restore_dense_weight()
            w = lin.weight.detach().float().contiguous()
            blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
            lin.gguf_weight = GGUFWeight.from_gguf_blocks(torch.from_numpy(blocks), int(gguf.GGMLQuantizationType.Q8_0),
                                                          *w.shape)
            n += 1
    return n


def test_direct_forward_is_bit_identical_to_the_module_path(llm, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):\n    ",
                                              "Once upon a time, in a small village by the sea,", "Hello")]
    _assert_direct_equals_module_path(llm, prompts)


def test_long_prompt_chunks_take_the_module_path(llm, tokenizer, monkeypatch):
    """Steps with a chunk the native attention does not take (torch's SDPA does) run the module path."""
    runner = _runner(llm)
    prompt = tokenizer.encode("Water boils at a temperature of")
    stats = runner.enable_step_stats()
    try:
        monkeypatch.setattr(runner.attn_backend, "max_native_query_len", 4)
        got = _generate(llm, [prompt])
        paths = [path for _, path, *_ in stats.records]
        monkeypatch.setattr(runner, "direct_forward", None)
        ref = _generate(llm, [prompt])
    finally:
        runner.step_stats = None
    assert paths[0] == "eager" and set(paths[1:]) == {"direct"}
    assert got == ref


def test_bad_indices_are_refused_before_any_kernel_runs(llm):
    runner = _runner(llm)
    kv = llm.llm_engine.executor.driver_worker.cache_engine.gpu_cache
    num_blocks = kv[0][0].shape[0]
    for table, match in (([num_blocks + 5], "slot_mapping holds slots beyond|block_tables hold ids"),):
        ids, pos, meta, _ = runner.prepare_inputs([SequenceChunk(0, [1, 2], 0, table, sample=True)])
        with pytest.raises(ValueError, match=match):
            runner.direct_forward(ids, pos, kv, meta)
    ids, pos, meta, _ = runner.prepare_inputs([SequenceChunk(0, [1, 2], 0, [0], sample=True)])
    with pytest.raises(ValueError, match="int64"):
        runner.direct_forward(ids.to(torch.int32), pos, kv, meta)
    with pytest.raises(ValueError, match="KV caches"):
        runner.direct_forward(ids, pos, kv[:-1], meta)


def test_built_only_where_it_applies(llm, monkeypatch):
    runner = _runner(llm)
    model = runner.model
    from pagedllm.model.layers.attention import TorchAttentionBackend

    assert LlamaDirectForward.build(model, TorchAttentionBackend()) is None
    down = model.model.layers[3].mlp.down_proj
    if down.gguf_weight is not None:
        monkeypatch.setattr(down, "gguf_weight", None)  # one dense linear among GGUF ones
        assert LlamaDirectForward.build(model, runner.attn_backend) is None
    else:
        monkeypatch.setattr(down.weight, "data", down.weight.data.to(torch.bfloat16))  # not float32
        assert LlamaDirectForward.build(model, runner.attn_backend) is None
    monkeypatch.undo()
    assert LlamaDirectForward.build(model, runner.attn_backend) is not None
    monkeypatch.setenv(DIRECT_FORWARD_ENV, "0")
    assert not direct_forward_enabled() and LlamaDirectForward.build(model, runner.attn_backend) is None
    monkeypatch.setenv(DIRECT_FORWARD_ENV, "maybe")
    with pytest.raises(ValueError, match=DIRECT_FORWARD_ENV):
        direct_forward_enabled()


def test_decode_step_benchmark_runs_both_paths(tmp_path, monkeypatch):
    """`pagedllm bench cpu-decode-step` at a tiny scale: both paths timed, same tokens, kernels timed."""
    import argparse
    import json

    from pagedllm.benchmarks import cpu_decode_step

    monkeypatch.setenv("PAGEDLLM_GGUF_QUANTIZATION", "gguf")  # the engine's default outside the test suite
    parser = argparse.ArgumentParser()
    cpu_decode_step.add_args(parser)
    out = tmp_path / "step.json"
    args = parser.parse_args(["--num-prompts", "1", "--output-len", "4", "--output-json", str(out)])
    assert cpu_decode_step.run(args) == 0
    res = json.loads(out.read_text())
    assert res["identical_tokens"] is True
    for path in ("direct", "module"):
        assert res[path]["decode_steps"] == 3  # 4 tokens: one from the prefill, three decode steps
        ms = res[path]["ms_per_step"]
        assert ms["forward"] > 0 and ms["step"] >= ms["forward"] + ms["lm_head"]
    k = res["kernels_ms"]
    assert {"120 layer linears (C)", "lm_head linear (C)", "direct forward, 1 token"} <= set(k)
    assert k["direct forward, 1 token"] > k["  linears skipped"] > k["  every kernel skipped (Python)"] > 0


@pytest.mark.parametrize("weights", ["float32", "gguf-q8"])
def test_qwen3_per_head_norms_run_direct_and_bit_identical(weights, tmp_path, monkeypatch):
    """Qwen3's q/k norms in the direct forward (one C call per kind and layer, in place in the qkv rows): the
    same bits as the module path, with dense float32 linears and with Q8_0 GGUF ones."""
    from test_gguf_qwen import PROMPTS, _hf_model, write_qwen_gguf

    from pagedllm import LLM

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    model = _hf_model("qwen3")
    if weights == "float32":
        model.save_pretrained(tmp_path / "hf", safe_serialization=True)
        llm = LLM(model=str(tmp_path / "hf"), skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=32,
                  max_model_len=128, device="cpu", swap_space=0.01)
    else:
        src = write_qwen_gguf(model, "qwen3", tmp_path / "q8.gguf", q8_linears=True)
        llm = LLM(model=str(src), skip_tokenizer_init=True, quantization="gguf", num_gpu_blocks_override=32,
                  max_model_len=128, device="cpu", swap_space=0.01)
    direct = _assert_direct_equals_module_path(llm, [{"prompt_token_ids": p} for p in PROMPTS])
    assert direct.layers[0].q_norm != 0
