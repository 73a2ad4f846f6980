"""vLLM's --cpu-offload-gb: clear errors where it cannot apply (CPU tests), and on a GPU the same greedy tokens with
part of the weights in pinned host memory, eager and through CUDA graphs, with the freed memory in the KV pool."""
from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs


@pytest.mark.parametrize("kwargs, message", [
    (dict(cpu_offload_gb=2, device="cpu"), "on the CPU device all of them are there already"),
    (dict(cpu_offload_gb=-1), "cpu_offload_gb must be a number of GiB >= 0, got -1"),
    (dict(cpu_offload_gb="2"), "cpu_offload_gb must be a number of GiB >= 0, got '2'"),
    (dict(cpu_offload_gb=2, device="cuda", enable_sleep_mode=True), "with enable_sleep_mode: not supported"),
])
def test_cpu_offload_is_refused_where_it_cannot_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)._checked_cpu_offload_gb()


def test_cpu_offload_flag_on_the_cpu_device_is_a_clear_error_before_loading():
    with pytest.raises(ValueError, match="cpu_offload_gb=1.5: it keeps part of a GPU's weights in host memory"):
        LLM(device="cpu", cpu_offload_gb=1.5)


def _meta_llama(tie: bool):
    from transformers import LlamaConfig

    from pagedllm.distributed.parallel_state import TensorParallelGroup
    from pagedllm.model.meta_build import build_on_meta
    from pagedllm.model.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return build_on_meta(lambda: LlamaForCausalLM(cfg, TensorParallelGroup(), torch.bfloat16))


def test_the_plan_takes_whole_layers_from_the_first_until_the_budget():
    """The planning half of offloading (the copies need a GPU): the same on the meta-built model as after loading."""
    from pagedllm.worker.cpu_offload import decoder_layers, host_parameters, plan_offload

    model = _meta_llama(tie=True)
    layers = decoder_layers(model)
    assert layers is model.model.layers
    layer_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    total, plans = plan_offload(model, budget_bytes=2 * layer_bytes + 1)  # passed on the 3rd layer
    assert total == 6 and [layer for layer, _ in plans] == list(layers[:3])
    for layer, placed in plans:
        offsets = [offset for _, offset in placed]
        assert offsets == sorted(offsets) and all(o % 256 == 0 for o in offsets)
        assert {id(slot.get()) for slot, _ in placed} == {id(p) for p in layer.parameters()}
    on_host = host_parameters(model, 2 * layer_bytes + 1)
    assert on_host == {id(p) for layer in layers[:3] for p in layer.parameters()}
    assert id(model.model.embed_tokens.weight) not in on_host  # tied to the LM head: used outside the layers
    assert host_parameters(model, 0) == set() and plan_offload(model, layer_bytes)[1][0][0] is layers[0]


class _Block(torch.nn.Module):
    """A layer with the three kinds of weight offloading moves: a parameter, a buffer, an fp8-style attribute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.register_buffer("shift", torch.randn(width))
        self.fp8_weight = torch.randn(width, width)

    def forward(self, x):
        return torch.tanh(self.proj(x) + x @ self.fp8_weight.T + self.shift)


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 32, depth: int = 5) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        self.layers[4].proj.weight = self.embed.weight  # tied: must stay where it is

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_offloaded_layers_compute_the_same_through_one_shared_buffer():
    """The copy mechanics on the CPU (pin_memory=False): every offloaded tensor becomes a view into one buffer, the
    pre-hook fills it from the layer's own host copy before the layer runs, and the output does not change."""
    from pagedllm.worker.cpu_offload import offload_layers_to_cpu

    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(3, 32)
    with torch.no_grad():
        want = model(x)
    per_layer = 2 * 32 * 32 * 4 + 32 * 4
    report = offload_layers_to_cpu(model, 3 * per_layer, torch.device("cpu"), pin_memory=False)
    assert report.layers == 3 and report.total_layers == 5 and report.offloaded_bytes == 3 * per_layer
    bases = {t.untyped_storage().data_ptr() for layer in model.layers[:3]
             for t in (layer.proj.weight, layer.shift, layer.fp8_weight)}
    assert len(bases) == 1  # all in the one staging buffer
    assert model.layers[3].proj.weight.untyped_storage().data_ptr() not in bases
    assert isinstance(model.layers[0].proj.weight, torch.nn.Parameter)  # the Parameter kept, its data swapped
    with torch.no_grad():
        assert torch.equal(model(x), want)
        assert torch.equal(model(x), want)  # the buffer refilled each time
    tied = offload_layers_to_cpu(_Stack(), 10 * per_layer, torch.device("cpu"), pin_memory=False)
    assert tied.layers == 5 and tied.offloaded_bytes == 5 * per_layer - 32 * 32 * 4  # the tied weight stayed


# -- CUDA (pytest -m cuda tests/test_cpu_offload.py) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def mid_llama_dir(tmp_path_factory) -> str:
    """8 layers of 15.2 M float32 parameters (60.8 MB each): big enough that what offloading frees shows in the pool."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024,
                      initializer_range=0.1, tie_word_embeddings=True, bos_token_id=0, eos_token_id=4095)
    path = tmp_path_factory.mktemp("mid_llama")
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 180)), [7] * 33, list(range(300, 301))]


def _run(model_dir: str, **kw) -> tuple[list[list[int]], dict]:
    kw = {"dtype": "float32", **kw}
    llm = LLM(model_dir, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.3, **kw)
    worker = llm.llm_engine.executor.driver_worker
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    facts = {"blocks": llm.stats()["kv_blocks_total"], "model_bytes": worker.model_memory_bytes,
             "load_peak": worker.model_load_peak_bytes,
             "report": worker.cpu_offload,
             "block_bytes": 2 * sum(k[0].numel() * k[0].element_size() for k, _ in worker.cache_engine.slot_gpu_cache)}
    del llm, worker
    gc.collect()
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], facts


@pytest.mark.cuda
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_offloaded_layers_give_the_same_tokens_and_a_larger_pool(mid_llama_dir, enforce_eager):
    base_tokens, base = _run(mid_llama_dir, enforce_eager=enforce_eager)
    tokens, off = _run(mid_llama_dir, enforce_eager=enforce_eager, cpu_offload_gb=0.25)
    report = off["report"]
    assert base["report"] is None and report is not None
    assert report.layers == 5 and report.total_layers == 8  # 60.8 MB a layer: 0.25 GiB is passed on the 5th
    assert tokens == base_tokens  # the same weights through the staging buffer; graph replays copy them in again
    assert off["model_bytes"] <= base["model_bytes"] - 0.95 * report.saved_bytes
    # the offloaded layers were built in host memory: loading never held them on the GPU
    assert off["load_peak"] <= base["load_peak"] - 0.95 * report.saved_bytes
    assert off["blocks"] - base["blocks"] >= 0.8 * report.saved_bytes / off["block_bytes"]


@pytest.mark.cuda
def test_cuda_fp8_weights_are_offloaded_too(mid_llama_dir):
    """--quantization fp8 keeps each linear's weight in attributes, not parameters: those are what is offloaded."""
    kw = dict(dtype="bfloat16", quantization="fp8")
    base_tokens, base = _run(mid_llama_dir, **kw)
    tokens, off = _run(mid_llama_dir, cpu_offload_gb=0.03, **kw)
    report = off["report"]
    assert report is not None and report.layers >= 2 and report.offloaded_bytes >= 0.03 * 2**30
    assert tokens == base_tokens
    assert off["model_bytes"] <= base["model_bytes"] - 0.95 * report.saved_bytes


@pytest.mark.cuda
def test_cuda_load_weights_is_refused_on_offloaded_layers(mid_llama_dir):
    llm = LLM(mid_llama_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=512, num_gpu_blocks_override=64,
              enforce_eager=True, cpu_offload_gb=0.1)
    worker = llm.llm_engine.executor.driver_worker
    name, tensor = next(iter(worker.model.state_dict().items()))
    with pytest.raises(ValueError, match="load_weights cannot replace weights offloaded with cpu_offload_gb"):
        worker.load_weights([(name, tensor)])
    del llm, worker
    gc.collect()
    torch.cuda.empty_cache()
