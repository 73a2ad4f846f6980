"""The CPU's decoder stacks on the native kernels, called directly: no module dispatch, no per-call checks.

A decode step of a small model on the CPU is ~300 kernel calls (per layer: two norms, three or four GGUF linears,
RoPE, the cache write, attention, the activation). Through the nn.Module path each call costs ~5 µs of Python
(module dispatch, the wrappers' shape/dtype checks, fresh output tensors), ~3 ms per step at one thread: as much as a
quarter of a single-sequence step (BENCHMARKS.md, "single-sequence CPU decode"). A :class:`DirectForward` checks the
model's layout once when it is built, and per step only what depends on the step (the batch's indices, once, not once
per layer); then it runs the same kernels, in the same order, on the same inputs, into buffers reused across layers
(and across steps of the same token count), so its outputs are bit-identical to the module path's.

:meth:`DirectForward.build` (the worker's one entry point) picks the family's step:

* :class:`LlamaDirectForward` (here): the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite: its embedding
  and residual multipliers; SmolLM3: its layers without RoPE; OLMo 2 / 3: post-norm layers, without an input norm,
  whose attention and MLP outputs are normed before their residual adds, and q/k norms over whole projections) and the
  Gemma family (Gemma, Gemma 2, Gemma 3 text). Each layer is a :class:`_Layer` read from its modules once (its
  linears, its norms' weights and eps, Gemma 2/3's pre/post-feed-forward norms where it has them, its q/k norms, its
  RoPE tables and the dims of each head they rotate (all, or Phi-4-mini's partial rotary), its attention scale,
  sliding window and logit soft cap, which go to its own RoPE and attention calls), and what differs between the
  families is three settings of the model: the RMSNorms' scale (w, or Gemma's 1 + w, computed inside the C norm from
  the live weight: the module path calls the same kernel), the gated activation (SiLU, or Gemma's tanh-approximated
  GELU: one C kernel, which the module path calls too) and the embeddings' factor (Gemma's sqrt(hidden)).
* ``LayerNormDirectForward`` (model/cpu_direct_forward_layernorm.py): the LayerNorm families of models/gpt_neox.py
  (GPT-NeoX / Pythia, Phi, StableLM, StarCoder2).

Every family's step shares what is here: the linears (GGUF blocks called by pointer, their bias added after, or dense
float32 weights through their layer's ``forward``, i.e. oneDNN's packed GEMM, so the products are the module path's;
LoRA deltas after each), the attention of a layer (:class:`_AttentionLayer`: RoPE, the cache write and the paged
attention kernel on the [q | k | v] rows of its qkv_proj), the KV pointers, the step's checks and buffers. It is built
by the worker for float32 models on the CPU when the native kernels are loaded and every linear is of one kind (GGUF
blocks, ``--quantization gguf``, or dense float32 weights, an HF checkpoint or ``--quantization none``). A model with
``direct_forward_supported = False`` (a class or instance attribute: layers the step does not describe) is left to the
module path. ``PAGEDLLM_CPU_DIRECT_FORWARD=0`` turns it off (the module path then runs every step).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels import cpu_quant
from pagedllm.kernels.cpu_kernels import KV_FORMATS
from pagedllm.kernels.metadata import window_and_cap
from pagedllm.kernels.metadata import AttentionMetadata

logger = logging.getLogger("pagedllm")

DIRECT_FORWARD_ENV = "PAGEDLLM_CPU_DIRECT_FORWARD"


@dataclass(frozen=True)
class _Linear:
    """A linear as the step calls it: a GGUF one by pointer (its bias added in place after the product, if
    any), or a dense float32 one through its layer's ``forward`` (`dense`; bias included)."""

    qtype: int
    data_ptr: int
    out_features: int
    in_features: int
    bias: torch.Tensor | None
    weight: object  # the GGUFWeight (keeps its blocks alive), or None for a dense linear
    dense: nn.Module | None = None  # the layer of a dense float32 linear
    module: nn.Module | None = None  # the layer (LoRA adapters are keyed by it)


@dataclass(frozen=True, kw_only=True)
class _AttentionLayer:
    """A decoder layer's attention as every family's step runs it (``attend``): its qkv_proj's [q | k | v] rows
    rotated in place, k and v written to the cache, the paged attention kernel into the step's attention rows, then
    o_proj. A family's layer description adds its norms and MLP (``up`` → activation → ``down``)."""

    qkv: _Linear
    o: _Linear
    up: _Linear  # the MLP's first linear: gate_up_proj ([gate | up], a gated MLP) or fc1
    down: _Linear
    cos: int  # this layer's rotary caches, [max_position, rotary_dim] (0: a layer without RoPE, SmolLM3's)
    sin: int
    rotary_dim: int  # the dims of each head RoPE rotates (head_dim, fewer under a partial rotary: Phi-4-mini; 0: none)
    scale: float  # the attention scores' scale (Gemma 2/3: query_pre_attn_scalar**-0.5)
    window: int = 0  # the attention kernel's sliding window and logit soft cap (0: none)
    soft_cap: float = 0.0
    kv_cache_group: int = 0  # its blocks' KV cache group (core/kv_cache_groups.py): whose slots and tables it uses

    @property
    def linears(self) -> tuple[_Linear, _Linear, _Linear, _Linear]:
        return self.qkv, self.o, self.up, self.down


@dataclass(frozen=True, kw_only=True)
class _Layer(_AttentionLayer):
    """A Llama- or Gemma-family layer: RMSNorms are (weight pointer, eps) pairs."""

    ln1: tuple[int, float] | None  # before attention (fused with the residual add after the first layer); None: OLMo 2's
    #                                 post-norm layer, whose attention and MLP read the residual stream itself
    ln2: tuple[int, float]  # after it: fused with the residual add before the MLP, or with `pre_ff` on its own (or, in
    #                         a post-norm layer, the attention output's own norm before its residual add)
    pre_ff: tuple[int, float] | None = None  # Gemma 2/3: the norm fused with the residual add before the MLP
    post_ff: tuple[int, float] | None = None  # Gemma 2/3: the norm of the MLP's output
    q_norm: int = 0  # Qwen3's / Gemma 3's per-head q / k RMSNorm weight pointers (0: none)
    k_norm: int = 0
    qk_eps: float = 0.0
    residual_multiplier: float = 1.0  # Granite: the attention and MLP outputs' factor before each residual add
    qk_whole: bool = False  # OLMo 2/3: the q / k norms span the whole projections (every head at once)


class _Buffers:
    """One step's activations for `t` tokens, reused by every layer. The linears' outputs only where the
    step writes them (GGUF kernels); dense linears return fresh tensors."""

    def __init__(self, t: int, hidden: int, qkv: int, q: int, up: int, act: int, linear_outputs: bool) -> None:
        f32 = torch.float32
        self.t = t
        self.normed = torch.empty((t, hidden), dtype=f32)
        self.attn = torch.empty((t, q), dtype=f32)
        self.act = torch.empty((t, act), dtype=f32)  # a gated MLP's C activation (0 wide: a torch activation's)
        out = (lambda width: torch.empty((t, width), dtype=f32)) if linear_outputs else (lambda width: None)
        self.qkv, self.o, self.up, self.down = out(qkv), out(hidden), out(up), out(hidden)


def direct_forward_enabled() -> bool:
    value = os.environ.get(DIRECT_FORWARD_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{DIRECT_FORWARD_ENV} must be 0/1 (or off/on), got {value!r}")
    return value in ("1", "true", "on")


#: The native kernels of the gated activations, by a MLP's ``gated_activation`` (a Llama MLP has none: SiLU).
GATED_ACTIVATIONS = ("silu", "gelu_tanh")

#: (run_linear(lin, x, out) → x Wᵀ + b (+ LoRA), attend(layer index, layer, qkv rows' pointer) → the step's attention
#: rows): a step's shared calls (DirectForward._step_calls).
StepCalls = tuple[Callable[[_Linear, torch.Tensor, "torch.Tensor | None"], torch.Tensor],
                  Callable[[int, _AttentionLayer, int], None]]


def _norm(norm: nn.Module, width: int) -> tuple[int, float]:
    """An RMSNorm's (weight pointer, eps), checked once."""
    w = norm.weight
    if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu" or w.shape != (width,):
        raise ValueError(f"norm weights must be contiguous float32 [{width}] CPU tensors")
    return w.data_ptr(), float(norm.eps)


def _norm_offset(norm: nn.Module) -> int:
    """What the C norm adds to the weight (RMSNorm.weight_offset: 0, Gemma's 1); a ValueError for other norms."""
    offset = getattr(type(norm), "weight_offset", None)
    if offset not in (0, 1):
        raise ValueError(f"{type(norm).__name__} is not an RMSNorm of the native kernel")
    return int(offset)


class DirectForward:
    """``model.forward`` on the CPU's native and GGUF kernels: what every family's step shares (see module doc). A
    family's subclass reads its settings (``_read_family``) and its layers (``_layer``, of ``_attention_fields``)
    and runs them (``_run_layers``, with the step's ``run_linear`` and ``attend``)."""

    #: whether the MLPs' activation is a C kernel on [gate | up] rows (then `_Buffers.act` holds its output)
    gated = True

    def __init__(self, model: nn.Module, cpu_kernels, quant_kernels: cpu_quant.QuantKernels | None,
                 attn_backend) -> None:
        inner = model.model
        self.model = model
        self.embed_tokens = inner.embed_tokens
        # A pipeline stage (model/pipeline.py) runs its own layers, from the previous stage's hidden states and
        # residual, and sends them on unless it is the last (which applies the final norm).
        self.stage = getattr(inner, "pipeline", None)
        stage_layers = list(inner.layers) if self.stage is None else \
            list(inner.layers[self.stage.start_layer:self.stage.end_layer])
        self.backend = attn_backend
        self.kernels = cpu_kernels
        self._rms, self._rope, self._cache, self._attention, self._silu = cpu_kernels.c_functions()
        self._cache_bf16 = cpu_kernels.cache_writer(torch.bfloat16)  # --kv-cache-dtype bfloat16
        self._cache_fp8 = cpu_kernels.fp8_cache_function()  # --kv-cache-dtype fp8 / fp8_e5m2 (format and scales last)
        self._linear = quant_kernels.c_functions()[0] if quant_kernels is not None else None  # GGUF linears
        self._heads_norm = cpu_kernels.heads_norm_function()  # Qwen3's and Gemma 3's q/k norms
        self._gelu_tanh = cpu_kernels.gelu_tanh_function()  # Gemma's GeGLU
        attn = stage_layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.attn.num_heads, attn.attn.num_kv_heads
        self.head_dim = attn.attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.hidden = int(getattr(inner, "hidden_size", 0)) or inner.norm.weight.shape[0]
        self.embed_scale: float | None = None  # the embeddings' factor (Gemma's sqrt(hidden), Granite's multiplier)
        self._read_family(model)
        # the positions every layer's rotary tables cover (layers without RoPE take any)
        ropes = [layer.self_attn.rotary_emb for layer in stage_layers if layer.self_attn.rotary_emb is not None]
        self.max_position = min((min(rope.cos_cache.shape[0], rope.sin_cache.shape[0]) for rope in ropes),
                                default=int(getattr(model.config, "max_position_embeddings", 1 << 30)))
        self.layers: list[_AttentionLayer] = [self._layer(layer) for layer in stage_layers]
        linears = [lin for lyr in self.layers for lin in lyr.linears]
        if len({lin.dense is None for lin in linears}) != 1:
            raise ValueError("the linears mix GGUF blocks and dense weights")
        methods = {"dense" if lin.dense is not None else lin.weight.gemm_method for lin in linears}
        if len(methods) != 1:
            raise ValueError(f"the GGUF linears use different GEMM designs {sorted(methods)}")
        self.gemm_method = methods.pop()  # "dense": every linear runs its layer's forward
        self.up_width = self.layers[0].up.out_features  # the MLP's first linear's width ([gate | up]: 2 × inter)
        if any(lyr.up.out_features != self.up_width for lyr in self.layers):
            raise ValueError("layers with different intermediate sizes")
        if self.gated and self.up_width % 2:
            raise ValueError("a gated MLP's gate_up_proj of an odd width")
        self._buffers: _Buffers | None = None
        self.lora_manager = None  # --enable-lora: each linear's adapter delta added after its product (lora/manager.py)
        # (caches, pointers, blocks, block_size, pool dtype, (k_scale, v_scale) per layer)
        self._kv: tuple[list, list[tuple[int, int]], int, int, torch.dtype, list[tuple[float, float]]] | None = None

    # -- what a family gives ------------------------------------------------------------------
    def _read_family(self, model: nn.Module) -> None:
        """The family's settings of the model, read before its layers."""

    def _layer(self, layer: nn.Module) -> _AttentionLayer:
        """One decoder layer's description (checked once)."""
        raise NotImplementedError

    def _run_layers(self, residual: torch.Tensor, b: _Buffers, calls: StepCalls,
                    hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder stack and the final norm over the embeddings `residual` (a fresh tensor the step may
        update in place) → the final hidden states. A pipeline stage after the first passes the previous stage's
        `hidden` (its last MLP output) with its `residual`; one before the last gets (hidden, residual) back and
        no final norm."""
        raise NotImplementedError

    @classmethod
    def _refusal(cls, model: nn.Module) -> str | None:
        """Why the family's step does not run `model` (logged), or None."""
        return None

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, model: nn.Module, attn_backend) -> DirectForward | None:
        """The direct forward of ``model``'s family, or None (logged) where none applies."""
        from pagedllm.model.layers.attention import Attention, NativeCpuAttentionBackend

        if not direct_forward_enabled():
            logger.info("CPU direct forward off (%s=0): every step runs the module path", DIRECT_FORWARD_ENV)
            return None
        if not isinstance(attn_backend, NativeCpuAttentionBackend):
            return None
        if hasattr(model, "mamba_state_shape"):  # state-space layers: written for attention stacks only
            logger.info("CPU direct forward not used: %s has state-space (Mamba) layers", type(model).__name__)
            return None
        if any(isinstance(m, Attention) and m.sinks is not None for m in model.modules()):
            logger.info("CPU direct forward not used: %s has attention sinks", type(model).__name__)
            return None
        family = _family_of(model)
        if family is None:  # the layer layouts written here
            logger.info("CPU direct forward not used: written for the Llama, Gemma and LayerNorm (GPT-NeoX, Phi, "
                        "StableLM, StarCoder2) families, not %s", type(model).__name__)
            return None
        if not getattr(model, "direct_forward_supported", True):  # e.g. layers this step does not describe
            logger.info("CPU direct forward not used: %s opts out (direct_forward_supported = False)",
                        type(model).__name__)
            return None
        refusal = family._refusal(model)
        if refusal is not None:
            logger.info("CPU direct forward not used: %s", refusal)
            return None
        try:
            gguf = any(getattr(m, "gguf_weight", None) is not None for m in model.modules())
            fwd = family(model, attn_backend.kernels, cpu_quant.load_quant_kernels() if gguf else None, attn_backend)
        except (AttributeError, ValueError, TypeError, RuntimeError) as e:
            logger.info("CPU direct forward not used: %s", e)
            return None
        if fwd.gemm_method == "dense":
            logger.info("CPU direct forward: %d layers on the native kernels and float32 GEMMs", len(fwd.layers))
        else:
            logger.info("CPU direct forward: %d layers on the native + GGUF kernels (GEMM design %s)",
                        len(fwd.layers), fwd.gemm_method)
        return fwd

    def _linear_of(self, module: nn.Module, in_features: int) -> _Linear:
        if getattr(getattr(module, "tp", None), "size", 1) != 1:
            raise ValueError("tensor parallelism")
        w = getattr(module, "gguf_weight", None)
        if w is None:
            return self._dense_linear_of(module, in_features)
        if w.in_features != in_features:
            raise ValueError(f"a linear takes {w.in_features} features where {in_features} are expected")
        bias = module.bias
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (w.out_features,)):
            raise ValueError("a bias that is not float32 [out_features]")
        return _Linear(w.qtype, w.data_ptr, w.out_features, w.in_features, bias, w, module=module)

    @staticmethod
    def _dense_linear_of(module: nn.Module, in_features: int) -> _Linear:
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if not hasattr(module, "matmul") or getattr(module, "fp8_weight", None) is not None \
                or weight is None or (weight.dim() != 2 and getattr(module, "dense_shape", None) is None):
            raise ValueError(f"{type(module).__name__} is neither GGUF blocks nor a dense float32 linear")
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"a dense linear in {weight.dtype} on {weight.device.type} (float32 CPU weights only)")
        out_features, in_w = module.weight_shape() if hasattr(module, "weight_shape") else weight.shape
        if in_w != in_features:
            raise ValueError(f"a linear takes {in_w} features where {in_features} are expected")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)):
            raise ValueError("a bias that is not float32 [out_features]")
        return _Linear(-1, 0, out_features, in_w, bias, None, module, module)

    def _attention_fields(self, layer: nn.Module, up: nn.Module, down: nn.Module) -> dict:
        """The :class:`_AttentionLayer` fields of `layer` (its attention, and its MLP's linears `up` → `down`),
        checked once."""
        sa = layer.self_attn
        hq, hk, d = sa.attn.num_heads, sa.attn.num_kv_heads, sa.attn.head_dim
        if (hq, hk, d) != (self.num_heads, self.num_kv_heads, self.head_dim):
            raise ValueError("layers with different attention shapes")
        if (sa.q_size, sa.kv_size) != (hq * d, hk * d) or d % 2:
            raise ValueError("an attention layout other than [q | k | v] heads of an even head_dim")
        qkv = self._linear_of(sa.qkv_proj, self.hidden)
        if qkv.out_features != sa.q_size + 2 * sa.kv_size:
            raise ValueError("qkv_proj does not produce [q | k | v]")
        o = self._linear_of(sa.o_proj, sa.q_size)
        up_lin = self._linear_of(up, self.hidden)
        down_lin = self._linear_of(down, up_lin.out_features // 2 if self.gated else up_lin.out_features)
        if o.out_features != self.hidden or down_lin.out_features != self.hidden:
            raise ValueError("projection widths do not match the hidden size")
        rope = sa.rotary_emb
        rotary_dim = rope.rotary_dim if rope is not None else 0
        if rope is not None and (rotary_dim % 2 or not 0 < rotary_dim <= d):
            raise ValueError(f"a rotary dim of {rotary_dim}: the C RoPE takes an even one in (0, head_dim = {d}]")
        for t in (rope.cos_cache, rope.sin_cache) if rope is not None else ():
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" or t.dim() != 2 \
                    or t.shape[-1] != rotary_dim or t.shape[0] < self.max_position:
                raise ValueError("rotary caches must be contiguous float32 [max_position, rotary_dim] CPU tensors")
        attn = sa.attn
        window, soft_cap = window_and_cap(getattr(attn, "sliding_window", None), getattr(attn, "logits_soft_cap", None))
        return dict(qkv=qkv, o=o, up=up_lin, down=down_lin,
                    cos=rope.cos_cache.data_ptr() if rope is not None else 0,
                    sin=rope.sin_cache.data_ptr() if rope is not None else 0, rotary_dim=rotary_dim,
                    scale=float(attn.scale), window=window, soft_cap=soft_cap,
                    kv_cache_group=int(getattr(attn, "kv_cache_group", 0)))

    def _kv_pointers(self, kv_caches) -> tuple[list[tuple[int, int]], int, int, torch.dtype, list[tuple[float, float]]]:
        """(key, value) pointers per layer, the pool's block count, block size and dtype (one of
        cpu_kernels.CACHE_DTYPES), and each layer's FP8 (k_scale, v_scale) from the backend; checked once per
        pool list."""
        cached = self._kv
        if cached is not None and cached[0] is kv_caches and cached[1][0][0] == kv_caches[0][0].data_ptr():
            return cached[1:]
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        shape = tuple(kv_caches[0][0].shape)
        if len(shape) != 4 or shape[2:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"KV cache of shape {shape} does not hold [blocks, block_size, "
                             f"{self.num_kv_heads}, {self.head_dim}]")
        dtype = kv_caches[0][0].dtype
        if dtype not in KV_FORMATS:
            raise ValueError(f"KV caches must be float32, bfloat16 or fp8, got {dtype}")
        ptrs = []
        for k, v in kv_caches:
            for t in (k, v):
                if t.dtype != dtype or not t.is_contiguous() or tuple(t.shape) != shape or t.device.type != "cpu":
                    raise ValueError(f"KV caches must be contiguous {dtype} CPU tensors of one shape")
            ptrs.append((k.data_ptr(), v.data_ptr()))
        scales = [tuple(map(float, self.backend.scales_for(k))) for k, _ in kv_caches]
        self._kv = (kv_caches, ptrs, shape[0], shape[1], dtype, scales)  # holds the list: its id is never reused
        return ptrs, shape[0], shape[1], dtype, scales

    # -- the step ----------------------------------------------------------------------------
    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whole steps whose chunks all take the native attention kernel (the module path sends long
        prompt chunks to torch's SDPA instead)."""
        return meta.max_query_len <= self.backend.max_native_query_len

    def _buffers_for(self, t: int) -> _Buffers:
        b = self._buffers
        if b is None or b.t != t:
            b = self._buffers = _Buffers(t, self.hidden, self.q_size + 2 * self.kv_size, self.q_size, self.up_width,
                                         self.up_width // 2 if self.gated else 0,
                                         linear_outputs=self.gemm_method != "dense")
        return b

    def _check_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    num_blocks: int, block_size: int) -> None:
        """What the kernels follow without bounds checks, checked once for the step."""
        t = input_ids.shape[0]
        for name, x in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", meta.slot_mapping)):
            if x.dtype != torch.int64 or not x.is_contiguous() or x.shape != (t,) or x.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous int64 CPU tensor with one entry per token")
        if meta.max_seq_len > self.max_position or (t and int(positions.min()) < 0):
            raise ValueError(f"positions must lie in [0, {self.max_position}) (the rotary cache)")
        if t and int(meta.slot_mapping.max()) >= num_blocks * block_size:
            raise ValueError(f"slot_mapping holds slots beyond the pool's {num_blocks * block_size}")
        for group in meta.group_metadata or (meta,):
            if group is not meta and t and int(group.slot_mapping.max()) >= num_blocks * block_size:
                raise ValueError(f"slot_mapping holds slots beyond the pool's {num_blocks * block_size}")
            self.kernels.check_attention_indices(group.block_tables, group.seq_lens, group.query_start_loc, t,
                                                 num_blocks, block_size)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata
                 ) -> torch.Tensor:
        """The final hidden states [T, hidden] (possibly a buffer the next call overwrites), as ``model(...)``
        returns."""
        kv, num_blocks, block_size, kv_dtype, kv_scales = self._kv_pointers(kv_caches)
        self._check_step(input_ids, positions, meta, num_blocks, block_size)
        t = input_ids.shape[0]
        stage, hidden = self.stage, None
        if stage is not None and not stage.is_first:
            hidden, residual = stage.recv_activations([(t, self.hidden)] * 2, torch.float32, input_ids.device)
        else:
            residual = self.embed_tokens(input_ids)
            if self.embed_scale is not None:  # Gemma, as GemmaModel.forward: one float32 product per value
                residual = residual * self.embed_scale
        if residual.dtype != torch.float32 or not residual.is_contiguous() or residual.shape != (t, self.hidden):
            raise ValueError("the embedding must give contiguous float32 [tokens, hidden] rows")
        if t == 0:
            if stage is not None and not stage.is_last:
                stage.send_activations([residual, residual])
            return residual
        b = self._buffers_for(t)
        calls = self._step_calls(t, b, positions, meta, kv, block_size, kv_dtype, kv_scales)
        if stage is None:
            return self._run_layers(residual, b, calls)
        out = self._run_layers(residual, b, calls, hidden)
        if not stage.is_last:
            stage.send_activations(list(out))
            return out[0]  # (not read: the last stage computes the logits)
        return out

    def _step_calls(self, t: int, b: _Buffers, positions: torch.Tensor, meta: AttentionMetadata,
                    kv: list[tuple[int, int]], block_size: int, kv_dtype: torch.dtype,
                    kv_scales: list[tuple[float, float]]) -> StepCalls:
        """The step's `run_linear` and `attend` (StepCalls), with its pointers bound."""
        gemm = self.gemm_method
        method = 0 if gemm == "dense" else cpu_quant.METHOD_CODES[cpu_quant.choose_method() if gemm == "auto" else gemm]
        linear = self._linear
        lora = self.lora_manager if self.lora_manager is not None and self.lora_manager.step_has_adapters else None

        def run_linear(lin: _Linear, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            """x Wᵀ + b (+ the step's LoRA deltas) as a contiguous [t, out_features] tensor: `out` (GGUF), or the
            dense GEMM's result."""
            if lin.dense is not None:  # the layer's own forward (no hooks): the module path's bits, bias included
                out = lin.dense.forward(x)
            else:
                rc = linear(lin.qtype, lin.data_ptr, lin.out_features, lin.in_features, x.data_ptr(), t,
                            out.data_ptr(), method)
                if rc:
                    raise RuntimeError(f"quant_linear failed with status {rc} (K={lin.in_features})")
                if lin.bias is not None:
                    out.add_(lin.bias)
            if lora is not None:
                lora.add_lora_delta(lin.module, x, out)
            return out

        rope, attention = self._rope, self._attention
        kv_fmt = KV_FORMATS[kv_dtype]
        fp8, e5m2 = kv_fmt >= KV_FORMATS[torch.float8_e4m3fn], int(kv_dtype == torch.float8_e5m2)
        cache, cache_fp8 = self._cache_bf16 if kv_dtype == torch.bfloat16 else self._cache, self._cache_fp8
        min_tile = self.backend.min_tile_query_len
        qkv_w, q, kvs = self.q_size + 2 * self.kv_size, self.q_size, self.kv_size
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        att, pos = b.attn.data_ptr(), positions.data_ptr()
        lens, qsl, num_seqs = meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(), meta.num_seqs
        # Per KV cache group: (slot mapping, block tables, table stride); one entry without groups.
        group_ptrs = [(g.slot_mapping.data_ptr(), g.block_tables.data_ptr(), g.block_tables.stride(0))
                      for g in meta.group_metadata or (meta,)]

        def attend(i: int, layer: _AttentionLayer, qkv: int) -> None:
            """Layer i's attention over its [t, q | k | v] rows at `qkv` (q and k rotated in place, k and v cached)
            into the step's attention rows (`b.attn`)."""
            k_ptr, v_ptr = qkv + 4 * q, qkv + 4 * (q + kvs)
            if layer.rotary_dim:
                rope(qkv, qkv_w, hq, k_ptr, qkv_w, hk, pos, layer.cos, layer.sin, t, d, layer.rotary_dim)
            key_cache, value_cache = kv[i]
            k_scale, v_scale = kv_scales[i]
            slots, tables, table_stride = group_ptrs[layer.kv_cache_group]
            if fp8:
                cache_fp8(k_ptr, v_ptr, qkv_w, key_cache, value_cache, slots, t, kvs, e5m2, k_scale, v_scale)
            else:
                cache(k_ptr, v_ptr, qkv_w, key_cache, value_cache, slots, t, kvs)
            if attention(att, q, qkv, qkv_w, key_cache, value_cache, tables, table_stride, lens, qsl, num_seqs,
                         hq, hk, d, block_size, layer.scale, kv_fmt, min_tile, k_scale, v_scale, layer.window,
                         layer.soft_cap):
                raise MemoryError("paged_attention_f32 could not allocate its scratch rows")

        return run_linear, attend


def _family_of(model: nn.Module) -> type[DirectForward] | None:
    """The direct forward class of `model`'s family, or None."""
    from pagedllm.model.models.gemma import GemmaForCausalLM
    from pagedllm.model.models.gpt_neox import LayerNormCausalLM
    from pagedllm.model.models.llama import LlamaForCausalLM

    if isinstance(model, (LlamaForCausalLM, GemmaForCausalLM)):
        return LlamaDirectForward
    if isinstance(model, LayerNormCausalLM):
        from pagedllm.model.cpu_direct_forward_layernorm import LayerNormDirectForward

        return LayerNormDirectForward
    return None


class LlamaDirectForward(DirectForward):
    """The Llama and Gemma families' step (see module doc): RMSNorms fused with the residual adds, gated MLPs."""

    def _read_family(self, model: nn.Module) -> None:
        inner = model.model
        last = self.stage is None or self.stage.is_last  # (earlier pipeline stages hold no final norm)
        layers = [layer for layer in inner.layers if hasattr(layer, "mlp")]  # (a stage's own)
        # The family's settings: the norms' (1 + w) (Gemma), the gated activation, the embeddings' factor (Gemma).
        self.unit_offset = _norm_offset(inner.norm if last else layers[0].post_attention_layernorm)
        activations = {getattr(layer.mlp, "gated_activation", "silu") for layer in layers}
        if len(activations) != 1 or not activations <= set(GATED_ACTIVATIONS):
            raise ValueError(f"gated activations {sorted(activations)}: the native kernels take one of "
                             f"{GATED_ACTIVATIONS} for every layer")
        self.activation = activations.pop()
        # GemmaModel: embeddings * sqrt(hidden); LlamaModel: * embedding_multiplier (Granite's; 1 for the others)
        scale = getattr(inner, "normalizer", None)
        if scale is None and float(getattr(inner, "embedding_multiplier", 1.0)) != 1.0:
            scale = inner.embedding_multiplier
        self.embed_scale = None if scale is None else float(scale)
        self.final_norm = _norm(inner.norm, self.hidden) if last else None

    @classmethod
    def _refusal(cls, model: nn.Module) -> str | None:
        mlp = next((layer.mlp for layer in model.model.layers
                    if hasattr(layer, "mlp") and not hasattr(layer.mlp, "gate_up_proj")), None)
        if mlp is not None:  # MoE blocks (models/moe.py) run through their modules
            return f"written for dense MLPs, and {type(model).__name__} has {type(mlp).__name__} blocks"
        return None

    def _layer(self, layer: nn.Module) -> _Layer:
        sa, mlp = layer.self_attn, layer.mlp
        d = self.head_dim
        fields = self._attention_fields(layer, mlp.gate_up_proj, mlp.down_proj)
        # Gemma 2/3's sandwich: post_attention_layernorm on the attention output alone, then the pre- and post-
        # feed-forward norms (GemmaDecoderLayer); a Llama layer has neither attribute, a Gemma 1 layer has them None.
        pre_ff = getattr(layer, "pre_feedforward_layernorm", None)
        post_ff = getattr(layer, "post_feedforward_layernorm", None)
        # OLMo 2/3's post-norm layer (Olmo2DecoderLayer): no input norm, the attention output normed before its
        # residual add (post_attention_layernorm) and the MLP output too (post_feedforward_layernorm).
        input_norm = getattr(layer, "input_layernorm", None)
        post_norm = input_norm is None
        if post_norm and (post_ff is None or pre_ff is not None):
            raise ValueError("a layer without an input norm that is not OLMo 2's post-norm layout")
        if not post_norm and (pre_ff is None) != (post_ff is None):
            raise ValueError("a layer with one of the pre- and post-feed-forward norms but not the other")
        sandwich = pre_ff is not None
        norms = [n for n in (input_norm, layer.post_attention_layernorm, pre_ff, post_ff) if n is not None]
        qk = dict(q_norm=0, k_norm=0, qk_eps=0.0, qk_whole=False)
        if sa.q_norm is not None:
            norms += [sa.q_norm, sa.k_norm]
            if float(sa.q_norm.eps) != float(sa.k_norm.eps):
                raise ValueError("q/k norms with different eps")
            whole = sa.q_norm.weight.shape[0] != d  # OLMo 2: one norm over all of q's heads (and one over k's)
            qk = dict(q_norm=_norm(sa.q_norm, sa.q_size if whole else d)[0],
                      k_norm=_norm(sa.k_norm, sa.kv_size if whole else d)[0], qk_eps=float(sa.q_norm.eps),
                      qk_whole=whole)
        if any(_norm_offset(n) != self.unit_offset for n in norms):
            raise ValueError("norms of different kinds (w and 1 + w) in one model")
        multiplier = float(getattr(layer, "residual_multiplier", 1.0))
        if multiplier != 1.0 and (sandwich or post_norm):
            raise ValueError("a residual multiplier on sandwich- or post-normed layers")
        return _Layer(**fields, ln1=None if post_norm else _norm(input_norm, self.hidden),
                      ln2=_norm(layer.post_attention_layernorm, self.hidden),
                      pre_ff=_norm(pre_ff, self.hidden) if sandwich else None,
                      post_ff=_norm(post_ff, self.hidden) if post_ff is not None else None,
                      residual_multiplier=multiplier, **qk)

    def _run_layers(self, residual: torch.Tensor, b: _Buffers, calls: StepCalls,
                    hidden: torch.Tensor | None = None):
        run_linear, attend = calls
        t = residual.shape[0]
        rms, heads_norm, off = self._rms, self._heads_norm, self.unit_offset
        gated = self._gelu_tanh if self.activation == "gelu_tanh" else self._silu
        h, qkv_w, q, kvs = self.hidden, self.q_size + 2 * self.kv_size, self.q_size, self.kv_size
        hq, hk, d, inter = self.num_heads, self.num_kv_heads, self.head_dim, self.up_width // 2
        res, normed, act = residual.data_ptr(), b.normed.data_ptr(), b.act.data_ptr()
        down_out = hidden  # the previous layer's MLP output (a tensor: it must outlive the next norm)
        for i, layer in enumerate(self.layers):
            if layer.ln1 is None:  # OLMo 2/3: the layer reads the residual stream (+= the previous MLP output) as is
                if down_out is not None:
                    residual.add_(down_out)
                layer_in = residual
            elif down_out is None:  # as the module path: residual = embedding; hidden = norm(embedding)
                rms(normed, 0, res, h, 0, 0, layer.ln1[0], t, h, layer.ln1[1], off)
                layer_in = b.normed
            else:  # residual += previous MLP output; hidden = norm(residual)
                rms(normed, res, down_out.data_ptr(), h, res, h, layer.ln1[0], t, h, layer.ln1[1], off)
                layer_in = b.normed
            qkv_out = run_linear(layer.qkv, layer_in, b.qkv)  # held: a dense linear's result is a fresh tensor
            qkv = qkv_out.data_ptr()
            if layer.qk_whole:  # OLMo 2/3: q's and k's rows normalised whole (one "head" each), in place, before RoPE
                heads_norm(qkv, qkv_w, 1, layer.q_norm, t, q, layer.qk_eps, off)
                heads_norm(qkv + 4 * q, qkv_w, 1, layer.k_norm, t, kvs, layer.qk_eps, off)
            elif layer.q_norm:  # Qwen3, Gemma 3: each head's q and k normalised in place, before RoPE
                heads_norm(qkv, qkv_w, hq, layer.q_norm, t, d, layer.qk_eps, off)
                heads_norm(qkv + 4 * q, qkv_w, hk, layer.k_norm, t, d, layer.qk_eps, off)
            attend(i, layer, qkv)
            o_out = run_linear(layer.o, b.attn, b.o)  # held: a dense linear's result is a fresh tensor
            if layer.residual_multiplier != 1.0:  # Granite, as its layer: the output times m, then the add
                o_out.mul_(layer.residual_multiplier)
            o_ptr = o_out.data_ptr()
            mlp_in = b.normed
            if layer.ln1 is None:  # OLMo 2/3: the output normed alone (in place), then residual += it: the MLP's input
                rms(o_ptr, 0, o_ptr, h, 0, 0, layer.ln2[0], t, h, layer.ln2[1], off)
                residual.add_(o_out)
                mlp_in = residual
            elif layer.pre_ff is None:  # residual += attention output; hidden = norm(residual)
                rms(normed, res, o_ptr, h, res, h, layer.ln2[0], t, h, layer.ln2[1], off)
            else:  # Gemma 2/3: the output normed alone (in place), then residual += it; hidden = norm(residual)
                rms(o_ptr, 0, o_ptr, h, 0, 0, layer.ln2[0], t, h, layer.ln2[1], off)
                rms(normed, res, o_ptr, h, res, h, layer.pre_ff[0], t, h, layer.pre_ff[1], off)
            gu_out = run_linear(layer.up, mlp_in, b.up)
            gated(act, gu_out.data_ptr(), 2 * inter, t, inter)
            down_out = run_linear(layer.down, b.act, b.down)
            if layer.residual_multiplier != 1.0:
                down_out.mul_(layer.residual_multiplier)
            if layer.post_ff is not None:  # Gemma 2/3, OLMo 2/3: the MLP output normed (in place) before the residual add
                down = down_out.data_ptr()
                rms(down, 0, down, h, 0, 0, layer.post_ff[0], t, h, layer.post_ff[1], off)
        if self.final_norm is None:  # a pipeline stage before the last: the next one adds and norms
            return down_out, residual
        rms(normed, res, down_out.data_ptr(), h, res, h, self.final_norm[0], t, h, self.final_norm[1], off)
        return b.normed
