"""Integer weight-only checkpoints (W4A16 / W8A16): Hugging Face directories whose linear weights are stored as
packed 4- or 8-bit integers with per-group scales and zero points, in the three layouts vLLM users bring.

- ``quant_method: "gptq"`` (AutoGPTQ, GPTQModel): ``qweight`` int32 [in·bits/32, out] packed along the input
  dimension (element j of a word at bits·j), ``qzeros`` int32 [groups, out·bits/32] packed along the output
  dimension, ``scales`` fp16 [groups, out] and ``g_idx`` int32 [in] (the group of each input column; act-order
  / ``desc_act`` checkpoints permute it). ``checkpoint_format: "gptq"`` (v1) stores every zero point minus one,
  ``"gptq_v2"`` stores it as is.
- ``quant_method: "awq"`` (AutoAWQ's GEMM version): ``qweight`` int32 [in, out/8] packed along the output dimension
  in AWQ's interleaved nibble order (nibble i of a word holds column ``AWQ_ORDER[i]`` of its eight), ``qzeros``
  int32 [groups, out/8] in the same order, ``scales`` fp16 [groups, out]. Always asymmetric.
- ``quant_method: "compressed-tensors"``, format ``"pack-quantized"`` (llm-compressor's W4A16 / W8A16):
  ``weight_packed`` int32 [out, in·bits/32] packed along the input dimension, the signed values offset by
  2^(bits-1); ``weight_scale`` [out, groups]; ``weight_zero_point`` for asymmetric schemes (packed along the
  output dimension, offset the same way); ``weight_shape`` [out, in]; ``weight_g_idx`` for act-order "group".

Every layout is unpacked here into one form, :class:`IntWeight`: unsigned codes q [out, in], a scale and a zero
point per (row, group), w = scale · (q − zero), exact in float32. How the weights are then held:
- dequantized at load into the model's dtype (any device; :func:`int_weight_checkpoint_weights` yields them under
  the ``.weight`` names the model's loaders take, so q/k/v and gate/up stack as for any checkpoint);
- on the CPU in float32 (the default there), kept quantized as GGUF blocks for the existing Q4/Q8 kernels: see
  model/int_weight_blocks.py.
"""
from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

logger = logging.getLogger("pagedllm")

INT_WEIGHT_METHODS = ("gptq", "awq", "compressed-tensors")
SUPPORTED = ("quant_method 'fp8' and compressed-tensors FP8 (model/fp8_checkpoint.py); 4- and 8-bit integer "
             "weights: 'gptq' (checkpoint_format gptq or gptq_v2, any group size, desc_act), 'awq' (4-bit, GEMM "
             "version, zero_point true) and 'compressed-tensors' format 'pack-quantized' (int weights, group or "
             "channel strategy, no activation quantization); 'mxfp4' (GPT-OSS's experts: held as MXFP4 on CUDA, dequantized elsewhere); GGUF files "
             "for llama.cpp's quantizations")
GPTQ_FORMATS = ("gptq", "gptq_v2")
# AutoAWQ packs eight output columns into a word in this order (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear:
# nibble i holds column order_map[i]); its inverse says which nibble holds column j.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(j) for j in range(8))

# The tensors of one quantized linear, by format: (required, optional) leaf names.
_PARTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point", "weight_g_idx")),
}


@dataclass(frozen=True)
class IntWeightFormat:
    """What a checkpoint's `quantization_config` says about its integer weights."""

    method: str  # one of INT_WEIGHT_METHODS
    bits: int  # 4 or 8
    group_size: int | None  # input columns per scale; -1: one group per row; None: read from each layer's shapes
    symmetric: bool
    desc_act: bool = False  # GPTQ act-order (or compressed-tensors actorder "group"): g_idx may permute groups
    checkpoint_format: str = ""  # GPTQ: "gptq" (zero points stored minus one) or "gptq_v2"

    @property
    def zeros_minus_one(self) -> bool:
        return self.method == "gptq" and self.checkpoint_format == "gptq"

    @property
    def expects_g_idx(self) -> bool:
        """Whether each layer should come with a g_idx (GPTQ writers always save one)."""
        return self.method == "gptq" or (self.method == "compressed-tensors" and self.desc_act)

    def describe(self) -> str:
        group = ("per-layer groups" if self.group_size is None else
                 "per-channel" if self.group_size == -1 else f"group {self.group_size}")
        parts = [f"{self.bits}-bit", group, "symmetric" if self.symmetric else "asymmetric"]
        if self.desc_act:
            parts.append("act-order")
        name = f"{self.method} ({self.checkpoint_format})" if self.checkpoint_format else self.method
        return f"{name}, {', '.join(parts)}"


@dataclass
class IntWeight:
    """One linear's integer weight: w[o, i] = scale[o, g(i)] · (q[o, i] − zero[o, g(i)]), with g(i) = g_idx[i], or
    i // group_size where there is no g_idx."""

    q: torch.Tensor  # uint8 [out, in]: unsigned codes in [0, 2^bits)
    scale: torch.Tensor  # [out, groups], as stored (fp16, bf16 or fp32)
    zero: torch.Tensor  # int32 [out, groups]: unsigned zero points
    bits: int
    group_size: int  # columns per group (the last one may be shorter)
    g_idx: torch.Tensor | None = None  # int64 [in]; None: i // group_size

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def contiguous_groups(self) -> bool:
        """Whether column i belongs to group i // group_size (no act-order permutation)."""
        if self.g_idx is None:
            return True
        return bool(torch.equal(self.g_idx, torch.arange(self.shape[1]) // self.group_size))

    def group_index(self) -> torch.Tensor:
        return self.g_idx if self.g_idx is not None else torch.arange(self.shape[1]) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] weight: (q − zero) · scale in float32 (exact: a small integer times a scale), in `dtype`."""
        out, cols = self.shape
        zero, scale = self.zero.to(torch.float32), self.scale.to(torch.float32)
        if cols % self.group_size == 0 and self.contiguous_groups():  # per group, without [out, in] gathers
            q = self.q.reshape(out, -1, self.group_size).to(torch.float32)
            return ((q - zero[:, :, None]) * scale[:, :, None]).reshape(out, cols).to(dtype)
        g = self.group_index()
        return ((self.q.to(torch.float32) - zero[:, g]) * scale[:, g]).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero))


# --------------------------------------------------------------------------------------------
# Detection


def _as_dict(qc: Any) -> dict:
    if isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def _ct_int_weights(qc: dict) -> bool:
    """Whether a compressed-tensors config quantizes weights to integers (FP8 is model/fp8_checkpoint.py's)."""
    groups = qc.get("config_groups") or {}
    return any(((g or {}).get("weights") or {}).get("type") == "int" for g in groups.values())


def detect_int_weight_checkpoint(hf_config: Any, requested: str | None = None) -> IntWeightFormat | None:
    """The integer weight format of a model directory's config; None where it has no `quantization_config` or an FP8
    one (model/fp8_checkpoint.py reads those). `requested` is ``--quantization``: a method name must match the
    checkpoint's. A ValueError naming the variant and what is supported for any other quantization."""
    qc = getattr(hf_config, "quantization_config", None)
    qc = None if qc is None else _as_dict(qc)
    method = None if qc is None else qc.get("quant_method")
    is_int = method in ("gptq", "awq") or (method == "compressed-tensors" and _ct_int_weights(qc))
    _check_requested(requested, method, is_int)
    if qc is None or method in ("fp8", "compressed-tensors", "mxfp4") and not is_int:
        return None  # (mxfp4: GPT-OSS's experts, model/mxfp4.py)
    if method == "gptq":
        return _gptq_format(qc)
    if method == "awq":
        return _awq_format(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    raise ValueError(f"the checkpoint's quantization_config has quant_method={method!r}, which pagedllm cannot load. "
                     f"Supported: {SUPPORTED}.")


def _check_requested(requested: str | None, method: str | None, is_int: bool) -> None:
    """``--quantization`` against the checkpoint, as vLLM checks it: a method flag must name the checkpoint's."""
    if requested in INT_WEIGHT_METHODS and requested != method:
        has = "no quantization_config" if method is None else f"quant_method={method!r}"
        raise ValueError(f"quantization={requested!r} does not match the checkpoint, whose config.json has {has}: "
                         f"leave quantization unset (the checkpoint's own method is used) or pass a checkpoint "
                         f"quantized with {requested}.")
    if is_int and requested in ("fp8", "gguf"):
        raise ValueError(f"quantization={requested!r} does not apply to this checkpoint, whose weights are {method} "
                         f"integers: leave quantization unset, or pass {method!r} (quantized on the CPU, dequantized "
                         f"elsewhere) or 'none' (dequantized at load).")


def _bits(value: Any, method: str, allowed: tuple[int, ...]) -> int:
    if value not in allowed:
        raise ValueError(f"{method} checkpoints with bits={value!r} are not supported: pagedllm loads "
                         f"{' or '.join(map(str, allowed))}-bit {method} weights. Supported: {SUPPORTED}.")
    return int(value)


def _group_size(value: Any, method: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"{method} group_size must be a positive int or -1 (one group per row), got {value!r}.")
    return value


def _gptq_format(qc: dict) -> IntWeightFormat:
    bits = _bits(qc.get("bits"), "GPTQ", (4, 8))
    fmt = qc.get("checkpoint_format") or ("marlin" if qc.get("is_marlin_format") else "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format={fmt!r} is not supported: pagedllm reads the 'gptq' (v1) and "
                         f"'gptq_v2' layouts (kernel-specific layouts such as marlin or bitblas need re-saving in "
                         f"one of them).")
    dynamic = qc.get("dynamic") or {}
    overrides = [k for k, v in dynamic.items() if not str(k).startswith("-:") and v]
    if overrides:
        raise ValueError(f"GPTQ 'dynamic' per-module overrides {overrides} are not supported (one bits / group_size "
                         f"for every layer; '-:' exclusions are fine).")
    return IntWeightFormat("gptq", bits, _group_size(qc.get("group_size", 128), "GPTQ"), bool(qc.get("sym", True)),
                           bool(qc.get("desc_act", False)), fmt)


def _awq_format(qc: dict) -> IntWeightFormat:
    bits = _bits(qc.get("bits", qc.get("w_bit")), "AWQ", (4,))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: pagedllm reads AutoAWQ's GEMM layout (qweight "
                         f"[in, out/8]); GEMV, GEMV_fast and Marlin checkpoints store other layouts.")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ with zero_point=false is not supported: pagedllm reads AWQ's asymmetric GEMM layout "
                         "(qzeros).")
    group = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), "AWQ")
    return IntWeightFormat("awq", bits, group, symmetric=False)


def _compressed_tensors_format(qc: dict) -> IntWeightFormat:
    groups = qc.get("config_groups") or {}
    formats = {qc.get("format")} | {g.get("format") for g in groups.values() if g.get("format")}
    formats.discard("mixed-precision")
    if formats != {"pack-quantized"}:
        raise ValueError(f"compressed-tensors format(s) {sorted(map(str, formats))} with integer weights are not "
                         f"supported: pagedllm loads 'pack-quantized' (llm-compressor's W4A16 / W8A16). "
                         f"Supported: {SUPPORTED}.")
    schemes = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        for kind in ("input_activations", "output_activations"):
            if group.get(kind):
                raise ValueError(f"compressed-tensors group {name!r} quantizes {kind.split('_')[0]} activations "
                                 f"({group[kind].get('num_bits')}-bit {group[kind].get('type')}): pagedllm loads "
                                 f"weight-only integer schemes (W4A16, W8A16).")
        if w.get("type") != "int":
            raise ValueError(f"compressed-tensors group {name!r} stores {w.get('type')} weights beside integer "
                             f"ones: pagedllm loads one kind per checkpoint.")
        bits = _bits(w.get("num_bits"), "compressed-tensors", (4, 8))
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors group {name!r} has weight strategy {strategy!r}: pagedllm loads "
                             f"'group' and 'channel' integer weights.")
        actorder = w.get("actorder")
        if actorder not in (None, False, "group", "weight", "static", "dynamic"):
            raise ValueError(f"compressed-tensors actorder {actorder!r} is not supported.")
        schemes.add((bits, bool(w.get("symmetric", True)), actorder == "group"))
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors groups with different integer schemes {sorted(schemes)} "
                         f"(bits, symmetric, act-order): pagedllm loads one scheme per checkpoint.")
    bits, symmetric, act_order = schemes.pop()
    return IntWeightFormat("compressed-tensors", bits, None, symmetric, act_order)


# --------------------------------------------------------------------------------------------
# Unpacking


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32)


def _word_elements(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] → uint8 [R, C, 32/bits]: element j of each word (bits bits at bits·j)."""
    packed = packed.to(torch.int32).contiguous()
    if bits in (4, 8) and sys.byteorder == "little":  # byte views: no int32 shifts (4- and 8-bit never straddle bytes)
        data = packed.view(torch.uint8).reshape(*packed.shape, 4)
        if bits == 8:
            return data
        return torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*packed.shape, 8)
    return ((packed.unsqueeze(-1) >> _shifts(bits)) & ((1 << bits) - 1)).to(torch.uint8)


def unpack_int32_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] packed along dim 0 (element j of word r, at bits·j, is row r·32/bits + j) → uint8 [R·32/bits, C]."""
    return _word_elements(packed, bits).permute(0, 2, 1).reshape(-1, packed.shape[1])


def unpack_int32_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] packed along dim 1 (element j of word c, at bits·j, is column c·32/bits + j) → uint8
    [R, C·32/bits]."""
    return _word_elements(packed, bits).reshape(packed.shape[0], -1)


def _awq_cols(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C] → uint8 [R, 8C] in column order (undoing AWQ_ORDER within each word)."""
    nibbles = unpack_int32_cols(packed, 4).reshape(packed.shape[0], -1, 8)
    return nibbles[:, :, list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


def _group_size_of(prefix: str, in_features: int, groups: int, declared: int | None) -> int:
    """Columns per group from the shapes; a ValueError where they contradict the config."""
    if groups < 1 or groups > in_features:
        raise ValueError(f"{prefix}: {groups} scale groups for {in_features} input columns.")
    size = in_features if declared == -1 else declared or -(-in_features // groups)
    if -(-in_features // size) != groups:
        raise ValueError(f"{prefix}: scales with {groups} groups over {in_features} input columns do not match the "
                         f"config's group_size {declared}.")
    return size


def _g_idx(prefix: str, g_idx: torch.Tensor | None, in_features: int, groups: int) -> torch.Tensor | None:
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64).reshape(-1)
    if g.numel() != in_features or (g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups)):
        raise ValueError(f"{prefix}: g_idx must hold {in_features} group indices in [0, {groups}), got "
                         f"{tuple(g_idx.shape)} values in [{int(g.min())}, {int(g.max())}].")
    return g


def _check_shape(prefix: str, name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if t.dtype != torch.int32 or tuple(t.shape) != want:
        raise ValueError(f"{prefix}.{name} is {t.dtype} {tuple(t.shape)}; the layer's other tensors imply int32 "
                         f"{want}.")


def _unpack_gptq(prefix: str, parts: dict[str, torch.Tensor], fmt: IntWeightFormat) -> IntWeight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    pack = 32 // fmt.bits
    groups, out = scales.shape
    in_features = qweight.shape[0] * pack
    _check_shape(prefix, "qweight", qweight, (in_features // pack, out))
    size = _group_size_of(prefix, in_features, groups, fmt.group_size)
    _check_shape(prefix, "qzeros", qzeros, (groups, -(-out // pack)))
    zero = unpack_int32_cols(qzeros, fmt.bits)[:, :out].to(torch.int32)
    if fmt.zeros_minus_one:  # AutoGPTQ's pack: `zeros -= 1` before packing (qlinear_cuda.py); its forward adds 1
        zero = zero + 1
    g_idx = _g_idx(prefix, parts.get("g_idx"), in_features, groups)
    return IntWeight(unpack_int32_rows(qweight, fmt.bits).t().contiguous(), scales.t().contiguous(),
                     zero.t().contiguous(), fmt.bits, size, g_idx)


def _unpack_awq(prefix: str, parts: dict[str, torch.Tensor], fmt: IntWeightFormat) -> IntWeight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    groups, out = scales.shape
    in_features = qweight.shape[0]
    _check_shape(prefix, "qweight", qweight, (in_features, out // 8))
    size = _group_size_of(prefix, in_features, groups, fmt.group_size)
    _check_shape(prefix, "qzeros", qzeros, (groups, out // 8))
    return IntWeight(_awq_cols(qweight).t().contiguous(), scales.t().contiguous(),
                     _awq_cols(qzeros).to(torch.int32).t().contiguous(), fmt.bits, size)


def _unpack_compressed_tensors(prefix: str, parts: dict[str, torch.Tensor], fmt: IntWeightFormat) -> IntWeight:
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    shape = tuple(int(v) for v in parts["weight_shape"].reshape(-1).tolist())
    if len(shape) != 2:
        raise ValueError(f"{prefix}.weight_shape must be [out, in], got {list(shape)}.")
    out, in_features = shape
    pack, offset = 32 // fmt.bits, 1 << (fmt.bits - 1)
    _check_shape(prefix, "weight_packed", packed, (out, -(-in_features // pack)))
    if scale.dim() == 1:
        scale = scale[:, None]
    if scale.dim() != 2 or scale.shape[0] != out:
        raise ValueError(f"{prefix}.weight_scale has shape {tuple(parts['weight_scale'].shape)}, expected "
                         f"[{out}, groups].")
    groups = scale.shape[1]
    # compressed_tensors pack_to_int32 packs value + 2^(bits-1) (unsigned), so the codes come out unsigned here.
    q = unpack_int32_cols(packed, fmt.bits)[:, :in_features].contiguous()
    zp = parts.get("weight_zero_point")
    if fmt.symmetric or zp is None:
        if not fmt.symmetric:
            raise ValueError(f"{prefix}: an asymmetric compressed-tensors scheme without weight_zero_point.")
        zero = torch.full((out, groups), offset, dtype=torch.int32)
    elif zp.dtype == torch.int32 and zp.shape[0] == -(-out // pack) and zp.shape[1:] == (groups,):
        zero = unpack_int32_rows(zp, fmt.bits)[:out].to(torch.int32)  # packed along the output dim, offset
    elif tuple(zp.shape) in ((out, groups), (out,)):  # older writers: signed zero points, unpacked
        zero = zp.reshape(out, groups).to(torch.int32) + offset
    else:
        raise ValueError(f"{prefix}.weight_zero_point has shape {tuple(zp.shape)} ({zp.dtype}); expected int32 "
                         f"[{-(-out // pack)}, {groups}] (packed) or [{out}, {groups}].")
    g_idx = _g_idx(prefix, parts.get("weight_g_idx"), in_features, groups)
    size = _group_size_of(prefix, in_features, groups, None)
    return IntWeight(q, scale.contiguous(), zero.contiguous(), fmt.bits, size, g_idx)


_UNPACKERS = {"gptq": _unpack_gptq, "awq": _unpack_awq, "compressed-tensors": _unpack_compressed_tensors}


def unpack_int_weight(prefix: str, parts: dict[str, torch.Tensor], fmt: IntWeightFormat) -> IntWeight:
    """One layer's tensors (by leaf name) in `fmt`'s layout → :class:`IntWeight`."""
    return _UNPACKERS[fmt.method](prefix, parts, fmt)


# --------------------------------------------------------------------------------------------
# Streaming


@dataclass
class IntWeightLoad:
    """What streaming an integer checkpoint did: each quantized layer's unpacked weight is handed to `on_layer`
    (the CPU's quantized path keeps blocks of it); tallies for the log."""

    counts: Counter = field(default_factory=Counter)
    packed_bytes: dict[str, int] = field(default_factory=dict)  # "<prefix>.weight" -> its tensors' bytes on disk
    checkpoint_bytes: int = 0  # every tensor of the checkpoint


def int_weight_checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]], fmt: IntWeightFormat,
                                  load: IntWeightLoad | None = None,
                                  on_layer: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model's loaders take them: each quantized layer's packed tensors become its
    dequantized float32 ``<prefix>.weight`` (after `on_layer(name, IntWeight)` where given); everything else
    (biases, norms, embeddings, layers stored unquantized) passes through."""
    load = load if load is not None else IntWeightLoad()
    required, optional = _PARTS[fmt.method]
    leaves = set(required) | set(optional)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()

    def finish(prefix: str, parts: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        weight = unpack_int_weight(prefix, parts, fmt)
        name = f"{prefix}.weight"
        load.packed_bytes[name] = sum(t.numel() * t.element_size() for t in parts.values())
        load.counts["quantized layers"] += 1
        if on_layer is not None:
            on_layer(name, weight)
        return name, weight.dequantize()

    for name, tensor in weights:
        load.checkpoint_bytes += tensor.numel() * tensor.element_size()
        prefix, _, leaf = name.rpartition(".")
        if leaf not in leaves:
            yield name, tensor
            continue
        if prefix in done:  # a part that comes after its layer was built
            if leaf == "weight_zero_point" and fmt.symmetric:  # older writers also save a symmetric scheme's zeros
                continue
            raise ValueError(f"the checkpoint holds {prefix}.{leaf} after the rest of its layer, which was already "
                             f"built without it (a layer's g_idx must come no later than its other tensors; each "
                             f"tensor once).")
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if _complete(parts, required, fmt):
            del pending[prefix]
            done.add(prefix)
            yield finish(prefix, parts)
    for prefix, parts in pending.items():  # complete but for an optional part this checkpoint does not hold
        missing = [r for r in required if r not in parts]
        if missing:
            raise ValueError(f"{prefix}: the checkpoint holds {sorted(parts)} of this {fmt.method} layer but not "
                             f"{missing}.")
        yield finish(prefix, parts)
    if not load.counts["quantized layers"]:
        raise ValueError(f"config.json says the weights are {fmt.method}-quantized, but the checkpoint holds no "
                         f"{fmt.method} layer tensors ({', '.join(required)}).")


def _complete(parts: dict[str, torch.Tensor], required: tuple[str, ...], fmt: IntWeightFormat) -> bool:
    if any(r not in parts for r in required):
        return False
    if fmt.method == "gptq":
        return "g_idx" in parts
    if fmt.method == "compressed-tensors":
        return ("weight_zero_point" in parts or fmt.symmetric) and ("weight_g_idx" in parts or not fmt.desc_act)
    return True

