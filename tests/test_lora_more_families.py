"""LoRA adapters (vLLM's --enable-lora) on the families beyond Llama: the LayerNorm ones (GPT-NeoX, Phi, StableLM,
StarCoder2: models/gpt_neox.py) and the Llama variants (Granite, OLMo 2, SmolLM3, Phi-3's fused modules).

Each family is a tiny random-weight transformers model; its PEFT adapters (random, nonzero lora_B) target the
family's own module names: GPT-NeoX's fused, per-head interleaved `query_key_value` (split over our q, k and v
slices), Phi's `dense` / `fc1` / `fc2`, StarCoder2's `c_fc` / `c_proj`, Llama's names on the others. Greedy float32
tokens with each adapter must equal transformers + peft's, and a request without one the base model's, all in one
batch. An adapter naming a module the family does not have is a ValueError naming it and what the family serves.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from test_models_hf import VOCAB, Family, _random_model  # noqa: E402

from pagedllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedllm.kernels.cpu_kernels import load_cpu_kernels  # noqa: E402
from pagedllm.model.cpu_direct_forward import DIRECT_FORWARD_ENV  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LLAMA_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager")
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name → (the family, the PEFT target modules of its first adapter (all it serves), of its second (a few))
FAMILIES: dict[str, tuple[Family, list[str], list[str]]] = {
    # Parallel residual, RoPE on 4 of 16 dims, the fused interleaved query_key_value (MHA: GPT-NeoX has no GQA).
    "gpt-neox": (Family("GPTNeoXConfig", "GPTNeoXForCausalLM", {
        **_SHAPE, "num_key_value_heads": 4, "rotary_pct": 0.25, "use_parallel_residual": True},
        "GPTNeoXForCausalLM"),
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], ["query_key_value", "dense_4h_to_h"]),
    # One LayerNorm feeding attention and MLP in parallel, GQA, biased dense and LM head.
    "phi": (Family("PhiConfig", "PhiForCausalLM", {**_SHAPE, "partial_rotary_factor": 0.5}, "PhiForCausalLM"),
            ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"], ["v_proj", "dense", "fc1"]),
    # Sequential blocks, q/k/v biases, SwiGLU (Llama's names).
    "stablelm": (Family("StableLmConfig", "StableLmForCausalLM", {
        **_SHAPE, "partial_rotary_factor": 0.25, "use_qkv_bias": True, "use_parallel_residual": False},
        "StableLmForCausalLM"), LLAMA_NAMES, ["k_proj", "up_proj"]),
    # A window of 8 on every layer (prompts up to 17 plus 10 generated), biases everywhere, tied head.
    "starcoder2": (Family("Starcoder2Config", "Starcoder2ForCausalLM", {
        **_SHAPE, "sliding_window": 8, "use_bias": True}, "Starcoder2ForCausalLM"),
        ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"], ["q_proj", "c_proj"]),
    # The four multipliers far from 1, biases on q/k/v/o and the MLP (untied: tied, this tiny model only repeats
    # each prompt's last token, with or without an adapter).
    "granite": (Family("GraniteConfig", "GraniteForCausalLM", {
        **_SHAPE, "embedding_multiplier": 4.0, "residual_multiplier": 0.4, "attention_multiplier": 0.09,
        "logits_scaling": 2.5, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
        "GraniteForCausalLM"), LLAMA_NAMES, ["q_proj", "down_proj"]),
    # Post-norms and whole-projection q/k norms (after qkv_proj: the adapter's q and k deltas are normalised too).
    "olmo2": (Family("Olmo2Config", "Olmo2ForCausalLM", {**_SHAPE, "attention_bias": True}, "Olmo2ForCausalLM"),
              LLAMA_NAMES, ["k_proj", "gate_proj"]),
    # Phi-3's fused checkpoint modules (PEFT names them): an adapter's B on qkv_proj / gate_up_proj is split as the weight.
    "phi3": (Family("Phi3Config", "Phi3ForCausalLM", {**_SHAPE, **_IDS}, "Phi3ForCausalLM"),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "down_proj"]),
    # Layer 1 without RoPE, windowed; biases; tied head.
    "smollm3": (Family("SmolLM3Config", "SmolLM3ForCausalLM", {
        **_SHAPE, "no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 8, "attention_bias": True,
        "mlp_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **_IDS},
        "SmolLM3ForCausalLM"), LLAMA_NAMES, ["o_proj", "up_proj"]),
}
DIRECT_FORWARD_FAMILIES = tuple(FAMILIES)  # the CPU direct forward runs every one (each also on the module path)

MAX_TOKENS = 10
PROMPT_LENS = (3, 9, 17)
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", enable_lora=True, max_loras=2,
              max_lora_rank=8, num_gpu_blocks_override=64, block_size=4)


def _make_adapter(base, path: Path, seed: int, targets: list[str], rank: int = 8):
    """A random PEFT adapter (lora_A and lora_B drawn, so it changes the outputs) on a copy of `base`, saved to
    `path`; → the PeftModel, the reference."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return model.eval()


def _reference(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class Built:
    def __init__(self, root: Path, name: str) -> None:
        family, all_targets, few_targets = FAMILIES[name]
        self.base = root / "base"
        self.hf = _random_model(family)
        self.hf.generation_config.eos_token_id = None  # ignore_eos on our side
        self.hf.save_pretrained(self.base, safe_serialization=True)
        gen = torch.Generator().manual_seed(3)
        self.prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        self.loras: list[LoRARequest | None] = [None]
        self.refs: dict[int, list[list[int]]] = {0: [_reference(self.hf, p) for p in self.prompts]}
        self.adapter_dirs: dict[int, Path] = {}
        for lid, targets in ((1, all_targets), (2, few_targets)):
            path = root / f"adapter{lid}"
            peft_model = _make_adapter(self.hf, path, seed=10 + lid, targets=targets)
            self.loras.append(LoRARequest(f"{name}-{lid}", lid, str(path)))
            self.refs[lid] = [_reference(peft_model, p) for p in self.prompts]
            self.adapter_dirs[lid] = path


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = Built(tmp_path_factory.mktemp(f"lora-{name}"), name)
        return cache[name]

    return get


def _generate(llm: LLM, prompts: list[list[int]], loras: list) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)


_CASES = [(name, False) for name in FAMILIES] + [(name, True) for name in DIRECT_FORWARD_FAMILIES]


@pytest.mark.parametrize("name,direct_forward", _CASES,
                         ids=[f"{n}-direct" if d else n for n, d in _CASES])
def test_adapters_match_peft_and_base_requests_match_the_base_model(name: str, direct_forward: bool, build,
                                                                    monkeypatch) -> None:
    """Two adapters and none mixed in one batch: each request's tokens equal transformers + peft's with its adapter
    (transformers alone without one)."""
    monkeypatch.setenv(DIRECT_FORWARD_ENV, "1" if direct_forward else "0")
    built = build(name)
    llm = LLM(str(built.base), **ENGINE)
    worker = llm.llm_engine.executor.driver_worker
    assert type(worker.model).__name__ == FAMILIES[name][0].ours
    # The direct forward where asked for and the native kernels load (it adds each GEMM's deltas itself).
    direct = direct_forward and load_cpu_kernels() is not None
    assert (worker.model_runner.direct_forward is not None) == direct
    step_stats = worker.model_runner.enable_step_stats()
    prompts = [p for p in built.prompts for _ in built.loras]
    loras = [lora for _ in built.prompts for lora in built.loras]
    outs = _generate(llm, prompts, loras)
    assert {path for _, path, *_ in step_stats.records} == {"direct" if direct else "eager"}
    for i, (lora, out) in enumerate(zip(loras, outs)):
        lid = 0 if lora is None else lora.lora_int_id
        want = built.refs[lid][i // len(built.loras)]
        assert list(out.outputs[0].token_ids) == want, (name, lid, len(prompts[i]))
        assert out.lora_request == lora
    # Every adapted layer of the all-targets adapter is hooked; each adapter moves the outputs (the test could fail).
    adapter = worker.lora_manager.adapters[1]
    assert set(adapter.layers) <= set(worker.lora_manager.modules)
    assert len(adapter.layers) == 2 * len({worker.lora_manager.targets.modules[t] for t in FAMILIES[name][1]})
    for lid in (1, 2):
        assert built.refs[lid] != built.refs[0], f"{name}: adapter {lid} does not change transformers' tokens"


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_adapters_match_peft(name: str, build) -> None:
    """The same batch on the GPU (float32, CUDA graphs): the families' adapter placement under the graph-captured
    LoRA GEMMs."""
    built = build(name)
    llm = LLM(str(built.base), **{**ENGINE, "device": "cuda", "block_size": 16})
    prompts = [p for p in built.prompts for _ in built.loras]
    loras = [lora for _ in built.prompts for lora in built.loras]
    for i, (lora, out) in enumerate(zip(loras, _generate(llm, prompts, loras))):
        lid = 0 if lora is None else lora.lora_int_id
        assert list(out.outputs[0].token_ids) == built.refs[lid][i // len(built.loras)], (name, lid, len(prompts[i]))


def test_gpt_neox_query_key_value_is_split_over_q_k_v(build) -> None:
    """The interleaved [head, (q, k, v), head_dim] rows of query_key_value's B land on our q, k and v slices, each
    with the same A (the scaling, lora_alpha / r = 2, folded into B)."""
    from safetensors.torch import load_file

    built = build("gpt-neox")
    llm = LLM(str(built.base), **ENGINE)
    _generate(llm, [built.prompts[0]], [built.loras[1]])
    adapter = llm.llm_engine.executor.driver_worker.lora_manager.adapters[1]
    saved = load_file(str(built.adapter_dirs[1] / "adapter_model.safetensors"))
    prefix = "base_model.model.gpt_neox.layers.1.attention.query_key_value"
    a, b = saved[f"{prefix}.lora_A.weight"], saved[f"{prefix}.lora_B.weight"]
    layer = adapter.layers["model.layers.1.self_attn.qkv_proj"]
    per_head = b.view(4, 3, 16, 8)
    assert [(offset, rows) for offset, rows, *_ in layer.slices] == [(0, 64), (64, 64), (128, 64)]
    for j, (_, _, r0, r1, b_j) in enumerate(layer.slices):
        torch.testing.assert_close(layer.a[r0:r1], a, rtol=0, atol=0)
        torch.testing.assert_close(b_j, 2 * per_head[:, j].reshape(64, 8), rtol=0, atol=0)


def _renamed_adapter(src: Path, dst: Path, old: str, new: str) -> Path:
    """A copy of the adapter at `src` whose tensor names (and target_modules) have `old` replaced by `new`."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = load_file(str(src / "adapter_model.safetensors"))
    renamed = {k.replace(old, new): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(dst / "adapter_model.safetensors"))
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["target_modules"] = sorted({t.replace(old.strip("."), new.strip(".")) for t in cfg["target_modules"]})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


# (family, a module name of its adapter, a name the family's checkpoints do not have, the family's served names)
_FOREIGN = [
    ("gpt-neox", ".dense_h_to_4h.", ".q_proj.", "query_key_value, dense, dense_h_to_4h, dense_4h_to_h"),
    # `o_proj` is our layer's name, but no Phi checkpoint module's: refused, not mapped.
    ("phi", ".dense.", ".o_proj.", "q_proj, k_proj, v_proj, dense, fc1, fc2"),
    ("stablelm", ".up_proj.", ".fc1.", ", ".join(LLAMA_NAMES)),
    ("starcoder2", ".c_fc.", ".gate_proj.", "q_proj, k_proj, v_proj, o_proj, c_fc, c_proj"),
    ("olmo2", ".down_proj.", ".c_proj.", ", ".join(LLAMA_NAMES)),
]


@pytest.mark.parametrize("name,old,new,allowed", _FOREIGN, ids=[f[0] for f in _FOREIGN])
def test_an_adapter_on_a_module_the_family_lacks_is_a_clear_error(name: str, old: str, new: str, allowed: str,
                                                                  build, tmp_path: Path) -> None:
    built = build(name)
    bad = _renamed_adapter(built.adapter_dirs[1], tmp_path / "bad", old, new)
    llm = LLM(str(built.base), **ENGINE)
    ours = FAMILIES[name][0].ours
    module = new.strip(".")
    with pytest.raises(ValueError, match=rf"{ours} has no LoRA target module '{module}'; it serves LoRA on "
                                         rf"{allowed} only"):
        _generate(llm, [built.prompts[0]], [LoRARequest("bad", 9, str(bad))])
    # A layer the model does not have (a third layer of two) names the module and ours.
    if name == "gpt-neox":
        deep = _renamed_adapter(built.adapter_dirs[2], tmp_path / "deep", ".layers.1.", ".layers.2.")
        with pytest.raises(ValueError, match=r"adapts 'gpt_neox\.layers\.2\.attention\.query_key_value' \(our "
                                             r"'model\.layers\.2\.self_attn\.qkv_proj'\), which this "
                                             r"GPTNeoXForCausalLM does not have"):
            _generate(llm, [built.prompts[0]], [LoRARequest("deep", 10, str(deep))])
    # The engine serves on: the good adapter still matches peft.
    assert not llm.llm_engine.has_unfinished_requests()
    out = _generate(llm, [built.prompts[0]], [built.loras[1]])[0]
    assert list(out.outputs[0].token_ids) == built.refs[1][0]
