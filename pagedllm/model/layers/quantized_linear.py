"""``--quantization gguf``: linear layers and the embedding keep a GGUF file's quantized blocks on the CPU.

The model is first loaded as usual (float32, from the converted cache); then every linear layer whose
GGUF tensors are Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 gets a
:class:`~pagedllm.kernels.cpu_quant.GGUFWeight` (fused q/k/v and gate/up rows concatenated, rows in HF order; parts
in different types, as Q4_K_M's Q4_K q / k beside a Q6_K v, a weight of row segments, one per type) and its float32
weight is dropped. The embedding (and a tied LM head) keeps its blocks too: lookups dequantize only the rows asked
for. Tensors of other types (F32 norms, Q2_K, Q3_K, IQ*, ...) stay dense; each is named once in the log.

A MoE file's routed experts (FusedMoE) get theirs before the weights load (:func:`attach_gguf_experts`): one
GGUFWeight per expert and projection (w13: gate rows, then up rows; w2: down), so their float copy is never made
(nor read: the converted cache leaves them in the GGUF, and the load skips the names attach_gguf_experts returns).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pagedllm.kernels import cpu_quant
from pagedllm.kernels.cpu_quant import GGML_TYPES, GGUFWeight

if TYPE_CHECKING:
    from pagedllm.model.gguf_loader import GGUFRawTensor

logger = logging.getLogger("pagedllm")

# Values of --quantization handled here; "none" keeps the dequantize-at-load path.
GGUF = "gguf"
NONE = "none"
# What an unset --quantization means for a quantized GGUF on the CPU (gguf, or none: the test suite's HF-parity
# tests set none, since int8 activations do not reproduce float32 greedy outputs token for token).
DEFAULT_ENV = "PAGEDLLM_GGUF_QUANTIZATION"


@dataclass
class GGUFAttachReport:
    """What :func:`attach_gguf_weights` did: layers served quantized, tensors left dense, byte counts."""

    quantized_layers: int = 0
    quantized_types: dict[str, int] = field(default_factory=dict)
    expert_projections: int = 0  # FusedMoE projections (w13 or w2 of one layer) held as per-expert GGUF blocks
    dense_tensors: dict[str, str] = field(default_factory=dict)  # HF name -> why it stayed dense
    file_tensor_bytes: int = 0
    weight_bytes: int = 0  # resident: quantized blocks + remaining dense params + packed copies


def gguf_has_quantized_linears(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a GGUF file with at least one matrix (or merged expert tensor) in a type served
    quantized."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(Path(path))
    except Exception:  # noqa: BLE001 (the reader raises many kinds; the loader reports them)
        return False
    return any(t.tensor_type.name in GGML_TYPES and len(t.shape) in (2, 3) for t in reader.tensors)


def resolve_quantization(requested: str | None, gguf_path: str | None, device: str, dtype: torch.dtype) -> str | None:
    """The weight quantization to apply: ``requested``, or by default ``gguf`` for a quantized GGUF on the CPU
    in float32. Raises ValueError for a combination that cannot run."""
    if requested is None:
        default = os.environ.get(DEFAULT_ENV, GGUF)
        if default not in (GGUF, NONE):
            raise ValueError(f"{DEFAULT_ENV} must be 'gguf' or 'none', got {default!r}")
        if default == GGUF and gguf_path and device == "cpu" and dtype == torch.float32 \
                and gguf_has_quantized_linears(gguf_path):
            return GGUF
        return None
    if requested == NONE:
        return None
    if requested != GGUF:
        return requested
    if gguf_path is None:
        raise ValueError("quantization='gguf' needs a .gguf model file (the weights are read as GGUF blocks); "
                         "use quantization='none' for other models.")
    if device != "cpu":
        raise ValueError(f"quantization='gguf' runs on the CPU; this engine runs on {device!r}: use "
                         "quantization='none' (dequantized weights) on a GPU.")
    if dtype != torch.float32:
        raise ValueError(f"quantization='gguf' computes in float32 activations, got dtype={dtype}: use "
                         "dtype='float32' (or 'auto'), or quantization='none'.")
    return GGUF


def gguf_matmul(w: GGUFWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x Wᵀ (+ bias) with W held as GGUF blocks."""
    y = cpu_quant.load_quant_kernels().linear(x, w, w.gemm_method)
    return y + bias if bias is not None else y


def gguf_embedding(w: GGUFWeight, input_ids: torch.Tensor) -> torch.Tensor:
    """Rows ``input_ids`` of a GGUF-quantized embedding table, dequantized."""
    return cpu_quant.load_quant_kernels().dequantize_rows(w, input_ids)


def _source_names(model: nn.Module) -> dict[str, list[str]]:
    """Fused parameter -> its checkpoint parts in shard order (``qkv_proj`` -> q, k, v)."""
    fused: dict[str, list[tuple[int, str]]] = {}
    for src, (dst, shard) in getattr(model, "stacked_params", {}).items():
        fused.setdefault(dst, []).append((shard, src))
    return {dst: [s for _, s in sorted(parts)] for dst, parts in fused.items()}


def _gguf_weight(parts: list, rows: int, cols: int) -> tuple[GGUFWeight | None, str]:
    """One GGUFWeight of ``parts`` (a fused layer's in row order); parts in different types served quantized make a
    weight of row segments, one per type (GGUFWeight.from_segments)."""
    types = {p.type_name for p in parts}
    unserved = sorted(types - set(GGML_TYPES))
    if unserved:
        return None, f"type {'/'.join(unserved)} is not served quantized"
    found = sum(p.blocks.shape[0] for p in parts)
    if found != rows:
        return None, f"{found} rows, the layer has {rows}"
    try:
        if len(types) > 1:
            return GGUFWeight.from_segments([(torch.from_numpy(np.array(p.blocks)), p.type_code) for p in parts],
                                            cols), ""
        data = np.concatenate([p.blocks for p in parts]) if len(parts) > 1 else np.array(parts[0].blocks)
        return GGUFWeight.from_gguf_blocks(torch.from_numpy(np.ascontiguousarray(data)), parts[0].type_code, rows,
                                           cols), ""
    except ValueError as e:
        return None, str(e)


def attach_gguf_weights(model: nn.Module, gguf_path: str | os.PathLike[str],
                        gemm_method: str = "auto") -> GGUFAttachReport:
    """Give every supported layer of ``model`` its GGUF blocks and drop its float32 weight (see module doc).
    ``gemm_method``: "auto" (the faster design per batch size) or one design for every batch size."""
    from pagedllm.model.gguf_loader import read_gguf_raw_tensors

    if gemm_method not in cpu_quant.GEMM_METHODS:
        raise ValueError(f"gemm_method must be one of {list(cpu_quant.GEMM_METHODS)}, got {gemm_method!r}")
    raw, file_bytes = read_gguf_raw_tensors(gguf_path)
    return attach_quantized_blocks(model, raw, file_bytes, gemm_method)


def _tied_embedding(modules: dict[str, nn.Module], head: str, embedding_cls: type) -> str | None:
    """The name of the embedding whose weight the tied LM head ``head`` shares (None: none shares it)."""
    weight = getattr(modules[head], "weight", None)
    return next((n for n, m in modules.items() if n != head and isinstance(m, embedding_cls)
                 and getattr(m, "weight", None) is weight), None) if weight is not None else None


def attach_quantized_blocks(model: nn.Module, raw: dict, source_bytes: int,
                            gemm_method: str = "auto") -> GGUFAttachReport:
    """:func:`attach_gguf_weights` on blocks already read: ``raw`` maps HF weight names to GGUFRawTensors (from a
    GGUF file, or made from an integer checkpoint: layers/int_weight_blocks.py); ``source_bytes`` is what the
    source's tensors take, for the report."""
    from pagedllm.model.layers.embedding import VocabParallelEmbedding
    from pagedllm.model.layers.linear import PackableGemm

    if gemm_method not in cpu_quant.GEMM_METHODS:
        raise ValueError(f"gemm_method must be one of {list(cpu_quant.GEMM_METHODS)}, got {gemm_method!r}")
    report = GGUFAttachReport(file_tensor_bytes=source_bytes)
    fused = _source_names(model)
    modules = dict(model.named_modules())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    to_drop: list[nn.Parameter] = []
    for name, module in modules.items():
        is_gemm = isinstance(module, PackableGemm)
        if not is_gemm and not isinstance(module, VocabParallelEmbedding):
            continue
        if getattr(getattr(module, "tp", None), "size", 1) != 1:
            raise ValueError("quantization='gguf' supports tensor_parallel_size=1 only")
        prefix, _, leaf = name.rpartition(".")
        if leaf in fused:
            sources = [f"{prefix}.{part}.weight" for part in fused[leaf]]
        elif name.endswith("lm_head") and tied:
            emb_name = _tied_embedding(modules, name, VocabParallelEmbedding)  # e.g. Mamba's backbone.embeddings
            sources = ([f"{emb_name}.weight"] if f"{emb_name}.weight" in raw else
                       [n for n in raw if n.endswith("embed_tokens.weight")])
        else:
            sources = [f"{name}.weight"]
        parts = [raw.get(s) for s in sources]
        if not sources or any(p is None for p in parts):
            report.dense_tensors[name] = "no GGUF tensor"
            continue
        if name.endswith("lm_head") and tied:  # shares the embedding's blocks, as it shares its weight
            emb = modules.get(emb_name or name.replace("lm_head", "model.embed_tokens"))
            w = getattr(emb, "gguf_weight", None)
            why = "" if w is not None else "embedding stayed dense"
        else:
            w, why = _gguf_weight(parts, *module.weight.shape)
        if w is None:
            for s in sources:
                report.dense_tensors[s] = why
            continue
        w.gemm_method = gemm_method
        module.gguf_weight = w
        to_drop.append(module.weight)
        report.quantized_layers += 1
        report.quantized_types[w.type_name] = report.quantized_types.get(w.type_name, 0) + 1
    for p in to_drop:
        p.data = torch.empty(0, dtype=p.dtype)
    for module in modules.values():  # attached before the weights loaded (attach_gguf_experts)
        for stack in (getattr(module, "w13_gguf", None), getattr(module, "w2_gguf", None)):
            if stack:
                report.expert_projections += 1
                report.quantized_types[stack[0].type_name] = report.quantized_types.get(stack[0].type_name, 0) + 1
    report.weight_bytes = resident_weight_bytes(model)
    return report


def attach_gguf_experts(model: nn.Module, gguf_path: str | os.PathLike[str]) -> frozenset[str]:
    """Before the weights load: each FusedMoE projection (w13, w2) whose experts the file stores in a type served
    quantized gets one GGUFWeight per expert, and its float parameter is released unfilled; the rest load as float,
    and one log line says why. Returns the per-expert checkpoint names now held (``<FusedMoE>.{e}.gate_proj.weight``
    …), which the load then neither reads nor dequantizes. Tensor parallelism is refused."""
    from pagedllm.model.gguf_loader import read_gguf_raw_tensors
    from pagedllm.model.gguf_moe import is_float_type, log_dequantized_experts
    from pagedllm.model.layers.fused_moe import FusedMoE

    layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    if not layers:
        return frozenset()
    if any(moe.tp.size != 1 for moe in layers.values()):
        raise ValueError("quantization='gguf' serves GGUF experts on one rank only (tensor_parallel_size=1); use "
                         "quantization='none' (dequantized experts) with tensor parallelism.")
    raw, _ = read_gguf_raw_tensors(gguf_path)
    left: dict[str, list[str]] = {}  # why -> GGUF types of the expert tensors left float
    held: set[str] = set()
    for name, moe in layers.items():
        for attr, projections, shape in (("w13", ("gate_proj", "up_proj"), (2 * moe.shard, moe.hidden_size)),
                                         ("w2", ("down_proj",), (moe.hidden_size, moe.shard))):
            stacks = [_expert_parts(raw, f"{name}.{p}", moe.num_experts) for p in projections]
            if any(s is None or is_float_type(s[0].type_name) for s in stacks):
                continue  # float in the file (or absent: the load reports it)
            weights, why = _expert_weights(stacks, *shape)
            if weights is None:
                left.setdefault(why, []).extend(s[0].type_name for s in stacks)
                continue
            setattr(moe, f"{attr}_gguf", weights)
            held.update(f"{name}.{e}.{p}.weight" for e in range(moe.num_experts) for p in projections)
            param = getattr(moe, f"{attr}_weight")
            param.data = torch.empty(0, dtype=param.dtype)
    for why, types in left.items():
        log_dequantized_experts(Path(gguf_path), types, why)
    return frozenset(held)


def _expert_parts(raw: Mapping[str, GGUFRawTensor], name: str, num_experts: int) -> list[GGUFRawTensor] | None:
    """One projection of every expert, ``name`` = ``<FusedMoE>.<gate_proj|up_proj|down_proj>``, as 2-D raw tensors:
    sliced from the file's merged tensor (or its fused gate_up_proj: gate rows, then up), or the file's one tensor per
    expert (old Mixtral files); None where the file has neither."""
    prefix, _, projection = name.rpartition(".")
    merged, rows = raw.get(f"{name}.weight"), slice(None)
    fused = raw.get(f"{prefix}.gate_up_proj.weight") if projection != "down_proj" else None
    if merged is None and fused is not None:
        width = fused.shape[1] // 2
        merged, rows = fused, slice(0, width) if projection == "gate_proj" else slice(width, None)
    if merged is not None:
        if merged.shape[0] != num_experts:
            return None  # the conversion's shape check names the tensor
        blocks = [merged.blocks[e, rows] for e in range(num_experts)]
        return [replace(merged, blocks=b, shape=(b.shape[0], merged.shape[2])) for b in blocks]
    parts = [raw.get(f"{prefix}.{e}.{projection}.weight") for e in range(num_experts)]
    return None if any(p is None for p in parts) else parts


def _expert_weights(stacks: list[list[GGUFRawTensor]], rows: int, cols: int) -> tuple[list[GGUFWeight] | None, str]:
    """One GGUFWeight per expert of its parts' rows concatenated (gate | up for w13), or None and why not."""
    weights = []
    for parts in zip(*stacks):
        w, why = _gguf_weight(list(parts), rows, cols)
        if w is None:
            return None, why
        weights.append(w)
    return weights, ""


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: dense params, GGUF and MXFP4 blocks and packed copies (each storage
    once)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or t.numel() == 0:
            return
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # opaque (oneDNN-packed) tensors
            key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p.data)
    for m in model.modules():
        for w in held_gguf_weights(m):
            add(w.data)
        add(getattr(m, "packed_weight", None))
        add(getattr(m, "f32_panels", None))
        for w in (m.mxfp4_weights() if hasattr(m, "mxfp4_weights") else None) or ():  # experts held as MXFP4
            add(w.blocks)
            add(w.scales)
        for projection in getattr(m, "cpu_panels", None) or ():  # float32 experts packed for the native GEMM
            for panel in projection.panels:
                add(panel)
    return total


def held_gguf_weights(module: nn.Module) -> list[GGUFWeight]:
    """The GGUF weights ``module`` holds: a linear's or embedding's one, a FusedMoE's one per expert."""
    one = getattr(module, "gguf_weight", None)
    experts = (getattr(module, "w13_gguf", None) or []) + (getattr(module, "w2_gguf", None) or [])
    return ([one] if one is not None else []) + experts


def num_parameters(model: nn.Module) -> int:
    """Parameters of `model`, counting each GGUF-quantized weight once as its out × in elements, and MXFP4 experts
    as their values."""
    seen: set[int] = set()
    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        for w in held_gguf_weights(m):
            if id(w) not in seen:
                seen.add(id(w))
                total += w.out_features * w.in_features
        shape = getattr(m, "dense_shape", None)  # a float32 weight held as panels (layers/linear.py)
        if shape is not None:
            total += shape[0] * shape[1]
        mxfp4 = m.mxfp4_weights() if hasattr(m, "mxfp4_weights") else None  # experts held as MXFP4 (two a byte)
        total += sum(2 * w.blocks.numel() for w in mxfp4 or ())
    return total


def log_attach_report(report: GGUFAttachReport) -> None:
    types = ", ".join(f"{n} {t}" for t, n in sorted(report.quantized_types.items()))
    experts = f" and {report.expert_projections} routed-expert projections" if report.expert_projections else ""
    logger.info("GGUF weights served quantized: %d layers%s (%s); weight bytes in memory %.1f MB vs %.1f MB of "
                "tensors in the file (%.2fx)", report.quantized_layers, experts, types, report.weight_bytes / 1e6,
                report.file_tensor_bytes / 1e6, report.weight_bytes / max(report.file_tensor_bytes, 1))
    for name, why in sorted(report.dense_tensors.items()):
        if "no GGUF tensor" not in why:
            logger.info("GGUF tensor %s stays dense float32: %s", name, why)
