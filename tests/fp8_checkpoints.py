"""FP8 checkpoints for tests, written from a float32 Hugging Face checkpoint in the layouts model/fp8_checkpoint.py
reads, each with a float32 twin holding its dequantized weights (the model transformers runs as the reference).

Kinds:
- "ct-channel": compressed-tensors FP8_DYNAMIC: per-channel scales [N, 1] in bf16 (as llm-compressor stores them);
- "ct-tensor": compressed-tensors FP8 with static activations: per-tensor scales [1] and input scales [1];
- "autofp8-static": quant_method "fp8" (AutoFP8): scalar weight and input scales, plus KV-cache scales;
- "fp8-block": quant_method "fp8" with weight_block_size (transformers' fine-grained FP8): `weight_scale_inv`
  per 64 × 48 block (blocks that do not divide the weight: the last ones are partial).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KINDS = ("ct-channel", "ct-tensor", "autofp8-static", "fp8-block")
BLOCK = (64, 48)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MAX = 448.0


def ct_config(strategy: str, static: bool) -> dict:
    act = {"num_bits": 8, "type": "float", "symmetric": True,
           **({"dynamic": False, "strategy": "tensor"} if static else {"dynamic": True, "strategy": "token"})}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": act, "weights": {
                "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}}}}


def quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 [N, K] → (e4m3 values, the scale tensor as the kind stores it, the dequantized float32 weight)."""
    w = w.float()
    if kind == "ct-channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / _MAX).to(torch.bfloat16)
        expanded = scale.float()
    elif kind in ("ct-tensor", "autofp8-static"):
        scale = (w.abs().amax() / _MAX).reshape(1 if kind == "ct-tensor" else ())
        expanded = scale.float()
    elif kind == "fp8-block":
        n, k = w.shape
        rows, cols = math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1])
        padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
        padded[:n, :k] = w.abs()
        scale = padded.reshape(rows, BLOCK[0], cols, BLOCK[1]).amax(dim=(1, 3)) / _MAX
        expanded = scale.repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
    else:
        raise ValueError(kind)
    q = (w / expanded).clamp(-_MAX, _MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * expanded


def write_fp8_checkpoint(src: Path, dst: Path, kind: str) -> Path:
    """Write `kind` of the float32 checkpoint in `src` to `dst`; returns the directory of its dequantized twin."""
    state = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    twin = dst.parent / f"{dst.name}-dequantized"
    for d in (dst, twin):
        shutil.copytree(src, d)
    quantized, dequantized = {}, {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            quantized[name] = dequantized[name] = t
            continue
        q, scale, back = quantize(t, kind)
        quantized[name], dequantized[name] = q, back
        quantized[f"{prefix}.{'weight_scale_inv' if kind == 'fp8-block' else 'weight_scale'}"] = scale
        if kind in ("ct-tensor", "autofp8-static"):
            quantized[f"{prefix}.input_scale"] = torch.tensor([0.02] if kind == "ct-tensor" else 0.02)
        if kind == "autofp8-static" and prefix.endswith("k_proj"):
            attn = prefix.rpartition(".")[0]
            quantized[f"{attn}.k_scale"], quantized[f"{attn}.v_scale"] = torch.tensor(1.0), torch.tensor(1.0)
    save_file(quantized, str(dst / "model.safetensors"))
    save_file(dequantized, str(twin / "model.safetensors"))
    if kind == "ct-channel":
        qc = ct_config("channel", static=False)
    elif kind == "ct-tensor":
        qc = ct_config("tensor", static=True)
    elif kind == "autofp8-static":
        qc = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
              "modules_to_not_convert": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}, indent=1))
    return twin
