"""EngineArgs: every engine option in one flat dataclass (LLM kwargs and CLI flags share it)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, get_type_hints

from pagedllm.config import (
    BATCHING_MODES,
    LOGPROBS_MODES,
    CONVERT_TYPES,
    RUNNER_TYPES,
    PoolerConfig,
    SCHEDULING_POLICIES,
    KV_CACHE_DTYPES,
    MAMBA_SSM_CACHE_DTYPES,
    KV_OFFLOADING_BACKENDS,
    QUANTIZATION_METHODS,
    KV_CACHE_MANAGERS,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedllm.device_utils import is_large_gpu
from pagedllm.model.models.registry import has_recurrent_state, is_encoder_only, layer_sliding_windows
from pagedllm.reasoning import REASONING_PARSERS, check_reasoning_parser
from pagedllm.structured_output.params import STRUCTURED_OUTPUTS_BACKENDS, resolve_backend

logger = logging.getLogger(__name__)

# The hybrid KV cache's CUDA paths (eager and graph-captured steps reading each group's tables) match transformers on an
# H100. End to end they first ran 0.71-1.05x as fast as one table (BENCHMARKS.md §73.4, §74.3): each step rebuilt every
# group's tables on the host. With persistent table rows (worker/block_table_rows.py) and cheaper per-group scheduling,
# 1.53x on an H100 and 1.32x on an H200 with 3.76x the sequences (§75). It is on, as in vLLM; "0" keeps one table per
# sequence on CUDA (as --disable-hybrid-kv-cache-manager does everywhere).
CUDA_HYBRID_KV_CACHE_ENV = "PAGEDLLM_CUDA_HYBRID_KV_CACHE"

_HELP = {
    "model": "HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct).",
    "tokenizer": "Tokenizer directory if it differs from the model's.",
    "dtype": "Weights and activations dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16.",
    "device": "auto (CUDA when present), cpu or cuda.",
    "seed": "Seed for dummy weights and unseeded sampling.",
    "block_size": "Tokens per KV block.",
    "max_model_len": "Longest prompt + output in tokens (default: the model's context length).",
    "disable_sliding_window": "Serve a sliding-window model (Mistral-7B-v0.1, Gemma 2/3, Phi-3) with max_model_len "
                              "capped at its window, where full attention is the same; default: attend through "
                              "the window, freeing the KV blocks behind it where every layer slides.",
    "disable_hybrid_kv_cache_manager": "For a model mixing full-attention and sliding-window layers (Gemma 2/3): "
                                       "one block table for every layer, instead of a table per group of layers "
                                       "whose sliding groups free the blocks behind their window (vLLM's hybrid "
                                       "KV cache manager; off by itself with speculative decoding, an FP8 KV "
                                       "cache, a contiguous kv_cache_manager, and on CUDA with "
                                       "PAGEDLLM_CUDA_HYBRID_KV_CACHE=0).",
    "max_num_seqs": "Most sequences in one step (default: 256; 1024 for the offline LLM on a GPU of >= 70 GiB "
                    "other than an A100, as in vLLM).",
    "max_num_batched_tokens": "Most tokens in one step (default with chunked prefill: 2048, 8192 for the offline "
                              "LLM on a GPU; without it: max_model_len).",
    "num_gpu_blocks_override": "KV pool size in blocks, whatever the device.",
    "kv_cache_memory_bytes": "KV pool size in bytes (when no block override is given).",
    "gpu_memory_utilization": "Fraction of GPU memory the engine may use (weights + activations + KV pool).",
    "swap_space": "GiB of CPU memory for swapped-out KV blocks.",
    "kv_offloading_size": "GiB of CPU memory for a tier under the prefix cache (vLLM's native KV offloading): "
                          "cached blocks the KV pool evicts are copied there and copied back on a prefix hit "
                          "instead of recomputed. Needs --enable-prefix-caching.",
    "kv_offloading_backend": "The KV offloading tier's implementation: native (the only one).",
    "cpu_offload_gb": "GiB of a GPU model's weights kept in pinned host memory and copied in at every forward "
                      "(vLLM's): whole decoder layers, from the first, until at least this much; the GPU holds one "
                      "layer-sized buffer for them, so the rest goes to the KV pool. Each forward moves those bytes "
                      "over PCIe: slow, for models that do not fit otherwise. GPU only; not with LoRA or sleep mode.",
    "mamba_ssm_cache_dtype": "State-space (Mamba) layers: the dtype of each sequence's SSM state (auto: the model's; "
                             "float32 keeps long generations closest to a float32 run at twice the memory).",
    "mamba_block_size": "State-space (Mamba) layers with --enable-prefix-caching: tokens between the recurrent-state "
                        "snapshots a prefix hit can resume from (a multiple of --block-size; default: 256 rounded "
                        "up to one).",
    "enable_chunked_prefill": "Split long prompts into chunks that share steps with decodes.",
    "long_prefill_token_threshold": "With chunked prefill: most tokens one prompt runs in a step (0: no cap; default "
                                    "4 percent of max_model_len when max_num_partial_prefills > 1). A prompt with more "
                                    "left is long.",
    "max_num_partial_prefills": "With chunked prefill: most prompts prefilling in one step (1: no limit).",
    "max_long_partial_prefills": "With chunked prefill: most long prompts among them, so shorter prompts go ahead "
                                 "of long ones (<= max_num_partial_prefills).",
    "enable_prefix_caching": "Reuse KV blocks of identical prompt prefixes across requests.",
    "preemption_mode": "What to do with a preempted group: recompute, swap, or auto.",
    "load_format": "auto, gguf, safetensors, or dummy (random weights).",
    "skip_tokenizer_init": "Do not load a tokenizer; prompts must be token ids.",
    "tensor_parallel_size": "Number of tensor-parallel ranks.",
    "distributed_executor_backend": "Executor for tensor parallelism: mp or ray.",
    "enforce_eager": "Disable CUDA graphs.",
    "max_capture_tokens": "Steps with prefill chunks of up to this many tokens replay piecewise CUDA graphs "
                          "(split at attention); 0: only decode-only steps are captured.",
    "compilation_config": "A JSON object like vLLM's; here only cudagraph_mode: FULL (default: decode graphs, whole-"
                          "step graphs for steps of up to 2048 tokens and 256 sequences, piecewise beyond), "
                          "FULL_AND_PIECEWISE (decode graphs, piecewise for steps with prompt chunks), "
                          "FULL_DECODE_ONLY or NONE.",
    "async_scheduling": "Schedule and launch step t+1 while the device still runs step t (outputs arrive one "
                        "step later); default: on for CUDA with one process, off otherwise.",
    "kv_cache_manager": "KV memory management: paged (PagedAttention) or the paper's contiguous-reservation "
                        "baselines on a buddy allocator: orca-oracle (prompt + true output length, taken from "
                        "max_tokens: exact when the request sets ignore_eos, as the benchmarks do), orca-pow2 (output length rounded up to a power of two), orca-max "
                        "(max_model_len). Contiguous managers share, swap and cache nothing.",
    "batching": "iteration (requests join and leave every step) or request (a batch runs until all its requests "
                "finish before others join: FasterTransformer-style with --kv-cache-manager orca-max).",
    "scheduling_policy": "fcfs (first come, first served) or priority (each request's priority, lower first, then "
                         "arrival; LLM.generate(priority=[...]) or the API's priority field).",
    "speculative_config": "Speculative decoding, a JSON object like vLLM's: "
                          '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} or '
                          '{"model": "/path/to/small-model", "num_speculative_tokens": 4} (a draft checkpoint '
                          "that shares the tokenizer: an HF directory or a .gguf file; method draft_model, and "
                          "\"quantization\" for its weights), "
                          '{"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 8} '
                          "(self-speculation: the model's first layers draft) or method ngram_gpu (greedy requests "
                          "on CUDA: n-gram drafts proposed, verified and accepted on the device, overlapping the "
                          "host; bit-exact in float32 only); also disable_by_batch_size, "
                          "prompt_lookup_min (as in vLLM, a lookup bound left out equals the other; neither: 5), "
                          "min_acceptance_rate, cooldown_steps. Greedy outputs are unchanged; "
                          "sampled ones keep their distribution.",
    "kv_cache_dtype": "KV pool element type: auto (the model dtype); bfloat16 (any device: a float32 model "
                      "on the CPU stores and streams half the KV bytes); fp8 / fp8_e4m3, or fp8_e5m2 (one byte per "
                      "value, per-layer scales, see --calculate-kv-scales; CUDA, or the CPU with its native "
                      "kernels).",
    "calculate_kv_scales": "FP8 KV pools: calibrate per-layer k/v scales at start-up from one forward pass over a "
                           "built-in text (amax / 200 for keys, / 100 for values, as vLLM); default off: scales of "
                           "1.0 (measured better on the bundled model, BENCHMARKS.md). Ignored for plain pools.",
    "quantization": "Weight quantization: fp8 (bf16 linear weights → e4m3 per output channel at load, "
                    "per-token activation scales, torch._scaled_mm; CUDA only); gguf (a .gguf file's Q4_0/Q4_1/"
                    "Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights stay quantized, int8 dot-product kernels; CPU, float32; "
                    "the default for such a file on the CPU); none (dequantize every tensor at load). An FP8 checkpoint "
                    "(compressed-tensors or quant_method fp8 in config.json) loads in FP8 on CUDA without this flag "
                    "(none: dequantized), dequantized on the CPU. gptq, awq, compressed-tensors: the checkpoint's own "
                    "method (detected without the flag; a flag that does not match it is an error): 4/8-bit "
                    "integer weights stay quantized on the CPU in float32 (GGUF Q4_0/Q4_1/Q8_0 kernels), "
                    "dequantized elsewhere or with none. mxfp4: a gpt-oss checkpoint's MXFP4 experts stay MXFP4 "
                    "(the default on CUDA: the fused-MoE kernel decodes them in its tiles; on the CPU each expert is "
                    "dequantized per product); none: dequantized at load.",
    "max_logprobs": "Most log-probabilities per token a request may ask for (logprobs, prompt_logprobs; top_logprobs "
                    "on the server), as vLLM's --max-logprobs; -1: no cap.",
    "generation_config": "Where request defaults come from (vLLM's): auto (the model's generation_config.json: its "
                         "temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as a cap on "
                         "every request's max_tokens), vllm (ignore it), or a folder holding such a file.",
    "override_generation_config": "A JSON object of those keys that wins over the generation config, e.g. "
                                  "'{\"temperature\": 0.6}'.",
    "runner": "What the model runs (vLLM's --runner): generate (sample tokens), pooling (one result per prompt: "
              "embeddings through LLM.embed and /v1/embeddings, class probabilities through LLM.classify and "
              "/classify, scores through LLM.score, /v1/score and /rerank), or auto (pooling for a base-model "
              "checkpoint such as LlamaModel, which has no LM head, and for a *ForSequenceClassification or "
              "*ForTokenClassification one; else generate).",
    "convert": "vLLM's --convert: embed turns a *ForCausalLM model into an embedding model; classify serves a "
               "*ForSequenceClassification checkpoint (Llama, Mistral, Qwen2, Qwen3) as a classifier: its `score` "
               "head over the last token, softmax over the labels (sigmoid for one label: a cross-encoder, which "
               "LLM.score and /v1/score, /rerank use for text pairs); reward turns a *ForCausalLM model into a "
               "reward model: every prompt token's final hidden state (LM head unused; task token_classify: "
               "LLM.reward, LLM.encode, POST /pooling; pooling ALL, or STEP with --pooler-config; softmaxed unless "
               "activation is false, as vLLM). All three imply --runner pooling; auto or none "
               "leave the model as it is (a *ForSequenceClassification checkpoint classifies by default, a "
               "*ForTokenClassification one classifies every token: task token_classify).",
    "pooler_config": "Pooling runner: a JSON object like vLLM's, {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\" | \"ALL\" | "
                     "\"STEP\", \"normalize\": true, \"activation\": true, \"step_tag_id\": null, "
                     "\"returned_token_ids\": null} (default LAST, normalized: what decoder embedding "
                     "models use; ALL: a token classifier's, every token's row; STEP: a process reward model's, the rows "
                     "of the step_tag_id tokens, in their returned_token_ids columns; activation: a classifier's "
                     "softmax/sigmoid, false for raw logits).",
    "enable_lora": "Serve LoRA adapters on the base model (vLLM's): each request may name a PEFT adapter "
                   "(LLM.generate(lora_request=LoRARequest(name, id, path)); the server's --lora-modules name=path "
                   "and the request's model field). One process (tensor_parallel_size 1), no speculative decoding.",
    "max_loras": "Adapters a batch may mix (the device's adapter slots, as in vLLM): requests of further adapters "
                 "wait until a slot's requests finish.",
    "max_lora_rank": "Highest adapter rank accepted.",
    "max_cpu_loras": "Adapters kept loaded beside the slots, least recently used dropped first (default: max_loras).",
    "structured_outputs_backend": "Grammar engine for structured outputs: auto (= xgrammar), xgrammar, or guidance "
                                  "(llguidance: faster masks, unbounded number precision). The shorthand of "
                                  "--structured-outputs-config's backend.",
    "structured_outputs_config": "Structured outputs, a JSON object like vLLM's: backend (as "
                                 "--structured-outputs-backend), disable_any_whitespace (JSON without any whitespace, "
                                 "separators ',' and ':', for every request), disable_additional_properties (objects "
                                 "that list properties or patternProperties allow no other key; already so for "
                                 "properties on both backends), disable_fallback (accepted: no backend falls back to "
                                 "another here), reasoning_parser (as --reasoning-parser). A flag and a key that "
                                 "disagree are an error, e.g. '{\"backend\": \"guidance\", "
                                 "\"disable_any_whitespace\": true}'.",
    "disable_log_stats": "Turn off the server's periodic stats line (vLLM's: prompt and generation throughput, "
                         "running and waiting requests, KV cache usage, prefix cache hit rate; every 10 s while "
                         "there is activity, VLLM_LOG_STATS_INTERVAL to change). The offline LLM logs none.",
    "trust_remote_code": "Accepted for vLLM's command lines, no effect: pagedllm runs its own model code, never a "
                         "checkpoint's.",
    "revision": "Accepted for vLLM's command lines, no effect: models load from local files, which have one "
                "version.",
    "tokenizer_revision": "Accepted for vLLM's command lines, no effect (local files only).",
    "download_dir": "Accepted for vLLM's command lines, no effect: nothing is downloaded.",
    "hf_token": "Accepted for vLLM's command lines, no effect: nothing is downloaded.",
    "tokenizer_mode": "auto or hf (the Hugging Face tokenizer, fast when it has one); slow is accepted with no "
                      "effect; mistral (mistral_common) is not supported.",
    "hf_overrides": "A JSON object of Hugging Face config fields to set when the model loads (vLLM's), e.g. "
                    "'{\"max_position_embeddings\": 4096}'; a nested object updates a sub-config field by field.",
    "enable_prompt_embeds": "Accept prompts given as embeddings (vLLM's): {'prompt_embeds': tensor [num_tokens, "
                            "hidden_size]} offline, base64 torch.save()d tensors in /v1/completions' "
                            "prompt_embeds. Only for trusted clients (vLLM's warning): embeddings steer the model "
                            "freely.",
    "limit_mm_per_prompt": "Most items per prompt of each modality of a multimodal model (vLLM's), a JSON object "
                           "such as '{\"image\": 2}' (default: 999 each).",
    "allowed_local_media_path": "Allow file:///abs/path image_url values (the server's requests, LLM.chat offline) "
                                "for files under this directory, symlinks and '..' resolved first; an existing "
                                "directory, checked at start-up (vLLM's; a security risk: trusted clients only; "
                                "default: no local files).",
    "enable_sleep_mode": "Let LLM.sleep() / POST /sleep free the engine's memory (vLLM's sleep mode: level 1 moves "
                         "the weights to host memory and drops the KV cache, level 2 drops both) until wake_up.",
    "profiler_config": "The torch profiler, a JSON object like newer vLLM's: {\"torch_profiler_dir\": DIR} turns it "
                       "on as VLLM_TORCH_PROFILER_DIR=DIR does (LLM.start_profile() / stop_profile(), the server's "
                       "POST /start_profile, /stop_profile); also profiler ('torch'), torch_profiler_record_shapes, "
                       "torch_profiler_with_memory, torch_profiler_with_stack, torch_profiler_with_flops.",
    "logits_processors": "Custom logits processors (vLLM's): LogitsProcessor subclasses of "
                         "pagedllm.logits_processor, named 'package.module:Class' (or passed as classes "
                         "offline); each request's SamplingParams.extra_args (the server's vllm_xargs) reach them.",
    "logprobs_mode": "What logprobs and prompt_logprobs report (vLLM's): raw_logprobs (the model's distribution), "
                     "raw_logits, processed_logprobs / processed_logits (after logit_bias, penalties, custom "
                     "processors, temperature and top-k/top-p: the distribution a token was drawn from).",
    "pipeline_parallel_size": "Split the decoder layers into this many stages, each on tensor_parallel_size ranks "
                              "of their own (mp or Ray executor), each holding only its layers' weights and KV "
                              "pool. On the CPU with the mp executor every stage works on its own batch at once; "
                              "elsewhere a step passes through the stages in turn. VLLM_PP_LAYER_PARTITION='8,8,7' "
                              "sets each stage's layer count. Llama-style decoders generating text.",
    "data_parallel_size": "`pagedllm serve`: this many engine-core processes, each a whole copy of the model (with "
                          "tensor_parallel_size GPUs each, or an equal share of the CPU cores and of the CPU KV "
                          "budget), behind one API server that sends each request to the least-loaded one.",
    "max_seq_len_to_capture": "Accepted for vLLM's command lines, no effect: decode CUDA graphs cover every "
                              "context length up to max_model_len (--max-capture-tokens bounds the steps with "
                              "prompt chunks that replay graphs).",
    "reasoning_parser": "A thinking model's reasoning, as vLLM's parser of that name: the server splits the output "
                        "into `reasoning` and `content` on /v1/chat/completions and /v1/responses, and structured "
                        "outputs constrain only the answer. deepseek_r1, qwen3: a <think>…</think> block (deepseek_r1: "
                        "output without </think> is all reasoning; qwen3: reasoning only inside a <think> block the "
                        "output opens). openai_gptoss: GPT-OSS's harmony channels (analysis is the reasoning; final "
                        "and preambles the content; the answer starts at <|channel|>final<|message|>), detokenized "
                        "with its special tokens kept.",
}

#: vLLM's short spellings.
_SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "data_parallel_size": ("-dp",),
                "quantization": ("-q",)}
#: vLLM's tokenizer modes pagedllm takes (all load the model's Hugging Face tokenizer).
TOKENIZER_MODES = ("auto", "hf", "slow")

_CHOICES = {"kv_cache_manager": KV_CACHE_MANAGERS, "batching": BATCHING_MODES, "scheduling_policy": SCHEDULING_POLICIES,
            "kv_cache_dtype": KV_CACHE_DTYPES, "quantization": QUANTIZATION_METHODS,
            "kv_offloading_backend": KV_OFFLOADING_BACKENDS, "mamba_ssm_cache_dtype": MAMBA_SSM_CACHE_DTYPES,
            "structured_outputs_backend": STRUCTURED_OUTPUTS_BACKENDS, "runner": RUNNER_TYPES,
            "convert": CONVERT_TYPES, "reasoning_parser": REASONING_PARSERS, "logprobs_mode": LOGPROBS_MODES}


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    disable_sliding_window: bool = False
    disable_hybrid_kv_cache_manager: bool = False
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    cpu_offload_gb: float = 0
    mamba_ssm_cache_dtype: str = "auto"
    mamba_block_size: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    enable_prefix_caching: bool = False
    preemption_mode: str = "auto"
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    max_capture_tokens: int = 8192
    compilation_config: str | dict | None = None
    kv_cache_manager: str = "paged"
    batching: str = "iteration"
    scheduling_policy: str = "fcfs"
    structured_outputs_backend: str = "auto"
    structured_outputs_config: str | dict | StructuredOutputsConfig | None = None
    reasoning_parser: str | None = None
    speculative_config: str | dict | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    quantization: str | None = None
    max_logprobs: int = 20
    generation_config: str = "auto"
    override_generation_config: str | dict | None = None
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | dict | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    disable_log_stats: bool = False
    enable_sleep_mode: bool = False
    profiler_config: str | dict | None = None
    # vLLM's model-source and parallelism options: accepted so its command lines and LLM(...) calls work
    # (`compat_notes` says which have no effect here).
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    hf_token: bool | str | None = None
    tokenizer_mode: str = "auto"
    hf_overrides: str | dict | Callable[[Any], Any] | None = None
    limit_mm_per_prompt: str | dict | None = None
    allowed_local_media_path: str | None = None
    enable_prompt_embeds: bool = False
    logits_processors: list[str | type] | None = None
    logprobs_mode: str = "raw_logprobs"
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    max_seq_len_to_capture: int | None = None

    def structured_outputs_settings(self) -> StructuredOutputsConfig:
        """structured_outputs_config with its shorthands (structured_outputs_backend, reasoning_parser) folded in;
        ValueError for an unknown backend or parser, an unknown key, or a shorthand that disagrees with it."""
        resolve_backend(self.structured_outputs_backend)
        check_reasoning_parser(self.reasoning_parser)
        config = StructuredOutputsConfig.from_json(self.structured_outputs_config)
        return config.merged(self.structured_outputs_backend, self.reasoning_parser)

    def _checked_logprobs_mode(self) -> str:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}.")
        if self.logprobs_mode != "raw_logprobs" and self.speculative_config:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} is not supported with speculative decoding "
                             "(verification reports raw log-probs); use raw_logprobs or turn speculation off.")
        return self.logprobs_mode

    def _logits_processor_classes(self, runner: str) -> tuple[type, ...]:
        from pagedllm.logits_processor import (STR_POOLING_REJECTS_LOGITSPROCS, STR_SPEC_DEC_REJECTS_LOGITSPROCS,
                                               resolve_logits_processor_classes)

        classes = resolve_logits_processor_classes(self.logits_processors)
        if classes and self.speculative_config:
            raise ValueError(STR_SPEC_DEC_REJECTS_LOGITSPROCS)
        if classes and runner == "pooling":
            raise ValueError(STR_POOLING_REJECTS_LOGITSPROCS)
        return classes

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; allowed: {sorted(names)}")
        return cls(**kwargs)

    def _mamba_block_size(self) -> int:
        """Tokens between prefix caching's recurrent-state snapshots: --mamba-block-size, else 256 rounded up to a
        multiple of the KV block size."""
        if self.mamba_block_size is None:
            return -(-256 // self.block_size) * self.block_size
        if self.mamba_block_size < 1 or self.mamba_block_size % self.block_size:
            raise ValueError(f"mamba_block_size must be a positive multiple of block_size {self.block_size}, got "
                             f"{self.mamba_block_size}")
        return self.mamba_block_size

    def _checked_cpu_offload_gb(self) -> float:
        gb = self.cpu_offload_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb >= 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {gb!r}")
        if gb == 0:
            return 0.0
        if DeviceConfig(self.device).resolve() != "cuda":
            raise ValueError(f"cpu_offload_gb={gb}: it keeps part of a GPU's weights in host memory; on the CPU "
                             "device all of them are there already (leave it 0)")
        clash = [name for name, on in (("enable_lora", self.enable_lora), ("enable_sleep_mode", self.enable_sleep_mode))
                 if on]
        if clash:
            raise ValueError(f"cpu_offload_gb={gb} with {', '.join(clash)}: not supported (offloaded layers' weights "
                             "live in a shared device buffer that adapters and sleep mode would write past); "
                             "use one or the other")
        return float(gb)

    def _check_recurrent_state_support(self) -> None:
        """What a model with state-space (Mamba) layers cannot run here, as clear errors; what it runs differently, as
        one log line. A sequence's recurrent state cannot be rewound, shared or moved block by block: no speculative
        decoding, prefix caching, swapping, KV offloading or LoRA; preemption recomputes; CUDA captures decode steps only."""
        refused = {
            "speculative_config": self.speculative_config is not None,
            "preemption_mode='swap'": self.preemption_mode == "swap",
            "kv_offloading_size": self.kv_offloading_size is not None,
            "enable_lora": bool(self.enable_lora),
            f"kv_cache_manager={self.kv_cache_manager!r}": self.kv_cache_manager != "paged",
        }
        bad = [name for name, on in refused.items() if on]
        if bad:
            raise ValueError(f"{', '.join(bad)}: not supported for models with state-space (Mamba) layers, whose "
                             "per-sequence recurrent state cannot be rewound, shared or moved block by block. Allowed: "
                             "the paged KV cache manager with recompute preemption, without speculative decoding, "
                             "KV offloading or LoRA.")
        notes = ["preemption recomputes"]
        if self.enable_prefix_caching:
            notes.append(f"prefix caching resumes from state snapshots every {self._mamba_block_size()} tokens")
        elif self.mamba_block_size is not None:
            raise ValueError(f"mamba_block_size={self.mamba_block_size} spaces prefix caching's state snapshots: "
                             "it needs enable_prefix_caching=True")
        if DeviceConfig(self.device).resolve() == "cuda" and not self.enforce_eager:
            notes.append("CUDA graphs for decode steps only (none without an attention layer)")
        logger.info("State-space (Mamba) layers: %s", "; ".join(notes))

    def create_engine_config(self, model_max_len: int, usage_context: str = "engine",
                             hf_config: Any = None, model_dir: str | os.PathLike[str] | None = None) -> EngineConfig:
        """Validated configs; `model_max_len` is the model's own context length. `usage_context` is vLLM's:
        "llm_class" (the offline `LLM`) gets a larger default step budget on a GPU. `hf_config` (the model's) lets
        runner="auto" see a base-model checkpoint; `model_dir` (its directory) lets a pooling model take its
        sentence-transformers pooling config."""
        max_model_len = self.max_model_len or model_max_len
        notes = self.compat_notes()
        if notes:
            logger.warning("vLLM options without effect here: %s", "; ".join(notes))
        runner, pooler, pooling_task = self._resolve_runner(hf_config, model_dir)
        encoder = hf_config is not None and is_encoder_only(hf_config)
        recurrent = hf_config is not None and has_recurrent_state(hf_config)
        if recurrent:
            self._check_recurrent_state_support()
        structured = self.structured_outputs_settings()
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an int >= 0, or -1 for no cap; got {self.max_logprobs!r}.")
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context length ({model_max_len})."
            )
        offline_gpu = usage_context == "llm_class" and DeviceConfig(self.device).resolve() == "cuda"
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            # Offline on a large GPU, as in vLLM's LLM class: decode batches of up to 1024 run the layer GEMMs
            # compute-bound instead of at the ridge point (issue 16's short workload, BENCHMARKS §31).
            max_num_seqs = 1024 if offline_gpu and is_large_gpu() else 256
        batched = self.max_num_batched_tokens
        if batched is None:
            # Offline on a GPU, as in vLLM's LLM class: bigger prefill chunks run the matmuls nearer their peak
            # (issue 16's long and short workloads: +1.5 points of the lower bound on the H100, BENCHMARKS §30);
            # 8192 is also the largest piecewise-captured step. Online, 2048 keeps decode steps short.
            budget = 8192 if offline_gpu else 2048
            if encoder:  # whole prompts only: a step holds the longest one, and a batch of short ones
                batched = max(budget, max_model_len)
            else:
                batched = max(budget, max_num_seqs) if self.enable_chunked_prefill else max_model_len
        if encoder:
            from pagedllm.engine.pooling import check_encoder_step_budget

            check_encoder_step_budget(batched, max_model_len, hf_config)
        elif not self.enable_chunked_prefill and batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be >= max_model_len ({max_model_len}) "
                "when chunked prefill is disabled."
            )
        model = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, dtype=self.dtype, seed=self.seed,
            max_model_len=max_model_len, load_format=self.load_format,
            skip_tokenizer_init=self.skip_tokenizer_init,
            enforce_eager=self.enforce_eager or encoder or (recurrent and not layer_sliding_windows(hf_config)),
            max_capture_tokens=self.max_capture_tokens, quantization=self.quantization, runner=runner,
            pooler_config=pooler, pooling_task=pooling_task, enable_prompt_embeds=self.enable_prompt_embeds,
            convert=self.convert if runner == "pooling" else "auto",
            logits_processors=self._logits_processor_classes(runner), logprobs_mode=self._checked_logprobs_mode(),
        )
        cache = CacheConfig(
            block_size=self.block_size, num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization, swap_space=self.swap_space,
            kv_offloading_size=self.kv_offloading_size, kv_offloading_backend=self.kv_offloading_backend,
            cpu_offload_gb=self._checked_cpu_offload_gb(),
            mamba_ssm_cache_dtype=self.mamba_ssm_cache_dtype,
            mamba_block_size=self._mamba_block_size() if recurrent and self.enable_prefix_caching else None,
            enable_prefix_caching=(self.enable_prefix_caching and not encoder
                                   and (pooler is None or pooler.pooling_type == "LAST")),
            preemption_mode="recompute" if recurrent else self.preemption_mode,
            kv_cache_manager=self.kv_cache_manager, cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales, disable_sliding_window=self.disable_sliding_window,
            disable_hybrid_kv_cache_manager=(self.disable_hybrid_kv_cache_manager or self.kv_cache_manager != "paged"
                                             or self.speculative_config is not None
                                             or self.kv_offloading_size is not None
                                             or self.kv_cache_dtype.startswith("fp8")
                                             or (DeviceConfig(self.device).resolve() == "cuda"
                                                 and os.environ.get(CUDA_HYBRID_KV_CACHE_ENV) == "0")),
        )
        cache.has_recurrent_state = recurrent
        if self.data_parallel_size > 1:  # the ranks share one host's memory: each takes its part of the budget
            cache.cpu_kv_cache_fraction /= self.data_parallel_size
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=batched,
            max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill and not encoder,
            async_scheduling=self.async_scheduling, batching=self.batching, policy=self.scheduling_policy,
            max_loras=self.max_loras if self.enable_lora else None,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
        )
        parallel = ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend,
                                  self.pipeline_parallel_size)
        spec = SpeculativeConfig.from_json(self.speculative_config)
        if spec is not None and self.kv_cache_manager != "paged":
            raise ValueError("speculative decoding needs kv_cache_manager='paged' (it rolls back rejected slots).")
        if runner == "pooling":
            if spec is not None:
                raise ValueError("speculative_config: a pooling model runs prompts only, so there is nothing to "
                                 "speculate; leave it unset with runner='pooling'.")
            if self.async_scheduling:
                raise ValueError("async_scheduling: a pooling model's steps end its requests, so they run one "
                                 "after another; leave it unset (or False) with runner='pooling'.")
        return EngineConfig(model, cache, sched, parallel, DeviceConfig(self.device), spec,
                            CompilationConfig.from_json(self.compilation_config), self._lora_config(runner, spec),
                            structured)

    def compat_notes(self) -> list[str]:
        """Check vLLM's model-source and parallelism options: a ValueError for a value pagedllm cannot honour,
        else one note per given option that has no effect here."""
        if isinstance(self.data_parallel_size, bool) or not isinstance(self.data_parallel_size, int) \
                or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size!r}: must be an integer >= 1 (the number "
                             "of engine-core processes behind the server).")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            why = ": pagedllm loads the model's Hugging Face tokenizer, not mistral_common's" \
                if self.tokenizer_mode == "mistral" else ""
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} is not supported{why}; allowed: "
                             f"{', '.join(TOKENIZER_MODES)} (each loads the model's Hugging Face tokenizer).")
        from pagedllm.model.loader import parse_hf_overrides

        parse_hf_overrides(self.hf_overrides)
        given = {
            "trust_remote_code": (self.trust_remote_code, "pagedllm runs its own model code, never a checkpoint's"),
            "revision": (self.revision, "models load from local files, which have one version"),
            "tokenizer_revision": (self.tokenizer_revision, "tokenizers load from local files"),
            "download_dir": (self.download_dir, "nothing is downloaded"),
            "hf_token": (self.hf_token, "nothing is downloaded"),
            "tokenizer_mode": (self.tokenizer_mode if self.tokenizer_mode == "slow" else None,
                               "the fast tokenizer is used when the model has one"),
            "max_seq_len_to_capture": (self.max_seq_len_to_capture, "decode CUDA graphs cover every context "
                                                                    "length up to max_model_len"),
        }
        shown = {name: "***" if name == "hf_token" and isinstance(value, str) else repr(value)  # never log a token
                 for name, (value, _) in given.items()}
        return [f"{name}={shown[name]} ({why})" for name, (value, why) in given.items() if value not in (None, False)]

    def _lora_config(self, runner: str, spec: SpeculativeConfig | None) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        single = self.tensor_parallel_size * self.pipeline_parallel_size == 1 \
            and self.distributed_executor_backend in (None, "uni")
        why = ("tensor or pipeline parallelism (adapters are applied in one process: tensor_parallel_size=1, "
               "pipeline_parallel_size=1)" if not single else
               "speculative decoding (leave speculative_config unset)" if spec is not None else
               "the pooling runner (LoRA adapters are served for generation)" if runner == "pooling" else None)
        if why is not None:
            raise ValueError(f"enable_lora does not combine with {why}.")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _resolve_runner(self, hf_config: Any, model_dir: str | os.PathLike[str] | None = None
                        ) -> tuple[str, PoolerConfig | None, str | None]:
        """(runner, pooler config, pooling task): "generate", None and None, or "pooling", its PoolerConfig and
        "embed" or "classify"."""
        from pagedllm.engine.pooling import resolve_pooler_config, resolve_pooling_task, resolve_runner

        for name, value, allowed in (("runner", self.runner, RUNNER_TYPES), ("convert", self.convert, CONVERT_TYPES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}.")
        runner = resolve_runner(self.runner, self.convert, hf_config)
        if runner != "pooling":
            if self.pooler_config not in (None, "", {}):
                raise ValueError("pooler_config applies to pooling models only: add runner='pooling' (--runner "
                                 "pooling) or drop it.")
            return runner, None, None
        task = resolve_pooling_task(self.convert, hf_config)
        pooler = resolve_pooler_config(self.pooler_config, hf_config, task, model_dir, self.convert)
        if hf_config is not None and is_encoder_only(hf_config):
            if self.enable_prefix_caching:
                logger.warning("Prefix caching is off: an encoder-only model attends over each whole prompt, so a "
                               "cached prefix would skip tokens the encoder needs.")
        elif self.enable_prefix_caching and pooler.pooling_type != "LAST":
            logger.warning(
                "Prefix caching is off: %s pooling reads every prompt token's hidden state, which a cached prefix "
                "would skip (LAST pooling keeps it).", pooler.pooling_type)
        return runner, pooler, task

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per field, named like the field with dashes (vLLM style)."""
        hints = get_type_hints(EngineArgs)
        for f in fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            help_text = _HELP.get(f.name, "") + f" (default: {f.default})"
            hint = hints[f.name]
            if f.name == "hf_token":  # vLLM's: a token, or the flag alone (the token of `huggingface-cli login`)
                parser.add_argument(flag, nargs="?", const=True, default=None, help=help_text)
                continue
            if f.name == "logits_processors":  # one or more 'module:Class' names
                parser.add_argument(flag, nargs="+", default=None, help=help_text)
                continue
            if hint is bool or _base_type(hint) is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
                continue
            base = _base_type(hint)
            choices = _CHOICES.get(f.name)
            parser.add_argument(*_SHORT_FLAGS.get(f.name, ()), flag, type=base, default=f.default, help=help_text,
                                choices=choices)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def _base_type(hint: Any) -> type:
    args = getattr(hint, "__args__", None)
    if args:
        return next(a for a in args if a is not type(None))
    return hint
