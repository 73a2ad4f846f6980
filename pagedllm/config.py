"""Engine configuration: one dataclass per concern, one source of truth per number."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.batch_invariance import batch_invariant_from_env

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
_PREEMPTION_MODES = ("recompute", "swap", "auto")
# "paged": PagedAttention's BlockManager; the others: the paper's Orca baselines (core/baselines.py).
KV_CACHE_MANAGERS = ("paged", "orca-oracle", "orca-pow2", "orca-max")
BATCHING_MODES = ("iteration", "request")
# vLLM's --scheduling-policy: first come first served, or by each request's priority (lower first), then arrival.
SCHEDULING_POLICIES = ("fcfs", "priority")
# KV pool element type: "auto" = the model dtype; "bfloat16" (e.g. a float32 model on the CPU with half the KV
# bytes); "fp8" = fp8_e4m3 (vLLM's names).
KV_OFFLOADING_BACKENDS = ("native",)
#: vLLM's --mamba-ssm-cache-dtype: the SSM state's dtype ("auto": the model's).
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# Weight quantization: "fp8" = e4m3 weights, per-channel scales, torch._scaled_mm (CUDA); "gguf" = a GGUF file's
# Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks kept quantized (CPU; the default for such a file on the CPU);
# "gptq", "awq", "compressed-tensors" = the checkpoint's own method, as vLLM (must match its quantization_config;
# integer weights run as GGUF blocks on the CPU, dequantized elsewhere: model/int_weight_checkpoint.py); "none" =
# dequantized.
QUANTIZATION_METHODS = ("fp8", "gguf", "gptq", "awq", "compressed-tensors", "mxfp4", "none")
# vLLM's logprobs_mode: what `logprobs` / `prompt_logprobs` report. raw: the model's logits (before logit_bias,
# penalties, custom processors, temperature, top-k/p); processed: after all of them; _logprobs: log-softmaxed.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's --runner: "generate" (sample tokens) or "pooling" (return one vector per prompt: embeddings); "auto" picks
# pooling for base-model checkpoints (architectures like LlamaModel, which have no LM head), else generate.
RUNNER_TYPES = ("auto", "generate", "pooling")
# vLLM's --convert: "embed" turns a *ForCausalLM model into an embedding model (implies runner pooling); "classify"
# serves a *ForSequenceClassification checkpoint as a classifier (what runner auto picks for one anyway); "reward"
# turns a *ForCausalLM model into a reward model (implies runner pooling): every prompt token's final hidden state
# (its LM head unused), the token_classify task (vLLM's as_reward_model).
CONVERT_TYPES = ("auto", "none", "embed", "classify", "reward")
# What a pooling model returns per prompt: an embedding, a classifier's class probabilities (its `score` head), or
# a token classifier's class probabilities for every prompt token (*ForTokenClassification).
POOLING_MODEL_TASKS = ("embed", "classify", "token_classify")
# How a prompt's hidden states become one vector (vLLM's pooling types): the last token's (decoder embedding models
# such as Qwen3-Embedding or e5-mistral), the mean over all tokens, or the first token's; "ALL" (vLLM's token
# pooling type) keeps every token's row: what the token_embed / token_classify tasks return, a token classifier's
# only pooling type (on other models it leaves their sequence pooling type at its default, as in vLLM); "STEP" (vLLM's
# other token pooling type, a process reward model's default) keeps only the rows of the prompt's step-tag tokens
# (`step_tag_id`; every row without one), their `returned_token_ids` columns (all without them).
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}.")


def check_token_id(name: str, value: Any) -> int | None:
    """A STEP pooling `step_tag_id`: None or an integer >= 0 (ValueError naming `name` otherwise)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a token id (an integer >= 0) or null, got {value!r}.")
    return value


def check_token_ids(name: str, value: Any) -> list[int] | None:
    """STEP pooling `returned_token_ids`: None, or a list of integers >= 0 (an empty list means every column, as
    in vLLM: None)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                                  for v in value):
        raise ValueError(f"{name} must be a list of column indices (integers >= 0) or null, got {value!r}.")
    return list(value) or None


def _check_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


@dataclass
class ModelConfig:
    """Which model, in which dtype, with what context length."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    max_capture_tokens: int = 8192  # piecewise graphs for steps up to this many tokens (0: none)
    quantization: str | None = None  # --quantization: None or one of QUANTIZATION_METHODS
    # vLLM's VLLM_BATCH_INVARIANT=1 (pagedllm/batch_invariance.py): outputs independent of batching and chunking
    batch_invariant: bool = field(default_factory=batch_invariant_from_env)
    runner: str = "generate"  # resolved: "generate" or "pooling"
    pooler_config: PoolerConfig | None = None  # set when runner == "pooling"
    pooling_task: str | None = None  # runner "pooling": one of POOLING_MODEL_TASKS
    convert: str = "auto"  # vLLM's --convert (CONVERT_TYPES); "reward": the rows are the hidden states, no head
    # --enable-prompt-embeds: prompts may be embeddings ({"prompt_embeds": tensor}), engine/prompt_embeds.py
    enable_prompt_embeds: bool = False
    # Custom logits processors (vLLM's logits_processors), resolved to LogitsProcessor subclasses
    # (pagedllm/logits_processor.py)
    logits_processors: tuple[type, ...] = ()
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES

    def __post_init__(self) -> None:
        if self.pooling_task is not None:
            _check_choice("pooling_task", self.pooling_task, POOLING_MODEL_TASKS)
        _check_choice("convert", self.convert, CONVERT_TYPES)
        if not isinstance(self.max_capture_tokens, int) or self.max_capture_tokens < 0:
            raise ValueError(f"max_capture_tokens must be an int >= 0, got {self.max_capture_tokens!r}.")
        _check_choice("dtype", self.dtype, _DTYPES)
        _check_choice("load_format", self.load_format, _LOAD_FORMATS)
        _check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        _check_positive_int("max_model_len", self.max_model_len, allow_none=True)


@dataclass
class PoolerConfig:
    """How a pooling model turns a prompt into one vector (vLLM's --pooler-config, a JSON object)."""

    pooling_type: str = "LAST"
    normalize: bool = True  # L2-normalize (a request's PoolingParams.normalize overrides it)
    # Classification models: softmax over the labels (sigmoid for one label) of the pooled logits; false: the raw
    # logits (a request's PoolingParams.activation overrides it).
    activation: bool = True
    # STEP pooling (reward models): keep the rows of the tokens with this id (None: every row), and these columns
    # of each row (None or []: all of them). A request's PoolingParams fields of the same names override them.
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pooling_type, str):
            self.pooling_type = self.pooling_type.upper()
        _check_choice("pooler_config.pooling_type", self.pooling_type, POOLING_TYPES)
        for name in ("normalize", "activation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"pooler_config.{name} must be true or false, got {getattr(self, name)!r}.")
        self.step_tag_id = check_token_id("pooler_config.step_tag_id", self.step_tag_id)
        self.returned_token_ids = check_token_ids("pooler_config.returned_token_ids", self.returned_token_ids)

    @classmethod
    def from_json(cls, value: Any) -> PoolerConfig:
        """From a dict or a JSON string (the CLI's --pooler-config); None/empty: the defaults."""
        if value is None or value == "" or value == {}:
            return cls()
        return _config_from_json(cls, "pooler_config", value)


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora): a batch mixes up to `max_loras` adapters (the device's adapter
    slots, sized for `max_lora_rank`, which bounds an adapter's rank); `max_cpu_loras` adapters stay loaded (least
    recently used ones not serving a request are dropped beyond it; default max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int("max_loras", self.max_loras)
        _check_positive_int("max_lora_rank", self.max_lora_rank)
        _check_positive_int("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")


@dataclass
class CacheConfig:
    """The paged KV cache: block size and how big the pools are."""

    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # On CPU, the fraction of *available* RAM given to the KV pool when nothing else says.
    cpu_kv_cache_fraction: float = 0.25
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    # GiB of CPU memory for a tier under the prefix cache (vLLM's --kv-offloading-size; core/kv_offload.py): cached
    # blocks the device pool evicts are kept there and copied back on a prefix hit. None: no tier.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None  # vLLM's --kv-offloading-backend: "native" (the only one here)
    # GiB of GPU weights kept in pinned host memory (vLLM's --cpu-offload-gb; worker/cpu_offload.py). 0: none.
    cpu_offload_gb: float = 0.0
    enable_prefix_caching: bool = False
    preemption_mode: str = "auto"
    kv_cache_manager: str = "paged"
    cache_dtype: str = "auto"  # --kv-cache-dtype
    # FP8 pools: per-layer k/v scales from one calibration pass at start-up (else 1.0); plain pools ignore it.
    calculate_kv_scales: bool = False
    # --disable-sliding-window: every layer keeps (and attends through) the whole context, capped at the window.
    disable_sliding_window: bool = False
    # --disable-hybrid-kv-cache-manager (also set where a feature needs one table per sequence): a model mixing
    # full-attention and sliding-window layers keeps one block table for all of them (core/kv_cache_groups.py).
    disable_hybrid_kv_cache_manager: bool = False
    # Filled in once the pools are sized.
    num_gpu_blocks: int | None = field(default=None, init=False)
    num_cpu_blocks: int | None = field(default=None, init=False)
    num_offload_blocks: int = field(default=0, init=False)  # the KV offloading tier's, after the swap pool's
    # Filled in from the model: the window every attention layer shares (Mistral-7B-v0.1, Phi-3), behind which the
    # block manager frees blocks; None when any layer attends to the whole context.
    sliding_window: int | None = field(default=None, init=False)
    # Filled in from the model: each KV cache group's window (core/kv_cache_groups.py); one entry unless hybrid.
    kv_cache_group_windows: tuple[int | None, ...] | None = field(default=None, init=False)
    # vLLM's --mamba-ssm-cache-dtype: state-space layers keep their SSM state in this dtype ("auto": the model's).
    mamba_ssm_cache_dtype: str = "auto"
    # Filled in from the model: it has state-space (Mamba) layers, whose per-sequence state lives in slots beside the
    # KV pool (core/block_manager.py num_state_slots; model/layers/mamba_state.py).
    has_recurrent_state: bool = field(default=False, init=False)
    # Prefix caching of such a model (core/state_snapshots.py): a state snapshot every `mamba_block_size` tokens
    # (vLLM's name), in `num_state_snapshots` slots after the sequences' (the worker sizes them). None / 0: none.
    mamba_block_size: int | None = None
    num_state_snapshots: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype={self.mamba_ssm_cache_dtype!r}: choose one of "
                             f"{', '.join(MAMBA_SSM_CACHE_DTYPES)}")
        _check_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        _check_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}."
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}.")
        self._check_kv_offloading()
        _check_choice("preemption_mode", self.preemption_mode, _PREEMPTION_MODES)
        _check_choice("kv_cache_manager", self.kv_cache_manager, KV_CACHE_MANAGERS)
        _check_choice("kv_cache_dtype", self.cache_dtype, KV_CACHE_DTYPES)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}.")
        if self.kv_cache_manager != "paged":
            if self.enable_prefix_caching:
                raise ValueError(
                    f"enable_prefix_caching needs kv_cache_manager='paged': {self.kv_cache_manager!r} "
                    "reserves one contiguous region per sequence and shares nothing."
                )
            if self.preemption_mode == "swap":
                raise ValueError(
                    f"preemption_mode='swap' needs kv_cache_manager='paged': {self.kv_cache_manager!r} "
                    "reserves memory up front and never preempts; use 'auto' or 'recompute'."
                )

    def _check_kv_offloading(self) -> None:
        size, backend = self.kv_offloading_size, self.kv_offloading_backend
        if backend is not None and backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend={backend!r}: supported: {', '.join(KV_OFFLOADING_BACKENDS)} "
                             "(pagedllm's own CPU tier; LMCache is not integrated)")
        if size is None:
            if backend is not None:
                raise ValueError(f"kv_offloading_backend={backend!r} needs kv_offloading_size (GiB of CPU memory)")
            return
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size keeps prefix-cache blocks that the KV pool evicts: it needs "
                             "enable_prefix_caching=True (--enable-prefix-caching)")


@dataclass
class SchedulerConfig:
    """Per-step limits of the iteration-level scheduler."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: derived from max_model_len
    max_model_len: int = 2048  # resolved copy of ModelConfig's, set by EngineConfig
    enable_chunked_prefill: bool = True
    # Fraction of the pool kept free when admitting new prompts, so admission does not thrash.
    watermark: float = 0.01
    # Overlap scheduling of step t+1 with the device running step t; None: the engine decides.
    async_scheduling: bool | None = None
    # "iteration": requests join and leave the batch every step (Orca, vLLM); "request": a batch of
    # requests runs until all of them finish before any other joins (FasterTransformer, paper §6.1).
    batching: str = "iteration"
    # "fcfs", or "priority": waiting requests are admitted, and running ones kept, lowest `priority` value first
    # (ties by arrival); the preemption victim is the running group that comes last in that order.
    policy: str = "fcfs"
    # With LoRA: the running set holds requests of at most this many distinct adapters (vLLM's max_loras: the
    # worker's adapter slots), so every step fits the slots; None without LoRA.
    max_loras: int | None = None
    # Chunked prefill (vLLM's names): a prompt chunk runs at most `long_prefill_token_threshold` tokens a step (0: no
    # cap), so one long prompt cannot take a step's whole budget. With `max_num_partial_prefills` > 1, at most that
    # many prompts prefill in one step, and at most `max_long_partial_prefills` of them have more than the
    # threshold left, so shorter prompts go ahead of long ones (the threshold then defaults to 4 % of
    # max_model_len).
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1

    def __post_init__(self) -> None:
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_loras", self.max_loras, allow_none=True)
        self._check_partial_prefills()
        _check_choice("batching", self.batching, BATCHING_MODES)
        _check_choice("scheduling_policy", self.policy, SCHEDULING_POLICIES)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}.")

    def _check_partial_prefills(self) -> None:
        _check_positive_int("max_num_partial_prefills", self.max_num_partial_prefills)
        _check_positive_int("max_long_partial_prefills", self.max_long_partial_prefills)
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: no cap), got {threshold!r}.")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills}).")
        if not self.enable_chunked_prefill and (self.max_num_partial_prefills > 1 or threshold):
            raise ValueError("max_num_partial_prefills > 1 and long_prefill_token_threshold need chunked prefill "
                             "(enable_chunked_prefill=True): without it a prompt runs whole in one step.")
        if threshold > self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({threshold}) must be <= max_model_len "
                             f"({self.max_model_len}).")
        if self.max_num_partial_prefills > 1 and not threshold:
            self.long_prefill_token_threshold = max(1, int(self.max_model_len * 0.04))


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None | "uni" | "mp" | "ray"
    # Stages of decoder layers, each on its own tensor-parallel group of ranks (vLLM's --pipeline-parallel-size).
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be one of [None, 'uni', 'mp', 'ray'], "
                f"got {self.distributed_executor_backend!r}."
            )

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class DeviceConfig:
    device: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("device", self.device, _DEVICES)

    def resolve(self) -> str:
        """The concrete device name: 'cuda' when asked for or available under 'auto'."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


SPEC_METHODS = ("ngram", "ngram_gpu", "draft_model")
_DEFAULT_PROMPT_LOOKUP = 5  # n-gram length when neither prompt_lookup_min nor prompt_lookup_max is given (vLLM's)
DRAFT_LENGTH_POLICIES = ("goodput", "fixed")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's names). `ngram`: prompt lookup; `ngram_gpu`: prompt lookup proposed,
    verified and accepted on the device, so that speculating steps overlap the host (greedy requests; others use
    `ngram`'s path, spec_decode/device_ngram.py); `draft_model`: a smaller checkpoint that shares the target's
    tokenizer (`model`: an HF directory, a .gguf file or the default model's name; its own KV pool under the
    target's block tables, spec_decode/draft_checkpoint.py), or without `model` the target's own first
    `draft_num_layers` layers (self-speculation, sharing its embeddings, lm_head and paged KV). The method may be
    left out: `draft_model` when `model` is given (as vLLM infers it), else `ngram`."""

    method: str | None = None
    num_speculative_tokens: int = 4
    # vLLM's defaults: given one bound, the other equals it; given neither, both are 5. A minimum of 1 proposes
    # after any recurring token, most often wrongly (acceptance 0.55 against 0.77 with 4 on the copy workload,
    # BENCHMARKS.md §46).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # the draft checkpoint (draft_model); None: self-speculation
    # The draft checkpoint's weight quantization (vLLM's speculative_config.quantization): None as for a target
    # (a quantized GGUF draft on the CPU in float32 keeps its blocks), "none", "gguf", ...
    quantization: str | None = None
    # The draft checkpoint's context (vLLM's speculative_config.max_model_len; default: what its config allows): a
    # sequence speculates while its drafts fit in it, and runs on without drafts past it.
    max_model_len: int | None = None
    # vLLM's draft_tensor_parallel_size: a draft checkpoint runs in the target's one process, so only 1.
    draft_tensor_parallel_size: int | None = None
    # vLLM's speculative_config.enforce_eager: the draft checkpoint's passes without CUDA graphs (None: as the
    # target; its one-token passes otherwise replay decode graphs of their own).
    enforce_eager: bool | None = None
    draft_num_layers: int | None = None  # self-speculation depth (default: a quarter of the layers)
    # Speculation is off for a step with more running sequences than this (decode is no longer
    # bandwidth-bound; measured in BENCHMARKS.md, see the README section).
    disable_by_batch_size: int = 16
    # A sequence whose recent acceptance rate (exponential average) falls below this stops
    # speculating for `cooldown_steps` steps, then tries again (asynchronous engines, or the "fixed"
    # policy; a synchronous engine's goodput rule weighs acceptance every step: spec_decoder._may_speculate).
    min_acceptance_rate: float = 0.2
    cooldown_steps: int = 16
    # "goodput": per step, verify the draft tokens that raise the expected tokens per second, from measured
    # step times and each sequence's acceptance (spec_decode/draft_length.py); "fixed": every proposed token.
    draft_length_policy: str = "goodput"

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        _check_choice("speculative_config.method", self.method, SPEC_METHODS)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = _DEFAULT_PROMPT_LOOKUP
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        _check_positive_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens)
        _check_positive_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min)
        _check_positive_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max)
        _check_positive_int("speculative_config.draft_num_layers", self.draft_num_layers, allow_none=True)
        _check_positive_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size)
        _check_positive_int("speculative_config.cooldown_steps", self.cooldown_steps)
        _check_choice("speculative_config.draft_length_policy", self.draft_length_policy, DRAFT_LENGTH_POLICIES)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max}).")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate!r}.")
        if self.model is not None and self.method != "draft_model":
            raise ValueError(f"speculative_config.model is the draft checkpoint of method 'draft_model'; method "
                             f"{self.method!r} proposes from the tokens alone (leave model unset).")
        if self.model is not None and self.draft_num_layers is not None:
            raise ValueError("speculative_config: give either model (a draft checkpoint) or draft_num_layers (the "
                             "target's own first layers as the draft), not both.")
        _check_positive_int("speculative_config.max_model_len", self.max_model_len, allow_none=True)
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={self.draft_tensor_parallel_size!r}: a "
                             f"draft checkpoint runs in the target's one process; allowed: 1.")
        if self.model is None and self.max_model_len is not None:
            raise ValueError("speculative_config.max_model_len is a draft checkpoint's context (model); the other "
                             "methods draft at every length.")
        if self.enforce_eager is not None and self.model is None:
            raise ValueError("speculative_config.enforce_eager applies to a draft checkpoint (model); the other "
                             "methods run within the target's steps.")
        if self.quantization is not None:
            if self.model is None:
                raise ValueError("speculative_config.quantization applies to a draft checkpoint (model); "
                                 "self-speculation runs the target's own weights.")
            _check_choice("speculative_config.quantization", self.quantization, QUANTIZATION_METHODS)

    @classmethod
    def from_json(cls, value: Any) -> SpeculativeConfig | None:
        """From a dict or a JSON string (the CLI's --speculative-config); None/empty stays None."""
        if value is None or value == "" or value == {}:
            return None
        return _config_from_json(cls, "speculative_config", value)


def _config_from_json(cls: type, name: str, value: Any) -> Any:
    """`cls` from an instance of it, a dict or a JSON string (a CLI flag), naming unknown keys."""
    from pagedllm.json_object import parse_json_object

    if isinstance(value, cls):
        return value
    value = parse_json_object(name, value)
    names = set(cls.__dataclass_fields__)
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"unknown {name} key(s) {unknown}; allowed: {sorted(names)}")
    return cls(**value)


# vLLM's CUDA-graph modes that this engine has. FULL (the default): a whole-step graph for every step that fits one
# (decode steps in the decode graphs; steps with prompt chunks of up to 2 048 tokens and 256 sequences in whole-step
# graphs with one unified attention launch), piecewise graphs split at attention for larger steps.
# FULL_AND_PIECEWISE: decode graphs, piecewise graphs for every step with prompt chunks. FULL_DECODE_ONLY: decode
# graphs only. NONE: no graphs (as enforce_eager). vLLM's PIECEWISE (no full graphs at all) is not offered.
CUDAGRAPH_MODES = ("FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE")


@dataclass
class CompilationConfig:
    """vLLM's ``compilation_config``, the part that applies here: which steps replay CUDA graphs."""

    cudagraph_mode: str = "FULL"

    def __post_init__(self) -> None:
        if self.cudagraph_mode == "PIECEWISE":
            raise ValueError("compilation_config.cudagraph_mode 'PIECEWISE' (no full graphs) is not offered: decode "
                             "steps always replay full graphs here; use 'FULL_AND_PIECEWISE' for piecewise graphs of "
                             f"the other steps. Allowed: {list(CUDAGRAPH_MODES)}.")
        _check_choice("compilation_config.cudagraph_mode", self.cudagraph_mode, CUDAGRAPH_MODES)

    @classmethod
    def from_json(cls, value: Any) -> CompilationConfig:
        """From a dict or a JSON string (the CLI's --compilation-config); None/empty is the default."""
        if value is None or value == "" or value == {}:
            return cls()
        return _config_from_json(cls, "compilation_config", value)

    @property
    def piecewise_graphs(self) -> bool:
        return self.cudagraph_mode in ("FULL", "FULL_AND_PIECEWISE")

    @property
    def whole_step_graphs(self) -> bool:
        return self.cudagraph_mode == "FULL"


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's ``structured_outputs_config`` (--structured-outputs-config): the engine's structured-output settings.

    * ``backend``: the grammar engine, as --structured-outputs-backend (its shorthand).
    * ``disable_fallback``: accepted for vLLM's configs; pagedllm never falls back to another backend (a constraint
      the backend rejects is an error), which is what this asks for.
    * ``disable_any_whitespace``: every JSON grammar (json, json_object) allows no whitespace at all, separators
      ``,`` and ``:`` on both backends, whatever a request's own ``disable_any_whitespace`` says. Off: each request
      decides (compact by default here, with xgrammar's ``, `` and ``: `` separators).
    * ``disable_additional_properties``: an object schema that lists properties or patternProperties and says
      nothing of ``additionalProperties`` allows no other key. Already so for ``properties`` on both backends
      (xgrammar's strict mode; llguidance's schemas are closed to match); on llguidance this adds the
      ``patternProperties`` objects, as vLLM's option does.
    * ``reasoning_parser``: as --reasoning-parser (its shorthand).
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        from pagedllm.reasoning import check_reasoning_parser
        from pagedllm.structured_output.params import STRUCTURED_OUTPUTS_BACKENDS

        _check_choice("structured_outputs_config.backend", self.backend, STRUCTURED_OUTPUTS_BACKENDS)
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be true or false, got "
                                 f"{getattr(self, name)!r}.")
        if self.reasoning_parser == "":  # vLLM's "unset"
            object.__setattr__(self, "reasoning_parser", None)
        if self.reasoning_parser is not None and not isinstance(self.reasoning_parser, str):
            raise ValueError(f"structured_outputs_config.reasoning_parser must be a parser name, got "
                             f"{self.reasoning_parser!r}.")
        try:
            check_reasoning_parser(self.reasoning_parser)
        except ValueError as e:
            raise ValueError(f"structured_outputs_config.reasoning_parser: {e}") from None

    @classmethod
    def from_json(cls, value: Any) -> StructuredOutputsConfig:
        """From an instance, a dict or a JSON string (the CLI's --structured-outputs-config); None/empty is the
        default. Unknown keys are a ValueError listing the allowed ones."""
        if value is None or value == "" or value == {}:
            return cls()
        return _config_from_json(cls, "structured_outputs_config", value)

    def merged(self, backend: str = "auto", reasoning_parser: str | None = None) -> StructuredOutputsConfig:
        """This config with its shorthand flags (--structured-outputs-backend, --reasoning-parser) folded in; a
        ValueError when a flag and the config name different values ("auto" and None are unset)."""
        from dataclasses import replace

        if backend != "auto" and self.backend not in ("auto", backend):
            raise ValueError(f"structured_outputs_backend={backend!r} and structured_outputs_config.backend="
                             f"{self.backend!r} disagree; give one of them (or the same value).")
        if reasoning_parser and self.reasoning_parser not in (None, reasoning_parser):
            raise ValueError(f"reasoning_parser={reasoning_parser!r} and structured_outputs_config.reasoning_parser="
                             f"{self.reasoning_parser!r} disagree; give one of them (or the same value).")
        return replace(self, backend=self.backend if backend == "auto" else backend,
                       reasoning_parser=self.reasoning_parser or reasoning_parser or None)


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    speculative_config: SpeculativeConfig | None = None
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    lora_config: LoRAConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
