"""A worker: one device (or one tensor-parallel rank) holding a model shard and its KV pools."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import os
import time
from collections import Counter
from typing import Iterable

import torch

from pagedllm import batch_invariance
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_groups import KVCacheLayout, single_group_layout
from pagedllm.distributed.parallel_state import PipelineParallelGroup, TensorParallelGroup, shard_attention_heads
from pagedllm.kernels import cpu_isa, cpu_kernels, cpu_linear, kv_quant
from pagedllm.kernels.compile_watch import watchers_paused
from pagedllm.model import loader
from pagedllm.model.fp8_checkpoint import (
    build_for_fp8_checkpoint,
    detect_fp8_checkpoint,
    finish_fp8_checkpoint,
    fp8_checkpoint_weights,
    keeps_fp8,
    log_fp8_checkpoint,
    prepare_for_fp8_checkpoint,
)
from pagedllm.model.int_weight_checkpoint import detect_int_weight_checkpoint
from pagedllm.model.layers.attention import (
    Attention,
    NativeCpuAttentionBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
)
from pagedllm.model.layers.linear import (
    PackableGemm,
    pack_weights_for_cpu,
    quantize_weights_fp8,
    restore_dense_weights,
)
from pagedllm.model.layers.int_weight_blocks import IntCheckpointLoad, resolve_int_weight_quantization
from pagedllm.model.layers.quantized_linear import (
    attach_gguf_experts,
    attach_gguf_weights,
    log_attach_report,
    num_parameters,
    resolve_quantization,
)
from pagedllm.model.models.registry import (get_model_class, is_base_model, is_encoder_only, kv_cache_head_size,
                                             kv_cache_layout, kv_cache_uses_mla, layer_sliding_windows,
                                             text_config)
from pagedllm.model.models.weights import init_dummy_weights
from pagedllm.model.gguf_gpt_oss import mxfp4_expert_weights
from pagedllm.model.mxfp4 import MXFP4, build_with_mxfp4_experts, resolve_mxfp4
from pagedllm.model.pooling_weights import base_model_weights, share_lm_head_with_embeddings
from pagedllm.model.layers.mamba_state import allocate_layer_caches, copy_state_slots
from pagedllm.model.meta_build import build_on_meta, materialize
from pagedllm.model.pipeline import keep_pipeline_stage, stage_weights
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.engine.sleep_mode import SLEEP_TAGS, check_sleep_args, check_wake_tags
from pagedllm.worker.cpu_memory import keep_freed_memory_for_reuse, release_free_memory
from pagedllm.worker.cpu_offload import CpuOffloadReport, host_parameters, offload_layers_to_cpu
from pagedllm.worker.kv_scale_calibration import (
    KVCalibration,
    calibrate_kv_amax,
    calibration_token_ids,
    log_calibration,
)
from pagedllm.worker.model_input import ExecuteModelRequest
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.profiler import ProfilerError, TorchProfiler, TorchProfilerConfig
from pagedllm.worker.sleep_offload import OffloadedModel, offload_model, restore_model

logger = logging.getLogger("pagedllm")
# vLLM's CPU backend variable: the KV cache's size in GiB on the CPU (0 or unset: sized from free memory).
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """The model dtype: "auto" is bfloat16 on CUDA (any "cuda:N") and float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _DTYPES[dtype]


def log_amx_bf16_hint() -> None:
    """On a CPU with AMX-BF16 tiles, say once that dense float32 weights leave them unused."""
    if "amx_bf16" in cpu_isa.cpu_flags() and cpu_linear.bf16_packing_unsupported_reason() is None:
        logger.info("This CPU has AMX-BF16 tiles, which float32 GEMMs leave unused: --dtype bfloat16 runs them "
                    "(on the bundled model 1.9-2.0x faster with 64 sequences in flight, 0.88x with one; "
                    "BENCHMARKS.md §52.9; outputs then differ from float32's).")


def set_kv_cache_groups(model: torch.nn.Module, layer_groups: list[int]) -> None:
    """Tell each attention layer (in layer order) which KV cache group its blocks are in."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(layer_groups):
        raise ValueError(f"{len(layers)} attention layers, {len(layer_groups)} KV cache group entries")
    for attn, group in zip(layers, layer_groups):
        attn.kv_cache_group = group


def kv_geometry(hf_config, tp_size: int, rank: int = 0) -> tuple[int, int, int]:
    """(num_layers, KV heads this rank holds, head_dim) from a HF config (a multimodal one's text_config). An MLA
    model caches one latent "head" per token, whole on every rank."""
    hf_config = text_config(hf_config)
    if kv_cache_uses_mla(hf_config):
        return hf_config.num_hidden_layers, 1, kv_cache_head_size(hf_config)
    # (a hybrid state-space model caches K/V for its attention layers only: one window each; a pure one, none)
    num_layers = len(layer_sliding_windows(hf_config))
    if not num_layers:
        return 0, 0, 0
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    shard = shard_attention_heads(heads, kv_heads, tp_size, rank)
    return num_layers, shard.num_kv_heads, kv_cache_head_size(hf_config)


class Worker:
    def __init__(self, config: EngineConfig, model_dir: str, hf_config, tp: TensorParallelGroup | None = None,
                 pp: PipelineParallelGroup | None = None) -> None:
        self.config = config
        self.model_dir = model_dir
        self.hf_config = hf_config
        self.tp = tp or TensorParallelGroup()
        self.pp = pp if pp is not None and pp.size > 1 else None  # this rank's pipeline stage (model/pipeline.py)
        device = config.device_config.resolve()
        self.device = torch.device(device)
        self.dtype = resolve_dtype(config.model_config.dtype, device)
        self.warm_started = False  # init_cache: graphs captured / kernels compiled (CUDA)
        # The KV pool's element type (--kv-cache-dtype); an FP8 pool's per-layer scales are 1.0 until
        # init_cache calibrates them (--calculate-kv-scales, worker/kv_scale_calibration.py).
        self.kv_spec = kv_quant.KVCacheSpec(kv_quant.resolve_cache_dtype(config.cache_config.cache_dtype,
                                                                         self.dtype, device))
        self.use_mla = kv_cache_uses_mla(hf_config)
        if self.use_mla and self.kv_spec.is_fp8:
            raise ValueError(f"kv_cache_dtype={config.cache_config.cache_dtype!r} is not supported with MLA: its one "
                             f"latent pool is read as keys and as values, which FP8 stores with separate scales "
                             f"(k_scale, v_scale), so the value write would overwrite the key's quantization; use "
                             f"kv_cache_dtype='auto' or 'bfloat16'.")
        if config.model_config.quantization == "fp8" and device != "cuda":
            raise ValueError(f"quantization='fp8' needs a CUDA device (torch._scaled_mm on Hopper); this engine "
                             f"runs on {device!r}: leave quantization unset.")
        if config.model_config.quantization == "fp8" and self.dtype != torch.bfloat16:
            raise ValueError(f"quantization='fp8' runs _scaled_mm with row-wise scales, whose outputs are bfloat16: "
                             f"use dtype='bfloat16' (or 'auto'), not {config.model_config.dtype!r}.")
        self.gguf_path = self._gguf_source()
        dummy = config.model_config.load_format == "dummy"
        # A GPTQ / AWQ / compressed-tensors integer checkpoint (model/int_weight_checkpoint.py), or one stored in FP8
        # (model/fp8_checkpoint.py): its layers load as such.
        self.int_format = None if dummy else detect_int_weight_checkpoint(hf_config, config.model_config.quantization)
        self.fp8_format = None if dummy or self.int_format is not None else detect_fp8_checkpoint(hf_config)
        self.int_checkpoint: IntCheckpointLoad | None = None
        if self.int_format is not None:  # "gguf" (its layers as GGUF blocks: CPU, float32) or None (dequantized)
            self.quantization = resolve_int_weight_quantization(self.int_format, config.model_config.quantization,
                                                                device, self.dtype, self.tp.size)
        else:  # --quantization gguf (the default for a quantized GGUF on the CPU) keeps the file's blocks.
            self.quantization = resolve_quantization(config.model_config.quantization, self.gguf_path, device,
                                                     self.dtype)
        if not dummy and self.quantization != "gguf" \
                and resolve_mxfp4(config.model_config.quantization, hf_config, self.device.type, self.dtype):
            self.quantization = MXFP4  # the experts stay MXFP4 (model/mxfp4.py)
        if self.pp is not None and self.quantization == "gguf" and config.model_config.quantization is None:
            logger.info("Pipeline stage %d: the GGUF file's blocks are dequantized at load (the stages run float "
                        "weights)", self.pp.rank)
            self.quantization = None
        if self.pp is not None and (self.quantization is not None or self.int_format or self.fp8_format):
            kept = self.int_format or self.fp8_format or self.quantization
            raise ValueError(f"pipeline_parallel_size={self.pp.size}: the stages load float weights, and this "
                             f"checkpoint's are kept as {kept!r}; pass quantization='none' to dequantize them at "
                             "load (a GGUF file's blocks), or use tensor_parallel_size.")
        self.model = None
        # What loading took on a CUDA device, and its peak (load_model); 0 elsewhere.
        self.model_memory_bytes = 0
        self.cpu_offload: CpuOffloadReport | None = None  # --cpu-offload-gb's layers (worker/cpu_offload.py)
        self.model_load_peak_bytes = 0
        self.cache_engine: CacheEngine | None = None
        self.mamba_caches: list | None = None  # state-space layers' state slots (_init_mamba_state)
        self.model_runner: ModelRunner | None = None
        self.lora_manager = None  # a LoRAModelManager with --enable-lora
        # BERT-family encoders (model/models/bert.py) keep no KV cache: the pool has no tensors, its blocks only
        # count what the scheduler admits.
        self.encoder_only = is_encoder_only(hf_config)
        # speculative_config.model: the draft checkpoint's worker (spec_decode/draft_checkpoint.py), whose KV pool has
        # this worker's block count and is indexed by the same block tables.
        self.draft_worker: Worker | None = None
        self.is_draft = False  # this worker is a draft checkpoint's (its CUDA graphs or eager warm-up: init_cache)

    def load_model(self) -> None:
        t0 = time.perf_counter()
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()
            cpu_isa.detect_cpu_isa()  # logs the ISA level once; a bad PAGEDLLM_CPU_ISA fails here, before loading
        if self.config.model_config.batch_invariant:
            self._check_batch_invariance()
        mc = self.config.model_config
        cls = get_model_class(self.hf_config)
        # What this process held on the device before this worker's model (another engine in the same
        # process): gpu_memory_utilization is this engine's share, so profiling leaves that memory out.
        self.memory_baseline = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        keep_fp8 = keeps_fp8(self.device.type, self.dtype, mc.quantization)
        if self.fp8_format is not None:  # e4m3 weights allocated as such
            model = build_for_fp8_checkpoint(lambda: cls(self.hf_config, self.tp, self.dtype), self.device,
                                             self.fp8_format, keep_fp8)
        elif self.quantization == MXFP4:  # the experts allocated as MXFP4 bytes, never as floats
            model = build_with_mxfp4_experts(lambda: cls(self.hf_config, self.tp, self.dtype), self.device)
        elif self.pp is not None:  # only this stage's layers are given memory
            model = materialize(keep_pipeline_stage(build_on_meta(lambda: cls(self.hf_config, self.tp, self.dtype)),
                                                    self.pp), self.device)
        else:
            model = self._build_with_host_layers(cls)
            if model is None:
                with torch.device(self.device):
                    model = cls(self.hf_config, self.tp, self.dtype)
        if mc.runner == "pooling":
            share_lm_head_with_embeddings(model)
        if mc.load_format == "dummy":
            init_dummy_weights(model, seed=mc.seed)
        elif self.fp8_format is not None:
            self._load_fp8_checkpoint(model, keep_fp8)
        else:
            held: frozenset[str] = frozenset()
            mxfp4_experts: Iterable[tuple[str, torch.Tensor]] = ()
            if self.int_format is None and self.quantization == "gguf":  # experts kept as GGUF blocks: not read
                held = attach_gguf_experts(model, self.gguf_path)
            elif self.quantization == MXFP4 and self.gguf_path is not None:  # a gpt-oss GGUF's MXFP4 experts as bytes
                held, mxfp4_experts = mxfp4_expert_weights(self.gguf_path, self.hf_config.num_local_experts)
            weights = itertools.chain(loader.iterate_weights(self.model_dir, mc.load_format, skip=held.__contains__),
                                      mxfp4_experts)
            if is_base_model(self.hf_config) and not self.encoder_only:  # (encoders load their own names)
                weights = base_model_weights(weights)
            if self.int_format is not None:
                self.int_checkpoint = IntCheckpointLoad(self.int_format, keep_blocks=self.quantization == "gguf")
                weights = self.int_checkpoint.weights(weights)
            if self.pp is not None:
                weights = stage_weights(model, weights)
            model.load_weights(weights)
        self.model = model.eval()
        gemm = self.process_weights_after_loading()
        if budget := self._offload_budget():
            self.cpu_offload = offload_layers_to_cpu(model, budget, self.device)
        n_params = num_parameters(model)
        logger.info(
            "Loaded %s (%.1fM params, %s, %s, GEMMs: %s) in %.2f s",
            type(model).__name__, n_params / 1e6, self.dtype, self.device, gemm, time.perf_counter() - t0,
        )
        if self.device.type == "cpu" and self.dtype == torch.float32 and self.quantization != "gguf":
            log_amx_bf16_hint()
        if self.config.lora_config is not None:
            self._init_lora_slots()
        if self.device.type == "cuda":
            # The peak shows whether loading ever held more than the final weights (an FP8 checkpoint must not
            # pass through its bf16 size).
            self.model_memory_bytes = torch.cuda.memory_allocated(self.device) - self.memory_baseline
            self.model_load_peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.memory_baseline
            logger.info("Model loading took %.2f GiB (peak %.2f GiB while loading)",
                        self.model_memory_bytes / 2**30, self.model_load_peak_bytes / 2**30)
        spec = self.config.speculative_config
        if spec is not None and spec.model is not None and self.draft_worker is None:
            from pagedllm.spec_decode.draft_checkpoint import load_draft_worker

            self.draft_worker = load_draft_worker(self)

    def _offload_budget(self) -> int:
        """Bytes of weights --cpu-offload-gb keeps in host memory (the target's budget: a draft keeps none)."""
        on = self.device.type == "cuda" and not self.is_draft
        return int(self.config.cache_config.cpu_offload_gb * 2**30) if on else 0

    def _build_with_host_layers(self, cls) -> torch.nn.Module | None:
        """With --cpu-offload-gb on a float checkpoint: the model built on the meta device and materialized with the
        offloaded layers' weights in pinned host memory, so they never occupy the GPU, even while loading (a model
        larger than the GPU loads). None where that does not apply, or the model cannot be built so."""
        budget = self._offload_budget()
        if not budget or self.quantization is not None or self.int_format is not None \
                or self.config.model_config.batch_invariant:
            return None
        model = build_on_meta(lambda: cls(self.hf_config, self.tp, self.dtype))
        on_host = host_parameters(model, budget)
        try:
            return materialize(model, self.device, on_host=lambda p: id(p) in on_host)
        except ValueError as e:
            logger.info("cpu_offload_gb: %s The model is built on the GPU, then its layers are offloaded.", e)
            return None

    def _check_batch_invariance(self) -> None:
        """VLLM_BATCH_INVARIANT=1: a clear error where this engine cannot give it, before the model loads."""
        native_f32_gemm = False
        if self.device.type == "cpu" and self.dtype == torch.float32 and self.quantization != "gguf":
            from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm

            native_f32_gemm = (cpu_linear.f32_small_rows_wanted() and cpu_linear.cpu_gemm_backend() == "onednn"
                               and cpu_kernels.kernels_choice() != "torch" and load_f32_gemm() is not None)
        native_kernels = self.device.type == "cpu" and cpu_kernels.load_cpu_kernels() is not None
        mc = self.config.model_config
        fp8_weights = mc.quantization == "fp8" or self.fp8_format is not None
        why = batch_invariance.unsupported_reason(self.device.type, str(self.dtype).removeprefix("torch."),
                                                  self.quantization, native_kernels, native_f32_gemm,
                                                  fp8_weights=fp8_weights, tensor_parallel_size=self.tp.size)
        spec = self.config.speculative_config
        if why is None and spec is not None and spec.method == "ngram_gpu":
            why = ("speculative method 'ngram_gpu' verifies and samples in its own device kernels, which are not "
                   "checked for batch invariance: use method 'ngram'.")
        if why is not None:
            raise ValueError(f"{batch_invariance.BATCH_INVARIANT_ENV}=1: {why}")
        if self.device.type == "cuda":
            logger.info("Batch invariance on (%s=1): attention through the unified kernel, linears through the "
                        "Triton GEMM without split-K (both also inside the CUDA graphs)",
                        batch_invariance.BATCH_INVARIANT_ENV)
            return
        logger.info("Batch invariance on (%s=1): every chunk on the attention kernel's token path%s",
                    batch_invariance.BATCH_INVARIANT_ENV,
                    "" if self.quantization == "gguf" else ", float32 linears on the native GEMM at every row count")

    def _load_fp8_checkpoint(self, model, keep_fp8: bool) -> None:
        """Load an FP8 checkpoint: its e4m3 layers stay FP8 (`keep_fp8`) or are dequantized to the model's dtype."""
        mc = self.config.model_config
        tensors: Counter = Counter()
        prepare_for_fp8_checkpoint(model)
        model.load_weights(fp8_checkpoint_weights(loader.iterate_weights(self.model_dir, mc.load_format),
                                                  self.fp8_format, tensors))
        log_fp8_checkpoint(self.fp8_format, tensors, finish_fp8_checkpoint(model, keep_fp8), self.dtype)

    def _gguf_source(self) -> str | None:
        """The .gguf file the model comes from, if it does."""
        mc = self.config.model_config
        if mc.load_format == "dummy":
            return None
        try:
            path = loader.resolve_model(mc.model)
        except (FileNotFoundError, ValueError):
            return None
        return path if path.lower().endswith(".gguf") or loader.is_gguf_file(path) else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the loaded model's weights (name, tensor pairs in checkpoint naming)."""
        if self.quantization == "gguf":
            raise ValueError("load_weights cannot replace GGUF-quantized weights; build the engine with "
                             "quantization='none' to load other weights.")
        if self.fp8_format is not None:
            raise ValueError("load_weights cannot replace the weights of a model loaded from an FP8 checkpoint; "
                             "build a new engine for the new checkpoint.")
        if self.cpu_offload is not None:
            raise ValueError(f"load_weights cannot replace weights offloaded with cpu_offload_gb (the first "
                             f"{self.cpu_offload.layers} layers are copied in from host memory at every forward); "
                             "build the engine without cpu_offload_gb to load other weights.")
        restore_dense_weights(self.model)  # loaders write the dense weights that packing may have released
        self.model.load_weights(weights)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> str:
        """On CPU, pack the linear layers' weights for oneDNN; with --quantization fp8, quantize them;
        returns the GEMM path in use."""
        if self.config.model_config.quantization == "fp8":
            n = quantize_weights_fp8(self.model)
            return f"fp8 _scaled_mm ({n} layers)"
        if self.quantization == "gguf":
            # Every GEMM design gives a row the same bits in any batch, so speculative verification (k+1
            # rows per sequence) reproduces plain decoding exactly: no design needs pinning.
            gemm = "auto"
            if self.int_checkpoint is not None:  # blocks made from an integer checkpoint's groups
                report = self.int_checkpoint.attach(self.model, gemm)
            else:
                report = attach_gguf_weights(self.model, self.gguf_path, gemm_method=gemm)
                log_attach_report(report)
            return f"gguf quantized ({report.quantized_layers} layers, GEMM design {gemm})"
        if (kept := sum(getattr(m, "fp8_weight", None) is not None for m in self.model.modules())):
            return f"fp8 _scaled_mm ({kept} layers from the FP8 checkpoint)"
        experts = "; MXFP4 experts" if self.quantization == MXFP4 else ""
        if self.device.type != "cpu":
            if self.config.model_config.batch_invariant:  # _check_batch_invariance passed
                return self._use_invariant_gemms() + experts
            return "torch" + experts
        if self.quantization == MXFP4 and self.dtype == torch.float32:  # the int8 kernels take float32 rows
            from pagedllm.model.layers.fused_moe import FusedMoE

            if n := sum(m.serve_mxfp4_from_cpu_kernels() for m in self.model.modules() if isinstance(m, FusedMoE)):
                experts = f"; MXFP4 experts on the quantized kernels ({n} layers)"
        if self.dtype not in cpu_linear.PACKABLE_DTYPES or cpu_linear.cpu_gemm_backend() != "onednn":
            return "torch" + experts
        if self.dtype == torch.bfloat16 and (why := cpu_linear.bf16_packing_unsupported_reason()) is not None:
            logger.warning("bfloat16 weights: %s; the linear layers fall back to F.linear in bfloat16 (slow "
                           "here: --dtype float32 runs packed oneDNN GEMMs and the native kernels)", why)
            return "torch (bfloat16 without AVX-512: see the warning above)" + experts
        f32_gemm = None
        if self.dtype == torch.float32 and cpu_linear.f32_small_rows_wanted() \
                and cpu_kernels.kernels_choice() != "torch":
            from pagedllm.kernels.cpu_f32_gemm import load_f32_gemm

            f32_gemm = load_f32_gemm()
        if self.config.model_config.batch_invariant and f32_gemm is not None:  # _check_batch_invariance passed
            f32_gemm = f32_gemm.for_every_row_count()
        pack_weights_for_cpu(self.model, f32_gemm)
        if f32_gemm is None:
            return "onednn (packed weights)" + experts
        return (f"onednn (packed weights); up to {f32_gemm.max_rows} rows on the native float32 GEMM "
                f"({f32_gemm.isa} build)" + experts)

    def cache_block_size_bytes(self) -> int:
        """One block id's bytes: a page of each pool tensor (one per layer, or per slot of a hybrid model's groups)."""
        _, kv_heads, head_dim = kv_geometry(self.hf_config, self.tp.size, self.tp.rank)
        return CacheEngine.get_cache_block_size(self.kv_layout.num_slots, kv_heads, head_dim,
                                              self.config.cache_config.block_size, self.kv_spec.dtype,
                                              use_mla=self.use_mla)

    @property
    def kv_layout(self) -> KVCacheLayout:
        """The model's KV cache groups (core/kv_cache_groups.py), as the engine's block manager has them (a pipeline
        stage: its own layers, one group)."""
        layout = kv_cache_layout(self.hf_config, self.config.cache_config)
        if self.pp is None:
            return layout
        return single_group_layout(self.pp.end_layer - self.pp.start_layer, layout.groups[0].sliding_window)

    def _init_lora_slots(self) -> None:
        """The adapters' device slots, before the KV pool is sized (so the pool leaves their memory free)."""
        from pagedllm.lora.manager import LoRAModelManager

        lc, sc = self.config.lora_config, self.config.scheduler_config
        max_tokens = max(sc.max_num_batched_tokens, self.config.model_config.max_capture_tokens or 0,
                         sc.max_num_seqs)
        self.lora_manager = LoRAModelManager(self.model, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras,
                                             self.dtype, self.device, max_tokens)
        logger.info("LoRA: %d adapter slot(s) of rank %d on every projection (%.1f MiB)", lc.max_loras,
                    lc.max_lora_rank, self.lora_manager.num_buffer_bytes / 2**20)

    def determine_num_available_blocks(self) -> tuple[int, int, int]:
        """(device blocks, CPU swap blocks, KV offloading tier blocks) this worker can hold under the cache config."""
        cc = self.config.cache_config
        sc = self.config.scheduler_config
        self._init_mamba_state()
        if self.no_kv_pool:  # blocks of no memory: enough for every sequence at full length, no swap pool
            if cc.num_gpu_blocks_override is not None:
                return cc.num_gpu_blocks_override, 0, 0
            return sc.max_num_seqs * -(-sc.max_model_len // cc.block_size), 0, 0
        block_bytes = self.cache_block_size_bytes()
        num_cpu = int(cc.swap_space * (1 << 30)) // block_bytes
        num_offload = int((cc.kv_offloading_size or 0) * (1 << 30)) // block_bytes
        if cc.kv_offloading_size and num_offload < 1:
            raise ValueError(f"kv_offloading_size={cc.kv_offloading_size} GiB holds no KV block of {block_bytes} "
                             "bytes; give more")
        if self.draft_worker is not None:  # a device block id holds the draft's K/V too (its swap pool: none)
            block_bytes += self.draft_worker.cache_block_size_bytes()
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override, num_cpu, num_offload
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes // block_bytes, num_cpu, num_offload
        if self.device.type == "cuda":
            from pagedllm.worker.gpu_profiling import profile_num_gpu_blocks  # GPU-only path

            return profile_num_gpu_blocks(self, block_bytes), num_cpu, num_offload
        space = cpu_kvcache_space_bytes()
        if space is not None:  # vLLM's CPU backend: exactly the GiB the user gave
            if space < block_bytes:
                raise ValueError(f"{CPU_KVCACHE_SPACE_ENV}={os.environ[CPU_KVCACHE_SPACE_ENV]} GiB holds no KV block "
                                 f"of {block_bytes} bytes; give more (or 0 to size the pool from free memory).")
            return space // block_bytes, num_cpu, num_offload
        budget = int(_available_ram_bytes() * cc.cpu_kv_cache_fraction)
        # No need for more than every sequence at full length (in every KV cache group).
        max_useful = sc.max_num_seqs * -(-sc.max_model_len // cc.block_size) * self.kv_layout.num_groups
        return min(budget // block_bytes, max_useful), num_cpu, num_offload

    @property
    def no_kv_pool(self) -> bool:
        """An encoder (it attends within each step's prompts) or a pure state-space model: no KV pool tensors."""
        return self.encoder_only or not kv_geometry(self.hf_config, self.tp.size, self.tp.rank)[0]

    def _init_mamba_state(self) -> None:
        """State-space (Mamba) layers: every layer's recurrent state for max_num_seqs slots (+1 scratch), allocated
        before the KV pool is sized so that the pool leaves its memory free. Where that state would take more than
        half of the memory the pool could otherwise have, max_num_seqs is lowered to fit (logged)."""
        shape_of = getattr(self.model, "mamba_state_shape", None)
        if shape_of is None or self.mamba_caches is not None:
            return
        shape = shape_of(text_config(self.hf_config))
        cc, sc = self.config.cache_config, self.config.scheduler_config
        ssm_dtype = self.dtype if cc.mamba_ssm_cache_dtype == "auto" else getattr(torch, cc.mamba_ssm_cache_dtype)
        per_slot = shape.bytes_per_slot(self.dtype, ssm_dtype)
        # prefix caching keeps as many state snapshots as sequences run (core/state_snapshots.py)
        per_seq = 2 if cc.enable_prefix_caching and cc.mamba_block_size else 1
        room = self._memory_for_kv_and_state()
        if room is not None and (per_seq * sc.max_num_seqs + 1) * per_slot > room // 2:
            fit = max(1, (room // 2 // per_slot - 1) // per_seq)
            if fit < sc.max_num_seqs:
                logger.warning("max_num_seqs lowered from %d to %d: the recurrent state of %d sequences (%.2f MiB "
                               "each%s) would take more than half of the %.1f GiB left for it and the KV cache "
                               "(--max-num-seqs, --mamba-ssm-cache-dtype choose otherwise)", sc.max_num_seqs, fit,
                               sc.max_num_seqs, per_slot / 2**20,
                               ", and as many prefix-cache snapshots" if per_seq == 2 else "", room / 2**30)
                sc.max_num_seqs = fit
        cc.num_state_snapshots = sc.max_num_seqs if per_seq == 2 else 0
        # slots: the sequences', then the snapshots', then one scratch slot (padding rows of captured graphs)
        slots = sc.max_num_seqs + cc.num_state_snapshots + 1
        self.mamba_caches = allocate_layer_caches(shape, slots, self.dtype, self.device, ssm_dtype)
        logger.info("Recurrent state of %d Mamba layers (SSM state %s): %d slots of %.2f MiB (%.1f MiB)%s",
                    shape.num_layers, str(ssm_dtype).removeprefix("torch."), slots, per_slot / 2**20,
                    slots * per_slot / 2**20, f", {cc.num_state_snapshots} of them prefix-cache snapshots every "
                    f"{cc.mamba_block_size} tokens" if cc.num_state_snapshots else "")

    def _memory_for_kv_and_state(self) -> int | None:
        """Bytes the KV pool and the recurrent state may share: on CUDA the utilization share of the device less what
        is in use now (weights), on CPU the KV budget; None where the user sized the pool themselves."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None or cc.kv_cache_memory_bytes is not None:
            return None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return max(0, int(total * cc.gpu_memory_utilization) - (total - free))
        space = cpu_kvcache_space_bytes()
        return space if space is not None else int(_available_ram_bytes() * cc.cpu_kv_cache_fraction)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        layers, kv_heads, head_dim = kv_geometry(self.hf_config, self.tp.size, self.tp.rank)
        if self.pp is not None:
            layers = self.pp.end_layer - self.pp.start_layer
        self._init_mamba_state()
        if self.encoder_only:
            layers = 0  # no pool tensors (the encoder attends within each step's prompts)
        placement = self.kv_layout.layer_placement(layers) if layers else []
        self.cache_engine = CacheEngine(
            layers, kv_heads, head_dim, self.config.cache_config.block_size,
            num_gpu_blocks, num_cpu_blocks, self.kv_spec.dtype, self.device,
            layer_slots=[slot for _, slot in placement], use_mla=self.use_mla,
        )
        if not self.no_kv_pool:
            self.cache_engine.warm_up()  # CUDA: the block-copy kernel compiled before any request moves a block
        if self.no_kv_pool:
            logger.info("%s: no KV pool tensors (%d blocks are admission accounting only)",
                        "Encoder-only model" if self.encoder_only else "No attention layers", num_gpu_blocks)
        else:
            set_kv_cache_groups(self.model, [group for group, _ in placement])
            logger.info("KV pool dtype %s (%d bytes per block)", self.kv_spec.dtype, self.cache_block_size_bytes())
        if self.draft_worker is not None and self.draft_worker.cache_engine is None:  # (a level-2 wake-up: built)
            self.draft_worker.init_cache(num_gpu_blocks, 0)
            logger.info("Draft checkpoint %s: its KV pool has the same %d blocks (%d bytes each)",
                        self.draft_worker.model_dir, num_gpu_blocks, self.draft_worker.cache_block_size_bytes())
        if self.kv_spec.is_fp8 and self.config.cache_config.calculate_kv_scales and not self.encoder_only:
            self.calibrate_kv_scales()  # before the backend is built and graphs bake the scales in
        backend = self.attn_backend()
        logger.info("Attention backend: %s", backend.name)
        self.model_runner = ModelRunner(self.model, self.device, self.config.cache_config.block_size, backend)
        self.model_runner.pooling = self.config.model_config.runner == "pooling"
        self.model_runner.prompt_embeds = self.config.model_config.enable_prompt_embeds
        self.model_runner.mamba_caches = self.mamba_caches
        self.model_runner.pipeline = self.pp
        mc = self.config.model_config
        if mc.pooling_task in ("classify", "token_classify") and mc.convert != "reward":
            self.model_runner.classifier = self.model.classify  # (convert='reward': the hidden states as they are)
        if self.lora_manager is not None:
            self.model_runner.lora_manager = self.lora_manager
            self.lora_manager.always_apply = self.use_cuda_graphs()  # captured graphs hold the adapters' GEMMs
        if self.device.type == "cpu" and (self.quantization == "gguf" or self.dtype == torch.float32):
            from pagedllm.model.cpu_direct_forward import DirectForward

            # (a multimodal model's language model: its text-only steps)
            self.model_runner.direct_forward = DirectForward.build(getattr(self.model, "language_model", self.model),
                                                                   backend)
            if self.model_runner.direct_forward is not None:
                self.model_runner.direct_forward.lora_manager = self.lora_manager
            if self.config.model_config.batch_invariant and self.model_runner.direct_forward is None:
                logger.warning("%s=1 without the CPU direct forward: the module path's torch ops (norms, "
                               "activations) are not checked for batch invariance here, only the attention "
                               "kernel and the GEMMs", batch_invariance.BATCH_INVARIANT_ENV)
        if self.device.type == "cuda":
            with watchers_paused():  # (another engine's watcher would report this warm start's builds)
                warmed = self._warm_up_cuda()
            self.warm_started = warmed

    def _warm_up_cuda(self) -> bool:
        """Capture the graphs and build the Triton kernels the steps will reach; False where nothing is warmed (an
        eager engine)."""
        if self.use_cuda_graphs():
            self.capture_cuda_graphs()
        elif self.mamba_caches is not None or self.is_draft:
            # A pure state-space model, or a draft checkpoint, runs eagerly: its Triton kernels compile here, not in
            # a first request.
            from pagedllm.kernels.triton_fused_moe import warm_up_fused_moe

            t0 = time.perf_counter()
            warm_up_fused_moe(self.model)
            self.model_runner.warm_up_steps(self.cache_engine.gpu_cache)
            logger.info("Warm start (eager steps, Triton kernels compiled) took %.2f s", time.perf_counter() - t0)
        else:
            return False
        return True

    def watch_compilations(self) -> bool:
        """After the engine's warm start (CUDA): log every Triton build from now on, and keep it in the runner's
        ``compile_watch``: a build then is a step waiting on the compiler. False where nothing was warmed."""
        return self.warm_started and self.model_runner.compile_watch.install()

    def capture_cuda_graphs(self) -> None:
        """Capture the runner's CUDA graphs over the current KV pools and weights (init_cache; wake_up after sleep)."""
        sc, mc, cc = self.config.scheduler_config, self.config.model_config, self.config.compilation_config
        t0 = time.perf_counter()
        spec = self.config.speculative_config
        # State-space layers: their prefill loops over sequences on the host, so only decode steps are captured.
        stateless = self.mamba_caches is None
        self.model_runner.capture_cuda_graphs(
            self.cache_engine.gpu_cache, sc.max_num_seqs, sc.max_model_len, sc.max_num_batched_tokens,
            piecewise=mc.max_capture_tokens > 0 and cc.piecewise_graphs and stateless,
            whole_steps=cc.whole_step_graphs and stateless, max_capture_tokens=mc.max_capture_tokens or None,
            verify_query_len=1 + spec.num_speculative_tokens if spec is not None else 0,
            verify_max_num_seqs=spec.disable_by_batch_size if spec is not None else 0,
            time_buckets=self.routes_graph_buckets())
        logger.info("Warm start (graphs captured, Triton kernels compiled) took %.2f s", time.perf_counter() - t0)

    def _use_invariant_gemms(self) -> str:
        """Every linear through the batch-invariant Triton GEMM, its variants compiled now (one per layer shape and
        tile class), so that no step compiles."""
        from pagedllm.kernels.triton_invariant_matmul import warm_up_invariant_linears

        t0 = time.perf_counter()
        linears = []
        for m in self.model.modules():
            if isinstance(m, PackableGemm):
                m.invariant_gemm = True
                bias = getattr(m, "bias", None)
                # A row-parallel layer adds its bias after the GEMM: warm up both variants where there is one.
                linears += [(m.weight, None)] + ([(m.weight, bias)] if bias is not None else [])
        with torch.inference_mode():
            launches = warm_up_invariant_linears(linears)
        torch.cuda.synchronize(self.device)
        logger.info("Batch-invariant GEMM: compiled by %d warm-up launches (layer shapes × tile classes) in %.2f s",
                    launches, time.perf_counter() - t0)
        return "triton batch-invariant GEMM (VLLM_BATCH_INVARIANT=1)"

    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs on CUDA unless enforce_eager is set. Under tensor parallelism
        every rank captures the same buckets in the same order, so the NCCL all-reduces inside the
        graphs match up across ranks at replay, as they do in eager steps."""
        return (self.device.type == "cuda" and not self.config.model_config.enforce_eager and self.pp is None
                and self.config.compilation_config.cudagraph_mode != "NONE")

    def routes_graph_buckets(self) -> bool:
        """Whether steps may run in a larger, faster-timed graph bucket (worker/cuda_graph.py): only in one
        process. Each rank would time its own graphs and could route a batch differently from the others,
        while their graphs' all-reduces must match, so under tensor parallelism every rank keeps the smallest
        bucket."""
        return self.config.parallel_config.world_size == 1

    def calibrate_kv_scales(self, token_ids: list[int] | None = None) -> KVCalibration:
        """One forward pass over the calibration prompt (`token_ids`, by default the built-in text's tokens,
        random ids without a tokenizer or with dummy weights) → per-layer FP8 KV scales into ``kv_spec``.
        The scales stay those of the weights loaded at start-up (``load_weights`` does not recalibrate)."""
        t0 = time.perf_counter()
        if token_ids is None:
            mc = self.config.model_config
            tokenizer = None
            if not mc.skip_tokenizer_init and mc.load_format != "dummy":
                from pagedllm.tokenizer import get_tokenizer

                tokenizer = get_tokenizer(self.model_dir, mc.tokenizer, mc.trust_remote_code)
            token_ids = calibration_token_ids(tokenizer, int(text_config(self.hf_config).vocab_size),
                                              self.config.scheduler_config.max_model_len, seed=mc.seed)
        layers, _, _ = kv_geometry(self.hf_config, self.tp.size, self.tp.rank)
        cal = calibrate_kv_amax(self.model, token_ids, layers, self.device)
        self.kv_spec = dataclasses.replace(self.kv_spec, layer_scales=cal.scales())
        log_calibration(cal, self.kv_spec.dtype, time.perf_counter() - t0)
        return cal

    def attn_backend(self):
        if self.device.type == "cuda":
            return TritonAttentionBackend(self.kv_spec.k_scale, self.kv_spec.v_scale, self._scales_by_cache(),
                                          batch_invariant=self.config.model_config.batch_invariant)
        if self.device.type == "cpu" and self.dtype in NativeCpuAttentionBackend.model_dtypes:
            kernels = cpu_kernels.load_cpu_kernels()
            if kernels is not None:
                # A verification chunk (1 + k tokens) must take the token path: its rows then get a plain decode's bits.
                spec = self.config.speculative_config
                min_tile = max(cpu_kernels.TILE_MIN_QUERY_LEN, 2 + spec.num_speculative_tokens) if spec else None
                return NativeCpuAttentionBackend(kernels, min_tile, self.kv_spec.k_scale, self.kv_spec.v_scale,
                                                 self._scales_by_cache(), fp8_pool=self.kv_spec.is_fp8,
                                                 batch_invariant=self.config.model_config.batch_invariant)
        if self.kv_spec.is_fp8:
            raise ValueError(f"kv_cache_dtype={self.config.cache_config.cache_dtype!r} on the CPU needs the native "
                             f"CPU kernels (a C compiler, {cpu_kernels.KERNELS_ENV}=native) and a float32 or "
                             f"bfloat16 model; here attention runs in torch ({self.dtype}): use kv_cache_dtype="
                             f"'auto' or 'bfloat16'.")
        return TorchAttentionBackend()

    def _scales_by_cache(self) -> dict[int, tuple[float, float]] | None:
        """Calibrated scales keyed by each layer's key cache (``TritonAttentionBackend``); None before
        calibration or the pool (e.g. the memory profile's temporary caches use the defaults)."""
        if not self.kv_spec.layer_scales or self.cache_engine is None:
            return None
        return {k.data_ptr(): self.kv_spec.scales(i) for i, (k, _) in enumerate(self.cache_engine.gpu_cache)}

    def add_lora(self, request, in_use: set[int] = frozenset()) -> bool:
        """Load a LoRA adapter (a `LoRARequest`) unless resident; ValueError when it cannot be served."""
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need an engine built with enable_lora=True (--enable-lora).")
        return self.lora_manager.add_lora(request, in_use)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove_lora(lora_int_id)

    def execute_model(self, req: ExecuteModelRequest) -> torch.Tensor | None:
        ce = self.cache_engine
        ce.swap_out(req.blocks_to_swap_out)
        ce.swap_in(req.blocks_to_swap_in)
        ce.copy(req.blocks_to_copy)
        if req.state_copies:
            copy_state_slots(self.mamba_caches, req.state_copies)
        out = self.model_runner.execute_model(req.chunks, ce.gpu_cache, req.pending_inputs,
                                              req.prev_sampled_token_ids)
        if self.mamba_caches is not None:  # prefix-cache snapshots at chunk ends: the slot's state after the step
            ends = [(c.state_slot, slot) for c in req.chunks for offset, slot in c.state_snapshots
                    if offset == len(c.token_ids)]
            copy_state_slots(self.mamba_caches, ends)
        return out

    def release_free_memory(self) -> float | None:
        """CPU path, engine idle: return freed heap pages to the OS; MiB released (None: nothing to do)."""
        if self.device.type != "cpu":
            return None
        t0 = time.perf_counter()
        released = release_free_memory()
        if released is not None and released >= 1:
            logger.info("engine idle: malloc_trim returned %.0f MiB of freed memory to the OS in %.1f ms",
                        released, 1e3 * (time.perf_counter() - t0))
        return released

    # -- torch profiler (worker/profiler.py) -------------------------------------------------------------------
    _profiler: TorchProfiler | None = None  # from start_profile until stop_profile

    def start_profile(self, config: TorchProfilerConfig) -> None:
        """Start recording this process with torch.profiler (a second start while one runs is ignored)."""
        if self._profiler is not None:
            logger.warning("start_profile: the torch profiler is already running on rank %d; ignored", self.tp.rank)
            return
        profiler = TorchProfiler(config, self.device, self.tp.rank)
        profiler.start()
        self._profiler = profiler

    def stop_profile(self) -> str | None:
        """Stop recording and write this worker's trace; its path."""
        if self._profiler is None:
            raise ProfilerError("stop_profile: the torch profiler is not running; call start_profile() first.")
        profiler, self._profiler = self._profiler, None
        return profiler.stop()

    # -- sleep mode (engine/sleep_mode.py) --------------------------------------------------------------------
    sleep_level: int = 0  # 0 awake, else the level of the last sleep() until every part is awake again
    asleep: frozenset[str] = frozenset()  # the parts (SLEEP_TAGS) still asleep
    _offloaded: OffloadedModel | None = None  # level 1 on a GPU: the weights in pinned host memory

    def sleep(self, level: int = 1) -> None:
        """Free this worker's memory until `wake_up`. Level 1 moves the weights to pinned host memory on a GPU
        (a CPU worker's weights already are host memory and stay) and drops the KV pools; level 2 drops the
        weights too (wake_up reloads them from the checkpoint). The KV pools' contents are lost at either level."""
        check_sleep_args(level)
        if self.sleep_level:
            logger.warning("the worker is already asleep (level %d)", self.sleep_level)
            return
        t0 = time.perf_counter()
        self._drop_graphs()  # they hold the KV pools' and the weights' addresses
        kv_bytes = self.cache_engine.release()
        weight_bytes = 0
        if level == 2:
            self.model = self.model_runner = self.lora_manager = self.int_checkpoint = None
        elif self.device.type == "cuda":
            self._offloaded = offload_model(self.model, self.device)
            weight_bytes = self._offloaded.nbytes
        self.sleep_level, self.asleep = level, frozenset(SLEEP_TAGS)
        if self.draft_worker is not None:
            self.draft_worker.sleep(level)
        self._return_freed_memory()
        logger.info("asleep (level %d) in %.2f s: KV pools dropped (%.1f MiB)%s", level, time.perf_counter() - t0,
                    kv_bytes / 2**20, "; weights dropped" if level == 2 else
                    f"; weights moved to host memory ({weight_bytes / 2**20:.1f} MiB)" if weight_bytes else "")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep` freed: "weights" (from host memory; after level 2 reloaded from the checkpoint),
        "kv_cache" (new, empty pools); every part for None. Once all are back the worker runs as after start-up,
        its CUDA graphs captured again over the new addresses."""
        wake = [t for t in check_wake_tags(tags) if t in self.asleep]
        if not wake:
            return
        t0 = time.perf_counter()
        self.asleep = self.asleep - set(wake)
        if "weights" in wake:
            if self.sleep_level == 2:
                self.load_model()
            elif self._offloaded is not None:
                restore_model(self._offloaded)
                self._offloaded = None
        if "kv_cache" in wake and not (self.sleep_level == 2 and not self.asleep):
            self.cache_engine.reallocate()  # (a level-2 worker waking whole gets its pools from init_cache below)
        if self.draft_worker is not None:
            self.draft_worker.wake_up(wake)
        if not self.asleep:
            self._rebuild_after_sleep()
            self.sleep_level = 0
        if "weights" in wake and self.device.type == "cpu":
            release_free_memory()  # the checkpoint loader's freed buffers
        logger.info("woke %s in %.2f s", wake, time.perf_counter() - t0)

    def _drop_graphs(self) -> None:
        if self.model_runner is not None:
            self.model_runner.graph_runner = self.model_runner.piecewise_runner = None

    def _rebuild_after_sleep(self) -> None:
        """Every part is awake: what holds the old addresses is built again."""
        ce = self.cache_engine
        if self.sleep_level == 2:  # a new model: runner, backend, direct forward and graphs as at start-up
            num_gpu, num_cpu = ce.num_blocks
            ce.release()
            self.init_cache(num_gpu, num_cpu)
            return
        # Level 1: the same model and runner; the per-layer FP8 scales are keyed by the pools' addresses.
        self.model_runner.attn_backend.layer_scales = dict(self._scales_by_cache() or {})
        if self.use_cuda_graphs():
            self.capture_cuda_graphs()

    def _return_freed_memory(self) -> None:
        # What was dropped may sit in reference cycles that the engine's start-up freeze (engine/gc_heap.py) keeps
        # from every collection (at level 2 the CPU direct forward's, holding every packed weight): thaw, collect,
        # freeze what is left again.
        frozen = gc.get_freeze_count() > 0
        if frozen:
            gc.unfreeze()
        gc.collect()
        if frozen:
            gc.freeze()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_free_memory()


def cpu_kvcache_space_bytes() -> int | None:
    """vLLM's VLLM_CPU_KVCACHE_SPACE: the CPU KV pool's size in GiB (fractions allowed), as bytes; None where unset
    or 0 (the pool is then sized from free memory). A ValueError says what the variable takes."""
    raw = os.environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV}={raw!r}: expected the CPU KV cache's size in GiB, a number >= 0 "
                         "(e.g. 4, or 0 to size it from free memory).")
    return int(gib * (1 << 30)) or None


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
