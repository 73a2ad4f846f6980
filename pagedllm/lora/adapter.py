"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into the base model's layout.

PEFT names each adapted module as the checkpoint does (`…self_attn.q_proj.lora_A.weight`, GPT-NeoX's
`…attention.query_key_value`, StarCoder2's `…mlp.c_fc`). Each model class declares which of those it serves
(`lora_modules`: PEFT target → our layer, vLLM's target modules); where they land comes from the model's own
checkpoint mapping, the one that loads its weights: a LoRA B has the rows of its base weight, so the renames and
splits that place the weight (`checkpoint_tensors` where the model has one: GPT-NeoX's per-head interleaved
query_key_value split into q, k and v) and the fused-layer slices (`stacked_params`: q/k/v in `qkv_proj`, gate/up in
`gate_up_proj`) place B the same way; A, over the unchanged input, goes with every piece of its B. The scaling
(lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into B.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True)
class LoRATargets:
    """A model's LoRA targets: `modules` (PEFT target module name → our layer's name) and `place` (a PEFT module's
    path and its B → (our layer's path, output slice, B's rows for that slice) for each piece)."""

    model_name: str
    modules: dict[str, str]
    place: Callable[[str, torch.Tensor], Iterable[tuple[str, int, torch.Tensor]]]

    @classmethod
    def of(cls, model: nn.Module) -> LoRATargets:
        """The model class's `lora_modules` (Llama's names where it declares none) through its checkpoint mapping."""
        from pagedllm.model.models.llama import LlamaForCausalLM

        modules = dict(getattr(model, "lora_modules", LlamaForCausalLM.lora_modules))
        stacked = getattr(model, "stacked_params", {})
        convert = getattr(model, "checkpoint_tensors", None)  # renames and splits (the LayerNorm families)

        def place(hf_module: str, b: torch.Tensor) -> Iterator[tuple[str, int, torch.Tensor]]:
            pieces = [(f"{hf_module}.weight", b)]
            for name, rows in (convert(pieces) if convert is not None else pieces):
                prefix, _, leaf = name.removesuffix(".weight").rpartition(".")
                ours, slice_idx = stacked.get(leaf, (leaf, 0))
                yield f"{prefix}.{ours}" if prefix else ours, slice_idx, rows

        return cls(type(model).__name__, modules, place)

    @property
    def layer_names(self) -> set[str]:
        """Our layers' last names that adapters may adapt (each gets the slots' forward hook)."""
        return set(self.modules.values())


@dataclass
class LoRALayerWeights:
    """One base layer's adaptation: `a` stacks every adapted slice's A ([sum r, in]); slice j adds
    (x Aⱼᵀ) Bⱼᵀ to output columns [offset, offset + rows), Bⱼ already scaled."""

    a: torch.Tensor
    slices: list[tuple[int, int, int, int, torch.Tensor]] = field(default_factory=list)  # (offset, rows, r0, r1, B)


@dataclass
class LoRAAdapter:
    lora_int_id: int
    name: str
    rank: int
    layers: dict[str, LoRALayerWeights]  # our module name → its weights

    @property
    def num_bytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + sum(b.numel() * b.element_size() for *_, b in w.slices)
                   for w in self.layers.values())


def _read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_config.json: give a PEFT adapter directory.")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {str(path)!r} is a {cfg.get('peft_type')} adapter; only LORA is supported.")
    unsupported = {"modules_to_save": cfg.get("modules_to_save"), "use_dora": cfg.get("use_dora"),
                   "fan_in_fan_out": cfg.get("fan_in_fan_out"), "lora_bias": cfg.get("lora_bias"),
                   "layer_replication": cfg.get("layer_replication")}
    bad = [k for k, v in unsupported.items() if v]
    if cfg.get("bias", "none") != "none":
        bad.append(f"bias={cfg['bias']!r}")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        bad.append("rank_pattern/alpha_pattern")
    if bad:
        raise ValueError(f"LoRA adapter {str(path)!r} uses {bad}, which pagedllm does not serve (plain LoRA on the "
                         f"attention and MLP projections only).")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    bin_file = path / "adapter_model.bin"
    if bin_file.is_file():
        return torch.load(str(bin_file), map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_model.safetensors (or .bin).")


def load_adapter(lora_int_id: int, name: str, path: str, modules: dict, targets: LoRATargets, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> LoRAAdapter:
    """The adapter at `path`, placed by `targets` and checked against the base model's `modules` (our name →
    linear module)."""
    root = Path(path)
    cfg = _read_config(root)
    rank = int(cfg["r"])
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, more than max_lora_rank={max_rank}: raise "
                         f"--max-lora-rank.")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(root).items():
        name_ = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name_:
                pairs.setdefault(name_.split(marker)[0], {})[part] = tensor
                break
        else:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight (embedding and "
                             f"other trained modules are not served).")
    by_layer: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    allowed = ", ".join(targets.modules)
    for hf_name, ab in pairs.items():
        proj = hf_name.rpartition(".")[2]
        if proj not in targets.modules:
            raise ValueError(f"LoRA adapter {name!r} adapts {hf_name!r}: {targets.model_name} has no LoRA target "
                             f"module {proj!r}; it serves LoRA on {allowed} only.")
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {name!r}: {hf_name!r} has {sorted(ab)} but not both lora_A and lora_B.")
        for target, slice_idx, b in targets.place(hf_name, ab["lora_B"]):
            if target not in modules:
                raise ValueError(f"LoRA adapter {name!r} adapts {hf_name!r} (our {target!r}), which this "
                                 f"{targets.model_name} does not have.")
            if target.rpartition(".")[2] != targets.modules[proj]:  # a family whose table and renames disagree
                raise ValueError(f"LoRA adapter {name!r}: {hf_name!r} lands on {target!r}, not on a "
                                 f"{targets.modules[proj]!r} as {targets.model_name}.lora_modules says.")
            if any(s == slice_idx for s, *_ in by_layer.get(target, ())):
                raise ValueError(f"LoRA adapter {name!r} adapts slice {slice_idx} of {target!r} twice.")
            by_layer.setdefault(target, []).append((slice_idx, ab["lora_A"], b))
    layers = {}
    for target, parts in by_layer.items():
        module = modules[target]
        out_features, in_features = module.weight_shape()  # (the dense weight may be released once packed)
        sizes = list(getattr(module, "shard_sizes", None) or [out_features])
        a_parts, slices, r0 = [], [], 0
        for slice_idx, a, b in sorted(parts, key=lambda p: p[0]):
            offset, rows = sum(sizes[:slice_idx]), sizes[slice_idx]
            if b.shape != (rows, a.shape[0]) or a.shape[1] != in_features:
                raise ValueError(f"LoRA adapter {name!r}: {target} slice {slice_idx} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}, which do not fit the layer ({rows} outputs).")
            a_parts.append(a)
            r1 = r0 + a.shape[0]
            slices.append((offset, rows, r0, r1, (b.float() * scaling).to(dtype=dtype, device=device)))
            r0 = r1
        layers[target] = LoRALayerWeights(torch.cat(a_parts).to(dtype=dtype, device=device), slices)
    if not layers:
        raise ValueError(f"LoRA adapter {name!r} at {path!r} holds no LoRA weights.")
    return LoRAAdapter(lora_int_id, name, rank, layers)
