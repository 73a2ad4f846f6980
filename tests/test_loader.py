"""Tests for pagedllm.model.loader / gguf_loader (real default model + tiny synthetic checkpoints)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagedllm.model import gguf_loader  # noqa: E402
from pagedllm.model.loader import (  # noqa: E402
    DEFAULT_MODEL,
    default_model_path,
    get_rope_parameters,
    iterate_weights,
    load_config,
    prepare_model_dir,
    resolve_model,
)


@pytest.fixture(scope="session")
def converted_dir() -> Path:
    return prepare_model_dir(None)


# ------------------------------------------------------------------------------------------
# Synthetic GGUF helpers

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `permute` (HF layout -> GGUF layout), for q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, ff=96, vocab=128)


def tiny_hf_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, hd, ff, v = TINY["hidden"], TINY["head_dim"], TINY["ff"], TINY["vocab"]
    q, kv = TINY["heads"] * hd, TINY["kv_heads"] * hd
    w = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                  p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                  p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                  p + "mlp.down_proj.weight": (h, ff), p + "input_layernorm.weight": (h,),
                  p + "post_attention_layernorm.weight": (h,)})
    if not tied:
        w["lm_head.weight"] = (v, h)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in w.items()}


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama") -> Path:
    """Write an HF-layout state dict as a llama.cpp-style GGUF (q/k permuted; gate_proj as Q8_0)."""
    import gguf

    hf_to_gguf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                  "post_attention_layernorm": "ffn_norm"}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ff"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    for name, arr in weights.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            mod = rest.rsplit(".", 1)[0]
            gname = f"blk.{layer}.{hf_to_gguf[mod]}.weight"
        if "q_proj" in name:
            arr = llama_cpp_permute(arr, TINY["heads"])
        elif "k_proj" in name:
            arr = llama_cpp_permute(arr, TINY["kv_heads"])
        if "gate_proj" in name:
            w.add_tensor(gname, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(cache))
    return cache


# ------------------------------------------------------------------------------------------
# Model resolution

def test_default_model_path_and_resolution(tmp_path: Path) -> None:
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model(None) == path
    assert resolve_model(DEFAULT_MODEL) == path
    assert resolve_model(str(tmp_path)) == os.path.abspath(tmp_path)


def test_missing_and_invalid_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist") as exc:
        resolve_model(str(tmp_path / "nope"))
    msg = str(exc.value)
    assert "config.json" in msg and ".gguf" in msg and DEFAULT_MODEL in msg
    text_file = tmp_path / "weights.txt"
    text_file.write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(text_file))
    with pytest.raises(ValueError, match="config.json is missing"):
        prepare_model_dir(str(tmp_path))


def test_load_format_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="auto, gguf, safetensors, dummy"):
        prepare_model_dir(None, load_format="pt")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        prepare_model_dir(str(tmp_path), load_format="gguf")
    with pytest.raises(ValueError, match="needs a Hugging Face directory"):
        prepare_model_dir(None, load_format="safetensors")
    with pytest.raises(ValueError, match="dummy"):
        next(iterate_weights(tmp_path, load_format="dummy"))


# ------------------------------------------------------------------------------------------
# The real default model

def test_converted_config(converted_dir: Path) -> None:
    cfg = load_config(converted_dir)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 2)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert get_rope_parameters(cfg) == {"rope_type": "default", "rope_theta": 100000.0}


def test_converted_files(converted_dir: Path) -> None:
    from safetensors import safe_open

    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (converted_dir / name).is_file(), name
    gen = json.loads((converted_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    with safe_open(str(converted_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert len(keys) == 272 and "lm_head.weight" not in keys  # tied: not written
    tok_cfg = json.loads((converted_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "local_files_only" not in tok_cfg


def test_cache_reused(converted_dir: Path) -> None:
    t0 = time.perf_counter()
    again = prepare_model_dir(DEFAULT_MODEL)
    assert time.perf_counter() - t0 < 1.0
    assert again == converted_dir


def test_iterate_weights_default_model(converted_dir: Path) -> None:
    weights = dict(iterate_weights(converted_dir, use_tqdm=False))
    assert len(weights) == 272
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in weights.values())


@pytest.fixture(scope="module")
def hf_reference_state_dict() -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading + dequantisation of the same file (independent reference)."""
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                                 **gguf_loader.transformers_dense_gguf_kwargs())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_weights_equal_transformers_gguf(converted_dir: Path, hf_reference_state_dict: dict) -> None:
    ours = dict(iterate_weights(converted_dir, use_tqdm=False))
    ref = hf_reference_state_dict
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name in ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{m}" for i in (0, 17, 29) for m in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
            "input_layernorm.weight", "post_attention_layernorm.weight")
    ]:
        assert torch.equal(ours[name], ref[name]), name  # atol 0
    mismatched = [k for k in ours if not torch.equal(ours[k], ref[k])]
    assert not mismatched
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])


# ------------------------------------------------------------------------------------------
# Synthetic GGUF: permutation, quantisation, caching, errors

def test_tiny_gguf_roundtrip_undoes_permutation(tmp_path: Path, tmp_cache: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    import gguf

    hf = tiny_hf_weights(tied=False)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        out = prepare_model_dir(str(src), load_format="gguf")
    assert "Converting GGUF" in caplog.text
    assert out.parent == tmp_cache / "gguf"
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp dirs left behind
    got = {k: v.numpy() for k, v in iterate_weights(out, use_tqdm=False)}
    assert set(got) == set(hf)
    for name, expected in hf.items():
        if "gate_proj" in name:  # Q8_0: equals gguf's own quantise -> dequantise
            q8 = gguf.GGMLQuantizationType.Q8_0
            expected = gguf.quants.dequantize(gguf.quants.quantize(expected, q8), q8)
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
    cfg = load_config(out)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.vocab_size == 128 and cfg.tie_word_embeddings is False
    assert get_rope_parameters(cfg)["rope_theta"] == 50000.0


def test_tiny_gguf_cache_key_and_incomplete_cache(tmp_path: Path, tmp_cache: Path) -> None:
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights())
    first = prepare_model_dir(str(src))
    assert "lm_head.weight" not in {k for k, _ in iterate_weights(first, use_tqdm=False)}
    assert prepare_model_dir(str(src)) == first
    (first / gguf_loader.MARKER_FILE).unlink()  # looks like a half-written cache: redo it
    assert prepare_model_dir(str(src)) == first and (first / gguf_loader.MARKER_FILE).is_file()
    leftover = first.parent / f".tmp-{first.name}-999999999-abc"  # from a killed conversion (dead pid)
    leftover.mkdir()
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))  # source changed -> new key
    second = prepare_model_dir(str(src))
    assert second != first and second.is_dir()
    assert not first.exists()  # superseded cache of the same source removed
    assert [p.name for p in second.parent.iterdir()] == [second.name]  # stale temp dir was cleaned up


def test_conversion_crash_leaves_no_cache(tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights())

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(gguf_loader, "_write_tokenizer", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_model_dir(str(src))
    assert list((tmp_cache / "gguf").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_cache))
    assert (prepare_model_dir(str(src)) / "config.json").is_file()


def test_corrupt_and_truncated_gguf(tmp_path: Path, tmp_cache: Path) -> None:
    random_file = tmp_path / "random.gguf"
    random_file.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        prepare_model_dir(str(random_file))
    src = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights())
    data = src.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 100):
        truncated = tmp_path / f"truncated{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="is not a valid GGUF file") as exc:
            prepare_model_dir(str(truncated))
        assert str(truncated) in str(exc.value)
    assert not any((tmp_cache / "gguf").glob("*truncated*"))


def test_unsupported_architecture(tmp_path: Path, tmp_cache: Path) -> None:
    src = write_tiny_gguf(tmp_path / "other.gguf", tiny_hf_weights(), arch="falcon")
    with pytest.raises(ValueError, match="Unsupported GGUF architecture 'falcon'.*supported: llama, qwen2, qwen3"):
        prepare_model_dir(str(src))


# ------------------------------------------------------------------------------------------
# Hugging Face directories

@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(str(out), max_shard_size="200KB")
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_multi_shard_safetensors(sharded_dir: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = sharded_dir
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert prepare_model_dir(str(path)) == Path(os.path.abspath(path))
    assert load_config(path).num_hidden_layers == 3
    got = dict(iterate_weights(path, load_format="safetensors", use_tqdm=False))
    assert set(got) == set(index["weight_map"])
    for name, tensor in got.items():
        assert torch.equal(tensor, state[name]), name


def test_missing_and_corrupt_shard(sharded_dir: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path = tmp_path / "copy"
    shutil.copytree(sharded_dir[0], path)
    shards = sorted(path.glob("*.safetensors"))
    shards[-1].write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=f"Corrupt or unreadable safetensors file .*{shards[-1].name}"):
        list(iterate_weights(path, use_tqdm=False))
    shards[0].unlink()
    with pytest.raises(FileNotFoundError, match=f"missing: {shards[0].name}"):
        next(iterate_weights(path, use_tqdm=False))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="No weight files"):
        next(iterate_weights(empty))


def test_pytorch_bin_fallback(tmp_path: Path) -> None:
    state = {"model.norm.weight": torch.randn(8), "lm_head.weight": torch.randn(4, 8)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    got = dict(iterate_weights(tmp_path, use_tqdm=False))
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        next(iterate_weights(tmp_path, load_format="safetensors"))
