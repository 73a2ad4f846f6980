"""LLMEngine: add_request / step / abort — one iteration of continuous batching per step()."""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from pagedllm.core.block_manager import NULL_BLOCK
from pagedllm.core.kv_accounting import KVMemoryBreakdown, kv_memory_breakdown
from pagedllm.core.kv_cache_groups import blocks_for_sequence
from pagedllm.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutputs
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.device_utils import async_tensor_h2d
from pagedllm.engine.generation_defaults import default_sampling_params, load_generation_config
from pagedllm.engine.arg_utils import CUDA_HYBRID_KV_CACHE_ENV, EngineArgs
from pagedllm.engine.beam_search import new_beam_state
from pagedllm.engine.gc_heap import freeze_startup_heap, release_frozen_heap
from pagedllm.engine.launched_step import LaunchedStep
from pagedllm.engine.output_processor import OutputProcessor, StopConfig
from pagedllm.engine.prompt_embeds import (as_model_input, check_takes_prompt_embeds, embeds_identifier,
                                           is_embeds_prompt)
from pagedllm.engine.pooling import (PoolingState, classification_labels, matryoshka_dimensions,
                                     token_type_start)
from pagedllm.engine.request_checker import RequestChecker, prompt_cache_salt, prompt_token_ids
from pagedllm.engine.sleep_mode import SleepState, check_sleep_args, check_wake_tags, sleep_mode_disabled_error
from pagedllm.kernels.compile_watch import watchers_paused
from pagedllm.logprobs import position_logprobs
from pagedllm.lora.request import LoRARequest
from pagedllm.reasoning import reasoning_token_ids
from pagedllm.model import loader
from pagedllm.model.layers.sampler import (
    Sampler,
    SamplingRow,
    apply_token_bitmask_,
    compute_prompt_logprobs,
    token_rank,
    warm_up_sampler,
)
from pagedllm.model.models.registry import (get_model_class, get_model_max_len, get_sliding_window, is_encoder_only,
                                            kv_cache_layout, layer_sliding_windows, text_config)
from pagedllm.multimodal.inputs import features_in_range
from pagedllm.multimodal.processor import MultiModalProcessor, checked_features, prepare_multimodal_prompt
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SAMPLING_EPS, RequestOutputKind, SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import get_tokenizer
from pagedllm.worker.model_input import (
    ExecuteModelRequest,
    SequenceChunk,
    logits_row_layout,
)
from pagedllm.worker.model_runner import PENDING_PIPELINE_LOGITS
from pagedllm.worker.profiler import ProfilerError, TorchProfilerConfig, profiler_disabled_error

logger = logging.getLogger("pagedllm")

PromptType = str | list[int] | dict
# A CPU engine runs a constrained prompt of at most this many tokens while its grammar compiles (on one of the
# cores, the step on the rest) and samples the first token from the kept logits once the grammar is ready.
# A longer prompt waits for the grammar: at half the threads its prefill would outlast the compile.
_CPU_DEFER_SAMPLE_MAX_PROMPT = 64
# What a pooling request runs under: its prompt, then nothing (it finishes when its last prompt chunk has run).
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                   output_kind=RequestOutputKind.FINAL_ONLY)


class LLMEngine:
    """Owns the scheduler (block manager inside), the executor (workers) and the tokenizer."""

    def __init__(self, engine_args: EngineArgs, usage_context: str = "engine") -> None:
        release_frozen_heap()
        self.engine_args = engine_args
        # vLLM's torch profiler (worker/profiler.py): read once, here; a bad profiler_config fails before loading
        self.profiler_config = TorchProfilerConfig.from_env(engine_args.profiler_config)
        self._profiling = False
        if self.profiler_config.enabled:
            logger.info("Torch profiling enabled: start_profile() / stop_profile() save traces to %s (%s)",
                        self.profiler_config.torch_profiler_dir, self.profiler_config)
        self.model_dir = loader.prepare_model_dir(engine_args.model, engine_args.load_format)
        self.hf_config = loader.load_config(self.model_dir, hf_overrides=engine_args.hf_overrides)
        self.hf_text_config = text_config(self.hf_config)  # the language model's (a multimodal model's text_config)
        model_max_len = get_model_max_len(self.hf_config, engine_args.max_model_len)
        window = get_sliding_window(self.hf_config)
        if engine_args.disable_sliding_window and window is not None:
            model_max_len = min(model_max_len, window)  # within the window full attention is the window's
        self.config = engine_args.create_engine_config(model_max_len, usage_context, self.hf_config,
                                                       self.model_dir)
        mc, cc, sc = self.config.model_config, self.config.cache_config, self.config.scheduler_config
        if mc.enable_prompt_embeds:
            check_takes_prompt_embeds(get_model_class(self.hf_config))
        self.default_sampling_params = default_sampling_params(
            self.model_dir, engine_args.generation_config, engine_args.override_generation_config)
        self.tokenizer = None
        self.mm_processor = None  # a multimodal model's: prompts with multi_modal_data → ids and pixel values
        if not mc.skip_tokenizer_init:
            self.tokenizer = get_tokenizer(str(self.model_dir), mc.tokenizer)
            self.mm_processor = MultiModalProcessor.for_model(self.model_dir, self.hf_config,
                                                              engine_args.limit_mm_per_prompt)
        torch.manual_seed(mc.seed)
        self._check_async_scheduling()
        self.executor = self._make_executor()
        num_gpu, num_cpu, num_offload = self.executor.determine_num_available_blocks()
        if num_gpu < 1:
            raise ValueError(
                "the KV cache budget holds no block at all; raise kv_cache_memory_bytes / "
                "gpu_memory_utilization or set num_gpu_blocks_override."
            )
        cc.num_gpu_blocks, cc.num_cpu_blocks, cc.num_offload_blocks = num_gpu, num_cpu, num_offload
        self.executor.initialize_cache(num_gpu, num_cpu + num_offload)  # the tier's CPU blocks after the swap pool's
        logger.info(
            "KV cache: %d blocks × %d tokens = %d token slots on %s (%d CPU swap blocks, kv_cache_dtype=%s); "
            "max_model_len=%d",
            num_gpu, cc.block_size, num_gpu * cc.block_size, self.executor.device, num_cpu, cc.cache_dtype,
            sc.max_model_len,
        )
        if num_offload:
            logger.info("KV offloading: %d CPU blocks (%.1f GiB) under the prefix cache: blocks the pool evicts are "
                        "kept there and copied back on a prefix hit", num_offload, cc.kv_offloading_size)
        layout = kv_cache_layout(self.hf_config, cc)
        cc.kv_cache_group_windows = layout.group_windows
        cc.sliding_window = layout.groups[0].sliding_window if not layout.is_hybrid else None
        if cc.sliding_window is not None:
            logger.info("Sliding-window attention on every layer (%d tokens): KV blocks behind the window are freed",
                        cc.sliding_window)
        logger.info("Maximum concurrency for %d tokens per request: %.2fx", sc.max_model_len,
                    num_gpu / blocks_for_sequence(layout.group_windows, sc.max_model_len, cc.block_size))
        if layout.is_hybrid:
            logger.info("Hybrid KV cache: %d groups of %d layers (windows %s) share the pool; a block holds %d "
                        "layers, and sliding groups free their blocks behind the window",
                        layout.num_groups, layout.num_slots, [g.sliding_window for g in layout.groups],
                        layout.num_slots)
        elif len(set(layer_sliding_windows(self.hf_config))) > 1 and not engine_args.disable_sliding_window:
            logger.info("Full-attention and sliding-window layers under one block table (the hybrid KV cache "
                        "manager is off: --disable-hybrid-kv-cache-manager, speculative decoding, an FP8 KV "
                        "cache, a contiguous kv_cache_manager, or CUDA with %s=0)", CUDA_HYBRID_KV_CACHE_ENV)
        self.scheduler = Scheduler(sc, cc)
        self.sampler = Sampler(batch_invariant=mc.batch_invariant, logprobs_mode=mc.logprobs_mode)
        if str(self.executor.device).startswith("cuda"):  # warm start: the first request loads no kernel
            with watchers_paused():
                warm_up_sampler(self.sampler, int(self.hf_text_config.vocab_size), self.executor.device,
                                self.executor.dtype)
        self._seq_counter = itertools.count()
        self.eos_token_ids = self._eos_token_ids()
        on_cpu = self.executor.device.type == "cpu"
        # On a CPU engine a grammar compiles on one thread, and the forward pass gives up one of its threads
        # meanwhile (`_share_cores_with_compiles`): on 2 cores, both at full width slowed a step 5x, sharing 1.6x.
        structured = self.config.structured_outputs_config  # the shorthand flags folded in
        self.structured_output = StructuredOutputManager(
            structured.backend, self.tokenizer, int(self.hf_text_config.vocab_size),
            self.eos_token_ids,
            num_threads=1 if on_cpu else None, pin_memory=str(self.executor.device).startswith("cuda"),
            reasoning_tokens=(reasoning_token_ids(self.tokenizer, structured.reasoning_parser)
                              if structured.reasoning_parser else None),
            config=structured)
        self._torch_threads = torch.get_num_threads() if on_cpu else None
        if not on_cpu:
            # Tokenizer tables (~1 s) on a thread now, not in the first constrained request's TTFT. On a CPU
            # host that thread would contend with the forward pass of every engine, most never constrained.
            self.structured_output.start_backend_init()
            # The bitmask kernel compiles at its first use: both variants (every row / a row list) now, not
            # in the first constrained TTFT.
            vocab = int(self.hf_text_config.vocab_size)
            with watchers_paused():
                for rows in ([0, 1], [0]):
                    apply_token_bitmask_(torch.zeros((2, vocab), dtype=self.executor.dtype,
                                                     device=self.executor.device),
                                         torch.full((2, (vocab + 31) // 32), -1, dtype=torch.int32), rows)
            self.structured_output.reserve_buffers(self.config.scheduler_config.max_num_seqs)
        self._awaiting_grammar: list[SequenceGroup] = []  # constrained requests whose grammar still compiles
        # Their prompts run meanwhile (all but the last token) on a GPU, where the compile has host cores of its
        # own. A CPU engine gives a core to the compile and runs steps one thread narrower meanwhile: a long
        # prompt there would run at half speed past the compile's end, which made time to first token worse
        # (BENCHMARKS.md §41), so it waits for its grammar there. A short one runs whole while the grammar
        # compiles, and its first token is sampled from the kept logits as soon as the grammar is ready:
        # no step of its own after the compile (§46).
        self._prefill_while_compiling = self.executor.device.type != "cpu"
        self._defer_sample_max_prompt = _CPU_DEFER_SAMPLE_MAX_PROMPT
        self.output_processor = OutputProcessor(
            self.scheduler,
            self.tokenizer,
            StopConfig(self.eos_token_ids, self.max_seq_len),
            lambda: next(self._seq_counter),
            self.structured_output,
        )
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.async_scheduling = self._resolve_async_scheduling()
        self.spec_decoder = None
        if self.config.speculative_config is not None:
            from pagedllm.spec_decode.spec_decoder import SpecDecoder

            self.spec_decoder = SpecDecoder(self.config.speculative_config, self.scheduler, self.executor,
                                            self.max_seq_len, async_steps=self.async_scheduling,
                                            structured_output=self.structured_output)
        self._inflight: LaunchedStep | None = None  # the launched step whose outputs are not out yet
        # Pipeline stages (CPU, mp executor): up to one step per stage in flight, on disjoint requests, oldest first.
        self._pipeline_depth = getattr(self.executor, "pipeline_depth", 1)
        self._pipeline_steps: collections.deque[LaunchedStep] = collections.deque()
        self.logits_processors = None  # custom LogitsProcessors (pagedllm/logits_processor.py)
        if self.config.model_config.logits_processors:
            from pagedllm.logits_processor import LogitsProcessorBatch

            self.logits_processors = LogitsProcessorBatch(self.config.model_config.logits_processors, self.config,
                                                          self.executor.device)
        self._sleep = SleepState()  # sleep mode (engine/sleep_mode.py)
        self.device_spec = None
        if self.spec_decoder is not None and self.config.speculative_config.method == "ngram_gpu":
            from pagedllm.engine.device_spec_loop import DeviceSpecLoop

            self.device_spec = DeviceSpecLoop(self)  # (one process only: _check_async_scheduling)
        logger.info("Asynchronous scheduling: %s", "on" if self.async_scheduling else "off")
        if not on_cpu:  # every warm-up above is done: a Triton build from here on is logged as a step's wait
            self.executor.collective_rpc("watch_compilations")
        freeze_startup_heap()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: str = "engine") -> LLMEngine:
        return cls(engine_args, usage_context)

    def _make_executor(self):
        backend = self.config.parallel_config.distributed_executor_backend
        if self.config.parallel_config.world_size == 1 and backend in (None, "uni"):
            from pagedllm.executor.uniproc import UniProcExecutor

            return UniProcExecutor(self.config, str(self.model_dir), self.hf_config)
        from pagedllm.executor import get_distributed_executor  # tensor parallelism

        return get_distributed_executor(self.config, str(self.model_dir), self.hf_config)

    def _check_async_scheduling(self) -> None:
        """The next step reads the sampled tokens from the device, so every rank must share the sampler's
        memory: tensor-parallel executors run synchronously. `ngram_gpu` keeps its state in this process's
        worker too."""
        pc = self.config.parallel_config
        single = pc.world_size == 1 and pc.distributed_executor_backend in (None, "uni")
        if self.config.scheduler_config.async_scheduling and not single:
            raise ValueError(
                "async_scheduling needs the single-process executor (tensor_parallel_size=1, "
                "distributed_executor_backend None or 'uni'); turn it off for tensor or pipeline parallelism."
            )
        spec = self.config.speculative_config
        if spec is not None and spec.model is not None and not single:
            raise ValueError("speculative_config.model: a draft checkpoint runs in the target's process "
                             "(tensor_parallel_size=1, distributed_executor_backend None or 'uni'); use \"ngram\" "
                             "with tensor parallelism.")
        if spec is not None and spec.method == "ngram_gpu" and not single:
            raise ValueError('speculative_config method "ngram_gpu" needs the single-process executor '
                             "(tensor_parallel_size=1, distributed_executor_backend None or 'uni'); use \"ngram\" "
                             "with tensor parallelism.")

    @property
    def runner(self) -> str:
        """"generate" or "pooling" (vLLM's --runner, resolved)."""
        return self.config.model_config.runner

    def _resolve_async_scheduling(self) -> bool:
        """On by default for CUDA in one process: where the host can run ahead of the device (not for a pooling
        model, whose steps end their requests)."""
        if self.runner == "pooling":
            return False
        wanted = self.config.scheduler_config.async_scheduling
        if wanted is None:
            return getattr(self.executor, "supports_async_scheduling", False) and self.executor.device.type == "cuda"
        return wanted

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for source in (self.hf_text_config, load_generation_config(self.model_dir)):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    @property
    def max_seq_len(self) -> int:
        """Longest a sequence may grow: the model's limit and the whole pool's capacity."""
        return self.request_checker.max_seq_len

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> SequenceGroup:
        """Validate and queue a request; raises ValueError (engine untouched) on bad input. `priority`: under
        the priority scheduling policy, lower values are served first (ties by arrival). A pooling engine
        (runner "pooling") takes PoolingParams (or None) and returns a PoolingRequestOutput. `lora_request`: the
        LoRA adapter to run with (enable_lora engines; loaded on first use, a ValueError if it cannot be)."""
        self._sleep.check_awake()
        pooling = None
        if self.runner == "pooling" or isinstance(params, PoolingParams):
            pooling = self.request_checker.check_pooling_params(params)
            params = _POOLING_SAMPLING
        params = params or SamplingParams()
        self.request_checker.check_priority(priority)
        self.request_checker.check_params(params)
        prompt = prepare_multimodal_prompt(prompt, self.mm_processor, self.hf_config)
        truncate = pooling.truncate_prompt_tokens if pooling is not None else params.truncate_prompt_tokens
        embeds = None
        if is_embeds_prompt(prompt):  # checked, truncated, cast to the model's dtype; vLLM's placeholder ids
            embeds = as_model_input(self.request_checker.prompt_embeds(prompt, truncate), self.executor.dtype)
        text, token_ids = self._tokenize(prompt) if embeds is None else (None, [0] * len(embeds))
        mm_features = checked_features(prompt, token_ids, self.mm_processor, self.hf_config)
        n_before = len(token_ids)
        token_ids = self.request_checker.truncate(token_ids, truncate)
        if mm_features and len(token_ids) != n_before:
            raise ValueError(f"truncate_prompt_tokens={truncate} would cut this prompt's {n_before} tokens, which "
                             f"hold image placeholders; leave it unset for prompts with images.")
        self.request_checker.check_prompt_ids(token_ids)
        types_start = self._token_type_start(prompt, n_before, len(token_ids))
        limit = self.max_seq_len
        if any(g.request_id == request_id for g in self._all_groups()):
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Validated here (ValueError naming the problem); compiled on a thread, cached by (kind, spec).
        grammar = None if params.structured_outputs is None else self.structured_output.request(params.structured_outputs)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(token_ids)
        salt = prompt_cache_salt(prompt)
        if lora_request is not None:
            self._load_lora(lora_request)
            # An adapter changes every layer's K/V: its prompts' blocks are cached apart from the base model's.
            salt = f"{salt or ''}\0lora:{lora_request.lora_int_id}"
        placeholders = tuple((f.placeholder.offset, f.placeholder.length, f.identifier) for f in mm_features)
        if embeds is not None:  # the embeddings key every prompt block in the prefix cache, as an image its own
            placeholders = ((0, len(embeds), embeds_identifier(embeds)),)
        seq = Sequence(next(self._seq_counter), list(token_ids), cache_salt=salt, mm_placeholders=placeholders)
        group = SequenceGroup(
            request_id=request_id,
            seqs=[seq],
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            prompt=text,
            priority=priority,
            lora_int_id=lora_request.lora_int_id if lora_request is not None else 0,
        )
        group.extra["max_tokens"] = max_tokens
        group.extra["best_of"] = params.best_of or params.n
        if pooling is not None:
            classify = self.config.model_config.pooling_task in ("classify", "token_classify")
            convert = self.config.model_config.convert
            num_labels = len(classification_labels(self.hf_config, convert)) if classify else None
            state = PoolingState.of(pooling, self.config.model_config.pooler_config, num_labels,
                                    token_ids=None if embeds is not None else list(token_ids))
            group.extra["pooling"] = state
            group.needs_every_prompt_row = state.wants_every_row
        if lora_request is not None:
            group.extra["lora_request"] = lora_request
        if mm_features:
            group.extra["mm_features"] = mm_features
        if embeds is not None:
            group.extra["prompt_embeds"] = embeds
        if types_start is not None:
            group.extra["token_type_start"] = types_start
        if params.bad_words:
            group.extra["bad_words_token_ids"] = self._bad_words_token_ids(params.bad_words)
        if params.use_beam_search:
            group.extra["beam"] = new_beam_state(params, max_tokens)
        seq.extra["generator"] = self._make_generator(params, 0)
        self.scheduler.block_manager.check_admissible(group)  # a contiguous reservation may never fit
        self.output_processor.init_sequence(seq, params)
        if grammar is not None:
            if grammar.done() and grammar.exception() is None:  # cached
                group.extra["structured_output"] = grammar.result()
            else:
                # Its prompt, all but the last token, runs while the grammar compiles (the last token's step
                # samples: it waits for the grammar). Others keep running; a failed compile aborts it.
                group.extra["grammar_future"] = grammar
                self._awaiting_grammar.append(group)
                group.may_sample = False
                group.defer_sample = (not self._prefill_while_compiling and "beam" not in group.extra
                                      and len(token_ids) <= self._defer_sample_max_prompt)
                if not group.defer_sample and (len(token_ids) < 2 or not self._prefill_while_compiling):
                    return group  # nothing to run before the grammar is ready: enters the scheduler then
                group.extra["grammar_prefill"] = True
        self.scheduler.add_seq_group(group)
        return group

    def _load_lora(self, lora_request: LoRARequest) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        if self.config.lora_config is None:
            raise ValueError("this engine serves no LoRA adapters: build it with enable_lora=True (--enable-lora).")
        in_use = {g.lora_int_id for g in self._all_groups() if g.lora_int_id}
        self.executor.add_lora(lora_request, in_use)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded LoRA adapter (vLLM's name); ValueError while unfinished requests run with it. False if
        it was not loaded."""
        users = [g.request_id for g in self._all_groups()
                 if g.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} serves {len(users)} unfinished request(s); unload it when "
                             f"they finish.")
        return self.config.lora_config is not None and self.executor.remove_lora(lora_int_id)

    @functools.cached_property
    def request_checker(self) -> RequestChecker:
        """The configuration-only request checks (plain data: the API server process checks with it)."""
        sc, cc = self.config.scheduler_config, self.config.cache_config
        task = self.config.model_config.pooling_task
        return RequestChecker(vocab_size=int(self.hf_text_config.vocab_size), max_model_len=sc.max_model_len,
                              num_gpu_blocks=cc.num_gpu_blocks, block_size=cc.block_size,
                              max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                              scheduling_policy=sc.policy, max_logprobs=self.engine_args.max_logprobs,
                              runner=self.runner, hidden_size=int(self.hf_text_config.hidden_size),
                              matryoshka_dimensions=matryoshka_dimensions(self.hf_config),
                              pooling_task=task, sliding_window=cc.sliding_window,
                              group_windows=cc.kv_cache_group_windows,
                              enable_prompt_embeds=self.config.model_config.enable_prompt_embeds,
                              logits_processors=self.config.model_config.logits_processors,
                              labels=(classification_labels(self.hf_config, self.config.model_config.convert)
                                      if task in ("classify", "token_classify") else ()),
                              cls_classifier=task == "classify" and is_encoder_only(self.hf_config),
                              pooling_type=getattr(self.config.model_config.pooler_config, "pooling_type", None))

    def check_request(self, prompt: PromptType, params: SamplingParams | None, priority: int = 0) -> None:
        """The checks `add_request` makes, reading only the configuration (safe from another thread).

        A text prompt's ids are checked by `add_request` once tokenized."""
        self.request_checker.check_request(prompt, params, priority)

    def _token_type_start(self, prompt: PromptType, n_given: int, n_kept: int) -> int | None:
        """Where a token-id prompt's ``token_type_ids`` (a BERT pair's) turn to 1, after truncation kept its last
        `n_kept` of `n_given` tokens; None where every token is type 0 or the model takes no token types."""
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if (types is None or not getattr(get_model_class(self.hf_config), "supports_token_types", False)
                or int(getattr(self.hf_config, "type_vocab_size", 1) or 1) < 2):
            return None
        start = token_type_start(types, n_given)
        return None if start is None else max(0, start - (n_given - n_kept))

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        ids = prompt_token_ids(prompt)  # raises for a malformed prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), ids
            prompt = prompt["prompt"]
        if ids is not None:
            return None, ids
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this engine has skip_tokenizer_init=True")
        return prompt, self.tokenizer.encode(prompt)

    def _bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token sequences, as it starts the text and after a space (vLLM's two forms)."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this engine has skip_tokenizer_init=True.")
        out: list[tuple[int, ...]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)

    @staticmethod
    def _make_generator(params: SamplingParams, index: int) -> random.Random | None:
        if params.seed is None:
            return None
        # On the host whatever the device: the sampler draws one uniform per sample from it (inverse_cdf.py),
        # ~1 µs in Python, where a device generator costs a launch per seeded row and step.
        return random.Random((params.seed * 1_000_003 + index) % (2**63))

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.abort_seq_group(rid)
            for group in [g for g in self._awaiting_grammar if g.request_id == rid]:
                self._awaiting_grammar.remove(group)
                for seq in group.seqs:
                    if not seq.is_finished():  # (the scheduler has freed those it held)
                        seq.status = SequenceStatus.FINISHED_ABORTED
        if self._torch_threads is not None:
            self._share_cores_with_compiles()  # the last compiling request may be gone: all threads back

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_seqs() or self._inflight is not None or bool(self._pipeline_steps)
                or bool(self._awaiting_grammar))

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups() + len(self._grammar_only())

    def _grammar_only(self) -> list[SequenceGroup]:
        """Requests waiting for their grammar outside the scheduler (one-token prompts)."""
        return [g for g in self._awaiting_grammar if not g.extra.get("grammar_prefill")]

    def _all_groups(self):
        s = self.scheduler
        return itertools.chain(s.waiting, s.running, s.swapped, self._grammar_only())

    def _share_cores_with_compiles(self) -> None:
        """CPU engine: one torch thread fewer while a grammar compiles (on its own core), all of them otherwise."""
        want = max(1, self._torch_threads - 1) if self._awaiting_grammar else self._torch_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _only_held_prompts_left(self) -> bool:
        """The scheduler has nothing to run but prompts held at their last token, or run whole with their first
        sample deferred (their grammars compile)."""
        s = self.scheduler
        for group in itertools.chain(s.waiting, s.running, s.swapped):
            held = 0 if group.defer_sample else 1
            if group.may_sample or any(seq.num_uncomputed_tokens > held for seq in group.unfinished_seqs()):
                return False
        return True

    def _admit_compiled(self, may_wait: bool = True) -> list[RequestOutput]:
        """Move requests whose grammar finished compiling into the scheduler (a failed compile ends the
        request as aborted; validation already caught bad input in add_request); sample the first token of
        those whose prompt already ran whole. `may_wait`: with nothing else to run, wait up to 50 ms for a
        compile first."""
        if not self._awaiting_grammar:
            return []
        if may_wait and self._inflight is None and not self._pipeline_steps and self._only_held_prompts_left():
            # nothing else to do: wait a bit
            wait_futures([g.extra["grammar_future"] for g in self._awaiting_grammar], 0.05, FIRST_COMPLETED)
        outputs, still, held = [], [], []
        for group in self._awaiting_grammar:
            fut = group.extra["grammar_future"]
            if group.is_finished():  # ended meanwhile (in the scheduler: ignored, aborted)
                continue
            if not fut.done():
                still.append(group)
                continue
            in_scheduler = group.extra.pop("grammar_prefill", False)
            del group.extra["grammar_future"]
            if fut.exception() is not None:
                logger.error("request %s: its grammar failed to compile: %s", group.request_id, fut.exception())
                if in_scheduler:
                    self.scheduler.abort_seq_group(group.request_id)  # frees its prompt's blocks
                for seq in group.seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                outputs.append(self.output_processor.make_output(group))
                continue
            # The compiled grammar itself from here on: the step reads it for every constrained row.
            group.extra["structured_output"] = fut.result()
            group.may_sample = True
            group.defer_sample = False
            if "held_logits" in group.extra:
                held.append(group)
            if not in_scheduler:
                self.scheduler.add_seq_group(group)
        self._awaiting_grammar = still
        if held:
            outputs.extend(self._sample_held_logits(held))
        return outputs

    def _sample_held_logits(self, groups: list[SequenceGroup]) -> list[RequestOutput]:
        """The first token of requests whose prompt ran whole while their grammar compiled, sampled from the
        logits row their last prompt step kept, under the now compiled grammar's mask."""
        owners: list[ScheduledSequence] = []
        rows: list[SamplingRow] = []
        logits: list[torch.Tensor] = []
        for group in groups:
            row = group.extra.pop("held_logits")
            seq = group.seqs[0]
            if seq.status != SequenceStatus.RUNNING:
                # Preempted since (recompute or swap): its last prompt token runs again, and that step samples.
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.get_len() - 1)
                continue
            owners.append(ScheduledSequence(group, seq, 0))
            rows.append(self._sampling_row(group, seq))
            logits.append(row)
            seq.num_pending_tokens += 1  # (_append_samples takes it back)
        if not owners:
            return []
        raw = torch.stack(logits)
        stacked = self._custom_processed(raw, owners, rows)
        live = list(range(len(owners)))
        job = self.structured_output.start_fill([(it.seq, it.group.extra["structured_output"]) for it in owners],
                                                overlap=False, rows=live, batch=len(owners))
        bitmask = (self.structured_output.mask_result(job), live)
        samples, full_logprobs = self.sampler.launch(stacked, rows, token_bitmask=bitmask,
                                                     raw_logits=raw if stacked is not raw else None).result()
        touched: dict[str, SequenceGroup] = {}
        self._append_samples(owners, samples, full_logprobs, touched)
        return self._outputs_of(touched)

    def _custom_processed(self, logits: torch.Tensor, owners: list[ScheduledSequence],
                          rows: list[SamplingRow]) -> torch.Tensor:
        """The custom logits processors' logits for these rows (unchanged without processors)."""
        if self.logits_processors is None:
            return logits
        from pagedllm.logits_processor import LogitsRow

        batch = [LogitsRow(item.seq.seq_id, row.params, row.prompt_token_ids, row.output_token_ids)
                 for item, row in zip(owners, rows)]
        all_greedy = all(row.params.temperature < SAMPLING_EPS for row in rows)
        return self.logits_processors.apply(logits, batch, all_greedy)

    def _sampling_row(self, group: SequenceGroup, seq: Sequence) -> SamplingRow:
        """What the sampler needs for one sequence's next token; a single sequence's first sample draws
        best_of tokens (the group forks at the end of its prompt)."""
        fork_at_prompt_end = (not seq.output_token_ids and not seq.num_pending_tokens and len(group.seqs) == 1
                              and "beam" not in group.extra)
        num_samples = group.extra["best_of"] if fork_at_prompt_end else 1
        return SamplingRow(group.sampling_params, seq.prompt_token_ids, seq.output_token_ids,
                           seq.extra.get("generator"), num_samples, self.eos_token_ids,
                           group.extra.get("bad_words_token_ids", ()))

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Schedule, run the model once, sample, and return outputs of groups that progressed.

        With asynchronous scheduling the step launched here stays in flight: the next call schedules
        and launches its successor first (the new tokens are fed to it on the device), then waits for
        this one and returns its outputs, so the host's scheduling overlaps the device's compute.
        """
        if self._pipeline_depth > 1:
            return self._pipelined_step()
        start, tokens_before = time.perf_counter(), self.num_generation_tokens_total
        outputs: list[RequestOutput] = self._admit_compiled()
        if self._torch_threads is not None:
            self._share_cores_with_compiles()
        if self.device_spec is not None and self.device_spec.step(outputs):
            return outputs
        prev, self._inflight = self._inflight, None
        spec = self.spec_decoder
        small = spec is not None and spec.small_batch()
        spec_mode = small and spec.mode_allows()
        if prev is not None and (prev.needs_host_results or (spec_mode and spec.worth_syncing())):
            outputs.extend(self._complete_step(prev))
            prev = None
        sched = self.scheduler.schedule()
        outputs.extend(self._finish_ignored(g) for g in sched.ignored_groups)
        # Speculation needs every input token on the host: only when no step is in flight (and, with
        # asynchronous scheduling, while speculating measures faster than not: spec_decode/mode.py).
        planned = (spec is not None and prev is None and spec.mode_allows()
                   and not (self.device_spec is not None and self.device_spec.skips_host_drafts(sched)))
        drafts = spec.plan(sched) if planned else {}
        cur = None
        if not sched.is_empty():
            cur = self._launch_forward(sched, prev, drafts)
            if prev is not None and cur.mask_waits_for_prev:
                # This step's grammar masks need prev's tokens on the host: read them while the device
                # runs this step's forward pass, then fill the masks and queue the sampling before building
                # prev's outputs (the device waits for it). An expensive fill runs on the mask thread instead,
                # overlapping the outputs, and the sampling is queued after them.
                outputs.extend(self._complete_step(prev, then=functools.partial(self._mask_then_sample, cur)))
                prev = None
            if not cur.sampling_launched:
                self._launch_sampling(cur)
        if prev is not None:
            outputs.extend(self._complete_step(prev))
        if cur is not None:
            # After prev completed: a block filled by prev's token is hashed with its real id.
            self.scheduler.mark_computed(cur.scheduled)
            if self.async_scheduling and not cur.needs_host_results:
                self._inflight = cur
            else:
                outputs.extend(self._complete_step(cur))
                if planned:
                    spec.step_finished()  # a whole step timed on the host: the draft-length cost model
        if self._awaiting_grammar:  # a grammar that compiled while this step ran: its held first token now
            outputs.extend(self._admit_compiled(may_wait=False))
        if spec is not None:
            spec.step_done(spec_mode, self.num_generation_tokens_total - tokens_before,
                           time.perf_counter() - start, small)
        return outputs

    def _pipelined_step(self) -> list[RequestOutput]:
        """Pipeline stages: launch a batch of requests not in flight while a stage is free (its first stage runs here,
        the later stages in their processes), else complete the oldest batch in flight. Each batch holds at most its
        share of the unfinished sequences, so the stages work on different batches at once."""
        outputs: list[RequestOutput] = self._admit_compiled()
        if len(self._pipeline_steps) < self._pipeline_depth:
            busy = frozenset(id(item.group) for step in self._pipeline_steps for item in step.scheduled)
            sizes = [g.num_unfinished_seqs() for g in self._all_groups()]
            share = max(-(-sum(sizes) // self._pipeline_depth), max(sizes, default=1))  # (a whole group fits)
            sched = self.scheduler.schedule(max_num_seqs=share, busy=busy)
            if sched.is_empty() and not self._pipeline_steps:  # (e.g. a swapped group waiting for more room)
                sched = self.scheduler.schedule(busy=busy)
            outputs.extend(self._finish_ignored(g) for g in sched.ignored_groups)
            if not sched.is_empty():
                step = self._launch_forward(sched, None)
                self.scheduler.mark_computed(step.scheduled)
                self._pipeline_steps.append(step)
                if len(self._pipeline_steps) < self._pipeline_depth:
                    return outputs
        if self._pipeline_steps:
            step = self._pipeline_steps.popleft()
            if step.logits is PENDING_PIPELINE_LOGITS:
                step.logits = self.executor.receive_pipeline_logits()
            self._launch_sampling(step)
            outputs.extend(self._complete_step(step))
        if self._awaiting_grammar:
            outputs.extend(self._admit_compiled(may_wait=False))
        return outputs

    def _launch_forward(self, sched: SchedulerOutputs, prev: LaunchedStep | None,
                        drafts: dict[int, list[int]] | None = None) -> LaunchedStep:
        """Queue the model run for the scheduled chunks without waiting for the device (`_launch_sampling`
        queues their sampling).

        `drafts` (speculative decoding): seq_id → proposed tokens, verified after the step."""
        now = time.monotonic()
        drafts = drafts or {}
        # Query-length-1 chunks first (attention batches them as decodes), then the rest shortest first (the
        # CPU backend's native attention takes a leading run of chunks up to a length; see its docstring).
        if drafts:
            scheduled = sorted(sched.scheduled, key=lambda s: (s.num_new_tokens != 1 or s.seq.seq_id in drafts,
                                                               s.num_new_tokens + len(drafts.get(s.seq.seq_id, ()))))
        else:  # (num_new_tokens != 1, num_new_tokens) orders as num_new_tokens alone
            scheduled = sorted(sched.scheduled, key=_num_new_tokens)
        chunks: list[SequenceChunk] = []
        pending: list[tuple[int, int]] = []  # a token prev sampled that the host has not seen yet: the worker
        num_prompt_tokens = 0                # takes it from prev's output
        for i, item in enumerate(scheduled):
            group, seq = item.group, item.seq
            if group.first_scheduled_time is None:
                group.first_scheduled_time = now
            chunk = self._chunk(item, drafts.get(seq.seq_id) if drafts else None)
            chunks.append(chunk)
            if seq.num_pending_tokens and item.completes:
                pending.append((i, prev.row_of_seq[seq.seq_id]))
            n_prompt = len(seq.prompt_token_ids)
            start = chunk.start_pos
            if start < n_prompt:
                num_prompt_tokens += min(start + item.num_new_tokens, n_prompt) - start
        self.num_prompt_tokens_total += num_prompt_tokens
        stores, loads = self.scheduler.block_manager.take_offload_moves()
        if stores or loads:  # the KV offloading tier's copies; the worker runs swap-outs, then swap-ins
            sched.blocks_to_swap_out.extend(stores)
            sched.blocks_to_swap_in.extend(loads)
        req = ExecuteModelRequest(chunks, sched.blocks_to_swap_in, sched.blocks_to_swap_out, sched.blocks_to_copy)
        req.state_copies = self.scheduler.block_manager.take_state_copies()
        if pending:
            req.pending_inputs = pending
            req.prev_sampled_token_ids = prev.sampler_output.sampled_token_ids
        step = LaunchedStep(scheduled, chunks, None)
        # Constrained rows: a bitmask row each, filled on the manager's thread while the model runs. Rows
        # whose matcher still lacks prev's token are filled once prev has completed (see `step`).
        row = 0
        for item, chunk in zip(scheduled, chunks):
            if chunk.sample and item.group.may_sample:
                if "structured_output" in item.group.extra:
                    step.mask_rows.append(row)
                    step.mask_seqs.append((item.seq, item.group.extra["structured_output"]))
                    step.mask_waits_for_prev |= item.seq.num_pending_tokens > 0
                row += 1
        step.num_sample_rows = row
        if step.mask_seqs and not step.mask_waits_for_prev:
            # On CPU the forward pass already uses every core: a concurrent fill only contends with it.
            self._start_mask_fill(step, overlap=self.executor.device.type != "cpu")
        step.logits = self.executor.execute_model(req)
        if drafts:
            step.spec_drafts = drafts
            step.needs_host_results = True
        return step

    def _mask_then_sample(self, step: LaunchedStep) -> None:
        self._start_mask_fill(step, overlap=self.executor.device.type != "cpu")
        if step.mask_job.done():  # filled here (cheap): queue the sampling now
            self._launch_sampling(step)

    def _start_mask_fill(self, step: LaunchedStep, overlap: bool) -> None:
        step.mask_job = self.structured_output.start_fill(step.mask_seqs, overlap, step.mask_rows,
                                                          step.num_sample_rows)

    def _chunk(self, item: ScheduledSequence, drafts: list[int] | None = None) -> SequenceChunk:
        seq = item.seq
        start = seq.num_computed_tokens
        token_ids = seq.tokens_slice(start, start + item.num_new_tokens)
        num_known = len(token_ids)
        if num_known < item.num_new_tokens:  # ends with a token still on the device
            token_ids.append(0)
        bm = self.scheduler.block_manager
        # The block manager's own lists, not copies: the worker reads them when the step launches, before anything
        # schedules again (SequenceChunk.block_table).
        tables = bm.get_block_tables(seq)
        group_tables = tables[1:] or None
        version = bm.table_version(seq)
        if drafts:  # verification: the last token and the drafts, a logits row for each
            return SequenceChunk(seq.seq_id, token_ids + list(drafts), start, tables[0], sample=False,
                                 all_logits=True, group_block_tables=group_tables, table_version=version)
        pooling = item.group.extra.get("pooling")
        if pooling is not None:
            wants_prompt_logprobs = pooling.wants_every_row
        else:
            # (an embeds prompt has no prompt token ids to score: no prompt logprobs, as vLLM)
            wants_prompt_logprobs = (
                item.group.sampling_params.prompt_logprobs is not None and start < len(seq.prompt_token_ids)
                and "prompt_embeds" not in item.group.extra
            )
        mm = item.group.extra.get("mm_features")
        embeds = item.group.extra.get("prompt_embeds")
        return SequenceChunk(
            seq_id=seq.seq_id,
            token_ids=token_ids,
            start_pos=start,
            block_table=tables[0],
            sample=item.completes,
            all_logits=wants_prompt_logprobs,
            lora_id=item.group.lora_int_id,
            mm_features=features_in_range(mm, start, start + len(token_ids)) or None if mm else None,
            # the rows of the chunk's leading prompt positions (all its positions from `start` on that the
            # prompt holds: a recompute after preemption runs them again)
            prompt_embeds=embeds[start:start + len(token_ids)] if embeds is not None and start < len(embeds)
            else None,
            token_type_start=item.group.extra.get("token_type_start"),
            group_block_tables=group_tables,
            table_version=version,
            state_slot=bm.state_slot(seq),
            state_snapshots=bm.plan_state_snapshots(seq, item.num_new_tokens, num_known),
        )

    def _launch_sampling(self, step: LaunchedStep) -> None:
        """Queue sampling of the step's logits (grammar masks applied first), without waiting for the device."""
        step.sampling_launched = True
        scheduled, chunks, logits = step.scheduled, step.chunks, step.logits
        if step.mask_seqs and step.mask_job is None:  # deferred until prev completed: the host waits for it now
            self._start_mask_fill(step, overlap=False)
        layout = logits_row_layout(chunks)
        rows: list[SamplingRow] = []
        row_idx: list[int] = []
        from_history: dict[int, bool] = {}  # per distinct SamplingParams: does sampling read the host's history?
        for item, chunk, (lo, hi) in zip(scheduled, chunks, layout):
            if not chunk.sample:
                continue
            group, seq = item.group, item.seq
            if "pooling" in group.extra:  # its rows are pooled when the step completes
                continue
            if not group.may_sample:  # its first sample waits for the grammar: keep the row (a copy)
                group.extra["held_logits"] = logits[hi - 1].clone()
                continue
            params = group.sampling_params
            row = self._sampling_row(group, seq)
            num_samples = row.num_samples
            rows.append(row)
            step.row_of_seq[seq.seq_id] = len(row_idx)
            row_idx.append(hi - 1)
            step.owners.append(item)
            seq.num_pending_tokens += 1
            history = from_history.get(id(params))
            if history is None:
                history = from_history[id(params)] = _samples_from_history(params)
            step.needs_host_results |= num_samples > 1 or history or "beam" in group.extra
        if rows:
            if row_idx != list(range(logits.shape[0])):
                logits = logits[async_tensor_h2d(row_idx, torch.long, logits.device)]
            raw_logits = None
            if self.logits_processors is not None:
                raw_logits, logits = logits, self._custom_processed(logits, step.owners, rows)
                step.needs_host_results = True  # the processors read the outputs so far: the host's
            bitmask = None
            if step.mask_job is not None:
                bitmask = (self.structured_output.mask_result(step.mask_job), step.mask_rows)
            has_beam = any("beam" in item.group.extra for item in step.owners)
            step.sampler_output = self.sampler.launch(logits, rows, return_logprobs_tensor=has_beam,
                                                      token_bitmask=bitmask, raw_logits=raw_logits)

    def _complete_step(self, step: LaunchedStep, then: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Wait for a launched step, append its tokens (stop checks, forks, beams); → its outputs. `then` runs
        once the tokens are appended, before the outputs are built."""
        layout = logits_row_layout(step.chunks)
        touched: dict[str, SequenceGroup] = {}
        greedy = None
        if step.spec_drafts:  # plain greedy verification for the whole step: one device→host copy
            greedy = self.sampler.greedy_rows(step.logits)
        for item, chunk, (lo, hi) in zip(step.scheduled, step.chunks, layout):
            if item.seq.seq_id in step.spec_drafts:
                fast = (greedy[0][lo:hi], greedy[1][lo:hi]) if self.spec_decoder.plain_greedy(item) else None
                self._complete_spec(item, step.spec_drafts[item.seq.seq_id], step.logits[lo:hi], touched, fast)
            elif "pooling" in item.group.extra:
                if hi > lo:
                    self._pool(item, chunk, step.logits[lo:hi], touched)
            elif chunk.all_logits:
                self._record_prompt_logprobs(item, chunk, step.logits[lo:hi])
        if step.sampler_output is not None:
            samples, full_logprobs = step.sampler_output.result()
            self._append_samples(step.owners, samples, full_logprobs, touched)
        if then is not None:
            then()
        return self._outputs_of(touched)

    def _outputs_of(self, touched: dict[str, SequenceGroup]) -> list[RequestOutput]:
        """Outputs of the groups that progressed, once finished groups left the scheduler (FINAL_ONLY requests:
        only when finished)."""
        for group in self.scheduler.free_finished_seq_groups():
            touched[group.request_id] = group
        make = self.output_processor.make_output
        outputs = [make(g) for g in touched.values()
                   if g.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY or g.is_finished()]
        return [o for o in outputs if o is not None]  # a DELTA request with nothing new this step has none

    def _append_samples(self, owners, samples, full_logprobs, touched: dict[str, SequenceGroup]) -> None:
        now = time.monotonic()
        append = self.output_processor.append_token
        beams: dict[str, tuple[SequenceGroup, list[Sequence], list[int]]] = {}
        for row, (item, sample) in enumerate(zip(owners, samples)):
            group, seq = item.group, item.seq
            seq.num_pending_tokens -= 1
            if group.first_token_time is None:
                group.first_token_time = now
            if seq.is_finished():  # aborted, or stopped by the step before while this one ran
                continue
            if "beam" in group.extra:
                entry = beams.setdefault(group.request_id, (group, [], []))
                entry[1].append(seq)
                entry[2].append(row)
                continue
            touched[group.request_id] = group
            tops = sample.top_logprobs
            if len(sample.token_ids) == 1:  # the common case: one token for one sequence
                append(group, seq, sample.token_ids[0], sample.logprobs[0], tops[0] if tops else None)
                self.num_generation_tokens_total += 1
                continue
            # Fork children before the parent appends, so they start from the same state.
            children = [
                self.output_processor.fork(group, seq, lambda i, p=group.sampling_params: self._make_generator(p, i))
                for _ in sample.token_ids[1:]
            ]
            for target, tok, lp, top in zip([seq, *children], sample.token_ids, sample.logprobs,
                                            tops or [None] * len(sample.token_ids)):
                append(group, target, tok, lp, top)
                self.num_generation_tokens_total += 1
        for group, parents, beam_rows in beams.values():
            self.output_processor.beam_step(group, parents, full_logprobs[beam_rows])
            self.num_generation_tokens_total += len(parents)
            touched[group.request_id] = group

    def _complete_spec(self, item: ScheduledSequence, drafts: list[int], logits: torch.Tensor,
                       touched: dict[str, SequenceGroup], fast: tuple[list[int], list[float]] | None = None) -> None:
        """Verify one sequence's drafts, append the accepted ones and the target's token, roll back the rest."""
        group, seq = item.group, item.seq
        if group.first_token_time is None:
            group.first_token_time = time.monotonic()
        if seq.is_finished():  # aborted while the step ran: its blocks are already free
            return
        res = self.spec_decoder.verify_seq(item, drafts, logits, self.eos_token_ids, fast[0] if fast else None)
        num_kv_valid = seq.get_len()  # the last token's KV was written by this step
        k_top = group.sampling_params.logprobs
        raw_lp = None if fast else logits.float().log_softmax(dim=-1)
        for i, tok in enumerate(res.token_ids):
            top = None
            if fast:  # plain greedy: the emitted tokens are the rows' argmax, their logprobs came with it
                lp = fast[1][i]
            else:
                lp = float(raw_lp[i, tok])
                if k_top is not None:
                    v, ix = raw_lp[i].topk(min(k_top, raw_lp.shape[-1]))
                    top = position_logprobs(tok, lp, token_rank(raw_lp[i], tok), ix.tolist(), v.tolist())
            self.output_processor.append_token(group, seq, tok, lp, top)
            self.num_generation_tokens_total += 1
            if seq.is_finished():
                break
            if i < len(res.token_ids) - 1:
                num_kv_valid += 1  # an accepted draft: its KV is the target's
        self.spec_decoder.roll_back(item, num_kv_valid)
        touched[group.request_id] = group

    def _record_prompt_logprobs(self, item: ScheduledSequence, chunk: SequenceChunk, logits: torch.Tensor) -> None:
        group, seq = item.group, item.seq
        k = group.sampling_params.prompt_logprobs
        store = group.extra.setdefault("prompt_logprobs", [None] * len(seq.prompt_token_ids))
        start = chunk.start_pos
        n_prompt = len(seq.prompt_token_ids)
        # Row j predicts token at position start + j + 1.
        n = min(len(chunk.token_ids), n_prompt - 1 - start)
        if n <= 0:
            return
        targets = torch.tensor(seq.prompt_token_ids[start + 1 : start + 1 + n], device=logits.device)
        dicts = compute_prompt_logprobs(logits[:n], targets, k, self.sampler.logprobs_mode.endswith("logits"))
        for entries in dicts:
            self.output_processor.name_logprobs(group.sampling_params, entries)
        store[start + 1:start + 1 + n] = dicts

    def _pool(self, item: ScheduledSequence, chunk: SequenceChunk, hidden: torch.Tensor,
              touched: dict[str, SequenceGroup]) -> None:
        """A pooling request's rows of this step (every row for MEAN/CLS/ALL, else the last prompt row); its last
        chunk finishes it with the pooled vector (ALL: the prompt's rows)."""
        group, seq = item.group, item.seq
        if seq.is_finished():  # aborted while the step ran
            return
        state: PoolingState = group.extra["pooling"]
        if chunk.all_logits:
            state.add_rows(chunk.start_pos, hidden)
        if not chunk.sample:
            return
        state.finish(hidden[-1], len(seq.prompt_token_ids))
        if group.first_token_time is None:
            group.first_token_time = time.monotonic()
        seq.status = SequenceStatus.FINISHED_STOPPED
        self.scheduler.free_seq(seq)
        touched[group.request_id] = group

    def _finish_ignored(self, group: SequenceGroup) -> RequestOutput:
        logger.warning("request %s can never fit in the KV pool and was dropped", group.request_id)
        return self.output_processor.make_output(group)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block (vLLM's name): True once done; False, with a warning, while requests hold
        KV blocks (their full blocks stay cached). `reset_running_requests=True` (vLLM preempts the running requests
        first) is refused with a ValueError: abort them or let them finish."""
        if reset_running_requests:
            raise ValueError("reset_prefix_cache(reset_running_requests=True) is not supported: pagedllm resets the "
                             "prefix cache only while no request holds KV blocks; abort the running requests or "
                             "let them finish, then reset.")
        bm = self.scheduler.block_manager
        if bm.reset_prefix_cache():
            logger.info("Prefix cache reset.")
            return True
        logger.warning("Prefix cache not reset: %d KV blocks are in use by %d unfinished requests.",
                       bm.num_gpu_blocks - bm.get_num_free_gpu_blocks(), self.get_num_unfinished_requests())
        return False

    # -- sleep mode (engine/sleep_mode.py) and worker calls ----------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep: free the workers' memory until `wake_up`. Level 1 moves the weights to host memory and drops
        the KV cache; level 2 drops both. Requests in flight are aborted (mode "abort", vLLM's default); mode "wait"
        refuses while there are any (nothing steps this engine while sleep waits). The prefix cache is reset. Needs
        enable_sleep_mode=True; requests are refused (EngineSleepingError) until every part is awake."""
        if not self.engine_args.enable_sleep_mode:
            raise sleep_mode_disabled_error()
        check_sleep_args(level, mode)
        if self._sleep.is_sleeping:
            logger.warning("sleep: the engine is already asleep (level %d)", self._sleep.level)
            return
        ids = [g.request_id for g in self._all_groups()]
        if ids and mode == "wait":
            raise ValueError(f"sleep(mode='wait'): {len(ids)} request(s) in flight, and nothing steps this engine "
                             f"while sleep waits: step it until has_unfinished_requests() is False, or use "
                             f"mode='abort'.")
        if ids:
            logger.warning("sleep: aborting %d request(s) in flight", len(ids))
            self.abort_request(ids)
        while self._inflight is not None or self._pipeline_steps:  # launched steps of aborted requests
            self.step()
        if not self.reset_prefix_cache():  # the KV cache's contents are gone
            raise RuntimeError("sleep: KV blocks are still in use after every request was aborted")
        self.device_spec = None  # its graphs hold the KV pools' addresses (rebuilt by wake_up)
        self.executor.sleep(level)
        self._sleep.fall_asleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep` freed: tags "weights" and/or "kv_cache" (None: both). Requests run again once both
        are awake; waking the weights first lets new weights be loaded (collective_rpc) before the KV cache is back."""
        if not self._sleep.is_sleeping:
            check_wake_tags(tags)
            logger.warning("wake_up: the engine is not asleep")
            return
        wake = self._sleep.to_wake(tags)
        if wake:
            self.executor.wake_up(wake)
        self._sleep.woke(wake)
        spec = self.config.speculative_config
        if not self._sleep.is_sleeping and spec is not None and spec.method == "ngram_gpu":
            from pagedllm.engine.device_spec_loop import DeviceSpecLoop

            self.device_spec = DeviceSpecLoop(self)

    def is_sleeping(self) -> bool:
        """Whether any part (weights, KV cache) is asleep."""
        return self._sleep.is_sleeping

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's collective_rpc: run a Worker method (by name, or a callable taking the worker first) on every
        worker; their results in rank order (executor/rpc.py)."""
        return self.executor.collective_rpc(method, timeout, args, kwargs)

    # -- torch profiler (worker/profiler.py) --------------------------------------------------------------------
    def start_profile(self) -> None:
        """vLLM's: start torch.profiler on every worker (needs VLLM_TORCH_PROFILER_DIR, or profiler_config's
        torch_profiler_dir, at engine start). A second start while a profile runs is ignored with a warning."""
        if not self.profiler_config.enabled:
            raise profiler_disabled_error()
        if self._profiling:
            logger.warning("start_profile: the torch profiler is already running; ignored (stop_profile() writes "
                           "the traces)")
            return
        self.executor.start_profile(self.profiler_config)
        self._profiling = True
        logger.info("torch profiler started; stop_profile() writes the traces to %s",
                    self.profiler_config.torch_profiler_dir)

    def stop_profile(self) -> None:
        """Stop the profiler and write one trace per worker (``*.pt.trace.json.gz``) to the profiler directory."""
        if not self.profiler_config.enabled:
            raise profiler_disabled_error()
        if not self._profiling:
            raise ProfilerError("stop_profile: the torch profiler is not running; call start_profile() first.")
        self._profiling = False
        paths = self.executor.stop_profile()
        logger.info("torch profiler stopped; trace(s) written: %s",
                    ", ".join(p or f"(rank {rank}: not found)" for rank, p in enumerate(paths)))

    # -- observability ----------------------------------------------------------------------
    def kv_memory_breakdown(self) -> KVMemoryBreakdown:
        """Where the device KV pool's token slots go now (the paper's Fig. 2; see core/kv_accounting.py)."""
        s = self.scheduler
        return kv_memory_breakdown(
            s.block_manager,
            s.running,
            max_model_len=self.config.scheduler_config.max_model_len,
            head_of_line=s.waiting[0] if s.waiting else None,
        )

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        bm = s.block_manager
        bs = self.config.cache_config.block_size
        filled: dict[int, int] = {}
        groups = list(self._all_groups())
        for group in groups:
            for seq in group.unfinished_seqs():
                for table in bm.get_block_tables(seq):  # every KV cache group's
                    for i, block in enumerate(table):
                        if block == NULL_BLOCK:  # freed behind a sliding window
                            continue
                        n = max(0, min(bs, seq.num_computed_tokens - i * bs))
                        filled[block] = max(filled.get(block, 0), n)
        used = bm.num_gpu_blocks - bm.get_num_free_gpu_blocks()
        st = bm.stats
        return {
            "kv_blocks_total": bm.num_gpu_blocks,
            "kv_cache_dtype": self.config.cache_config.cache_dtype,
            "kv_blocks_free": bm.get_num_free_gpu_blocks(),
            "kv_slots_allocated": used * bs,
            "kv_slots_filled": sum(filled.values()),
            "kv_blocks_shared": bm.num_shared_blocks(),
            "kv_blocks_saved_by_sharing": bm.num_blocks_saved_by_sharing(),
            "num_preemptions": s.num_preemptions,
            "num_recompute_preemptions": s.num_recompute_preemptions,
            "num_swap_preemptions": s.num_swap_preemptions,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_swapped": len(s.swapped),
            "num_cpu_blocks_total": bm.num_cpu_blocks,
            "num_cpu_blocks_free": bm.get_num_free_cpu_blocks(),
            "num_cow_copies": st.num_cow_copies,
            "num_swap_outs": st.num_swap_outs,
            "num_swap_ins": st.num_swap_ins,
            "num_swapped_out_blocks": st.num_swapped_out_blocks,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
            **self._offload_stats(bm),
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
            **(self.spec_decoder.stats.as_dict() if self.spec_decoder is not None else {}),
            **({"spec_decode_num_device_steps": self.device_spec.num_steps,
                "spec_decode_num_device_entries": self.device_spec.num_entries}
               if self.device_spec is not None else {}),
            **{f"kv_frac_{k}": v for k, v in self.kv_memory_breakdown().fractions().items()},
        }

    @staticmethod
    def _offload_stats(bm) -> dict[str, int]:
        """The KV offloading tier's figures (none without a tier)."""
        tier = getattr(bm, "offload", None)
        if tier is None:
            return {}
        return {"kv_offload_blocks_total": tier.num_blocks, "kv_offload_blocks_cached": tier.pool.num_cached_blocks(),
                "kv_offload_stored_blocks": tier.stats.num_stored_blocks,
                "kv_offload_loaded_blocks": tier.stats.num_loaded_blocks,
                "kv_offload_hit_tokens": tier.stats.num_hit_tokens}


def _num_new_tokens(item: ScheduledSequence) -> int:
    return item.num_new_tokens


def _samples_from_history(params: SamplingParams) -> bool:
    """Whether sampling this request reads its generated tokens on the host (penalties, min_tokens, bad_words),
    so its next step cannot be launched before the host has them."""
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0 or params.min_tokens > 0 or bool(params.bad_words))
