"""The offline API: `LLM(...).generate(prompts, sampling_params)`, `LLM.chat(...)`, and for pooling models
`LLM.embed(prompts)`, `LLM.classify(prompts)` and `LLM.score(data_1, data_2)`."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Sequence as Seq

from tqdm.auto import tqdm

from pagedllm.chat_content_format import check_content_format_option
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.gc_heap import fewer_young_collections
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.chat import needs_multimodal_render, render_multimodal_chat
from pagedllm.multimodal.media import MediaLimits, load_image_url, resolve_local_media_dir
from pagedllm.multimodal.processor import text_only_error
from pagedllm.entrypoints.score_utils import as_texts, cosine_score, score_pairs, score_prompt
from pagedllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.tokenizer import apply_chat_template

if TYPE_CHECKING:
    import torch

    from pagedllm.engine.metrics_reader import Metric


class LLM:
    """An LLM for offline batched generation, with vLLM's names and semantics.

    `LLM()` serves the bundled default model; every `EngineArgs` field is a keyword argument
    (`model`, `dtype`, `device`, `block_size`, `max_model_len`, `num_gpu_blocks_override`, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        if self.engine_args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={self.engine_args.data_parallel_size!r}: the offline LLM runs one "
                             "engine; allowed: 1. Data parallelism is `pagedllm serve --data-parallel-size N`.")
        # Checked before the model loads: a wrong directory fails at once, as `serve` fails at start-up.
        self._media_limits = MediaLimits(allowed_local_media_path=resolve_local_media_dir(
            self.engine_args.allowed_local_media_path, "allowed_local_media_path"))
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, usage_context="llm_class")
        self._request_counter = itertools.count()
        self._num_steps = 0
        self._metrics = _offline_metrics(self)  # what get_metrics() reads (None without prometheus_client)
        # The engine froze its start-up heap (engine/gc_heap.py). The engine sits in reference cycles, so
        # without this `del llm; gc.collect()` would no longer free its weights and KV pool.
        weakref.finalize(self, gc.unfreeze)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order. `priority`: one int per
        prompt, lower served first (needs ``scheduling_policy="priority"``). `lora_request`: the LoRA adapter
        for every prompt, or one (or None) per prompt (needs ``enable_lora=True``)."""
        if self.llm_engine.runner == "pooling":
            raise ValueError("LLM.generate() needs a generating model, and this LLM runs the pooling runner: call "
                             "LLM.embed() (or LLM.encode()) for an embedding model's vectors, LLM.classify() for a "
                             "classifier's probabilities, LLM.score() for pair scores, or build the LLM without "
                             "runner='pooling'.")
        prompt_list = self._as_prompt_list(prompts)
        params_list = _final_only(self._as_params_list(sampling_params, len(prompt_list)))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} values for {len(prompt_list)} prompts: "
                             f"give one per prompt.")
        loras = self._as_lora_list(lora_request, len(prompt_list))
        with fewer_young_collections():  # engine/gc_heap.py
            ids = self._add_all(prompt_list, params_list, priority, loras)
            return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        `continue_final_message` (with add_generation_prompt=False) continues the last message instead of
        opening a new turn; `chat_template_kwargs` are extra template variables; `tools` (OpenAI's function
        tools) go to the template as its `tools`; `chat_template_content_format` ("auto", "string" or "openai")
        is how message content reaches the template (all as in vLLM). A multimodal model's messages may hold image
        parts: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..." or "https://..."}}`` (or
        ``"file:///abs/path"`` under the LLM's ``allowed_local_media_path``) or
        ``{"type": "image_pil", "image_pil": PIL.Image}``."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists).")
        conversations = messages if isinstance(messages[0], list) else [messages]
        check_content_format_option(chat_template_content_format)
        tok = self._require_tokenizer()
        prompts = [
            self._image_chat_prompt(conv, add_generation_prompt, chat_template, tools, continue_final_message,
                                    chat_template_kwargs, chat_template_content_format)
            if needs_multimodal_render(conv, self.llm_engine.mm_processor is not None) else
            {"prompt_token_ids": apply_chat_template(tok, conv, add_generation_prompt, chat_template, tools,
                                                     continue_final_message, chat_template_kwargs,
                                                     chat_template_content_format)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _image_chat_prompt(self, conv: list[dict], add_generation_prompt: bool, chat_template: str | None,
                           tools: list[dict] | None, continue_final_message: bool,
                           chat_template_kwargs: dict[str, Any] | None, content_format: str = "auto") -> dict:
        """A conversation with image parts → a processed multimodal prompt (URLs loaded here)."""
        processor = self.llm_engine.mm_processor
        if processor is None:
            raise text_only_error(self.llm_engine.hf_config)
        text, refs = render_multimodal_chat(self.get_tokenizer(), conv, processor.image_token,
                                            chat_template or processor.chat_template, add_generation_prompt, tools,
                                            continue_final_message, chat_template_kwargs, content_format)
        images = [ref.image if ref.image is not None else load_image_url(ref.url, self._media_limits) for ref in refs]
        return processor.process({"prompt": text, "multi_modal_data": {"image": images}}, add_special_tokens=False)

    def encode(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        pooling_task: str = "encode",
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt's hidden states into one vector (a pooling model: ``runner="pooling"``); outputs come
        back in input order, each with ``.outputs.data`` (a float32 tensor). `pooling_task`: vLLM's task of the
        call ("encode": what the model returns by default, "embed", "classify", "score", or the per-token
        "token_embed" / "token_classify", whose data is [num_prompt_tokens, dim]), set on every PoolingParams that
        names none."""
        if self.llm_engine.runner != "pooling":
            raise ValueError(f"LLM.{pooling_task}() needs a pooling model, and this LLM generates text: build it "
                             f"with runner='pooling' (LLM(model, runner='pooling')).")
        self.llm_engine.request_checker.check_pooling_task(pooling_task)
        prompt_list = self._as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} PoolingParams for {len(prompt_list)} prompts; give one, "
                                 f"or one per prompt.")
        params_list = [_with_task(p, pooling_task) for p in params_list]
        if truncate_prompt_tokens is not None:
            params_list = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        with fewer_young_collections():
            ids = self._add_all(prompt_list, params_list)
            return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``): ``outputs[i].outputs.embedding`` is a list of floats."""
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (vLLM's ``LLM.classify``; a *ForSequenceClassification model):
        ``outputs[i].outputs.probs`` is a list of floats, one per label (softmax; sigmoid for a single label)."""
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(
        self,
        prompts: PromptType | Seq[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.reward``: ``encode(prompts, pooling_task="token_classify")``, a token classifier's (or a
        reward model's) class probabilities for every prompt token: ``outputs[i].outputs.data`` is a float32
        tensor [num_prompt_tokens, num_labels] (Qwen2ForRewardModel: raw rewards; a STEP-pooling model such as
        Qwen2ForProcessRewardModel: one row per step-tag token, in its returned_token_ids columns)."""
        return self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task="token_classify")

    def score(
        self,
        data_1: str | Seq[str],
        data_2: str | Seq[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one score per pair of texts, 1→N (`data_1` one text, scored against each of
        `data_2`) or N→N (element by element). A cross-encoder (a classifier with one label) reads each pair as
        one prompt (entrypoints/score_utils.py) and scores it with the sigmoid of its logit; an embedding model
        embeds every text and scores the cosine similarity of the two embeddings."""
        if self.llm_engine.runner != "pooling":
            raise ValueError("LLM.score() needs a pooling model (a cross-encoder, or an embedding model), and this "
                             "LLM generates text: build it with runner='pooling' (LLM(model, runner='pooling')).")
        texts_1, texts_2 = as_texts(data_1, "data_1"), as_texts(data_2, "data_2")
        pairs = score_pairs(len(texts_1), len(texts_2))
        self.llm_engine.request_checker.check_pooling_task("score")
        if self.llm_engine.request_checker.pooling_task == "embed":
            outs = self.encode(texts_1 + texts_2, pooling_params, use_tqdm, truncate_prompt_tokens,
                               pooling_task="embed")
            return [_cosine_output(outs[i], outs[len(texts_1) + j]) for i, j in pairs]
        tok = self._require_tokenizer("LLM.score() tokenizes each text pair")
        prompts = [score_prompt(tok, texts_1[i], texts_2[j]) for i, j in pairs]
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task="score")
        return [ScoringRequestOutput.from_base(o) for o in outs]

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, use_tqdm: bool = False):
        """Beam search for every prompt (inside the engine); returns a BeamSearchOutput per prompt."""
        from pagedllm.engine.beam_search import to_beam_search_output, to_sampling_params

        outs = self.generate(prompts, to_sampling_params(params), use_tqdm=use_tqdm)
        return [to_beam_search_output(o, params.length_penalty) for o in outs]

    def stats(self) -> dict[str, Any]:
        """KV pool and scheduler counters (see LLMEngine.stats)."""
        return self.llm_engine.stats()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prompt prefix (e.g. between benchmark runs); see ``LLMEngine.reset_prefix_cache``."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep mode (needs ``enable_sleep_mode=True``): free the engine's memory until `wake_up`. Level 1
        moves the weights to host memory (on a GPU; a CPU engine's already are) and drops the KV cache; level 2 drops
        both (wake_up reloads the weights from the checkpoint, or load new ones through `collective_rpc`). The
        prefix cache is reset; requests in flight (none between two generate() calls) are aborted, or with
        mode="wait" refused. generate() raises EngineSleepingError until the engine is awake."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep` freed: ``tags`` "weights" and/or "kv_cache" (None: both), e.g. the weights first,
        new weights loaded, then the KV cache."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a method on every worker and return their results in rank order (vLLM's): a ``Worker`` method by
        name (``"load_weights"``, ...), or a callable taking the worker as its first argument. A callable reaches
        tensor-parallel worker processes through cloudpickle; its result must pickle."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """Run ``func(model)`` on the model (the ``torch.nn.Module``) of every worker and return the results in
        rank order, one per worker (vLLM's; built on `collective_rpc`). With tensor-parallel worker processes
        (``distributed_executor_backend="mp"``) `func` travels through cloudpickle (a lambda or closure too; what
        it captures must pickle) and so must its result: return small values, tensors moved to the CPU."""
        if not callable(func):
            raise ValueError(f"apply_model: func must be a callable taking the model, got {type(func).__name__}.")
        return self.collective_rpc(_ModelCall(func))

    def start_profile(self) -> None:
        """vLLM's torch profiler: record the engine's workers (every tensor-parallel rank) from now until
        `stop_profile`. Needs ``VLLM_TORCH_PROFILER_DIR`` set before the LLM is built (or
        ``profiler_config={"torch_profiler_dir": DIR}``); a second start while one runs is ignored with a warning."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop the profiler: each worker writes its ``*.pt.trace.json.gz`` (Perfetto / chrome://tracing) to the
        profiler directory; the top ops are logged."""
        self.llm_engine.stop_profile()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's metrics as vLLM's ``LLM.get_metrics()`` returns them: ``Counter``, ``Gauge``,
        ``Histogram`` (and ``Vector``) objects of ``pagedllm.engine.metrics_reader``, named as the server's /metrics
        names them (``vllm:prompt_tokens``, ``vllm:time_to_first_token_seconds``, ...)."""
        if self._metrics is None:
            raise ImportError("LLM.get_metrics() needs prometheus_client: pip install prometheus_client (it is in "
                              "pagedllm's `server` extra).")
        from pagedllm.engine.metrics_reader import get_metrics_snapshot

        return get_metrics_snapshot(self._metrics.registry)

    # -- internals --------------------------------------------------------------------------
    def _require_tokenizer(self, purpose: str = "chat needs a tokenizer"):
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError(f"this LLM was built with skip_tokenizer_init=True; {purpose}.")
        return tok

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("prompts is empty: give at least one prompt.")
            if all(isinstance(p, int) for p in prompts):
                return [list(prompts)]  # a single token-id prompt
            return list(prompts)
        raise TypeError(f"prompts must be a str, dict, or a list of them, got {type(prompts).__name__}")

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a call that gives none: the model's generation config's defaults (vLLM's
        --generation-config auto), else SamplingParams()."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def _as_params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt.")
        return params

    @staticmethod
    def _as_lora_list(lora_request: Any, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts; give one, or one per prompt.")
        return loras

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams] | list[PoolingParams],
                 priority: list[int] | None = None, loras: list[LoRARequest | None] | None = None) -> list[str]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._request_counter))
                engine.add_request(rid, prompt, p, priority=0 if priority is None else priority[i],
                                   lora_request=None if loras is None else loras[i])
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # nothing half-submitted stays behind
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, Any] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        t0, out_tokens = time.perf_counter(), 0
        try:
            while pending and engine.has_unfinished_requests():
                outputs = engine.step()
                self._num_steps += 1
                if self._metrics is not None and outputs:
                    self._metrics.on_outputs(outputs, time.monotonic())
                for out in outputs:
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        elapsed = max(time.perf_counter() - t0, 1e-9)
                        if isinstance(out, RequestOutput):
                            out_tokens += sum(len(o.token_ids) for o in out.outputs)
                            bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} toks/s", refresh=False)
                        else:  # pooling: prompt tokens are the work
                            out_tokens += len(out.prompt_token_ids)
                            bar.set_postfix_str(f"input: {out_tokens / elapsed:.1f} toks/s", refresh=False)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _offline_metrics(llm: LLM):
    """The offline engine's `EngineMetrics` (engine/metrics.py, as /metrics has them): counters and gauges read from
    `LLMEngine.stats()` when read, latency histograms observed as generate() returns outputs. None without
    prometheus_client (an optional dependency)."""
    try:
        from pagedllm.engine.metrics import EngineMetrics
    except ImportError:
        return None
    from pagedllm.entrypoints.openai.cli_serve import _default_name  # the server's model_name label

    engine = llm.llm_engine
    ref = weakref.ref(llm)  # the registry must not keep the LLM alive

    def snapshot() -> dict[str, Any]:
        owner = ref()
        return {**engine.stats(), "num_steps": owner._num_steps if owner is not None else 0, "healthy": True}

    return EngineMetrics(_default_name(engine.engine_args.model), snapshot)


@dataclasses.dataclass(frozen=True)
class _ModelCall:
    """`apply_model`'s collective_rpc callable: `func` on a worker's model. A module-level class pickles by
    reference, so only `func` crosses to worker processes by value."""

    func: Callable[[Any], Any]

    def __call__(self, worker: Any) -> Any:
        if worker.model is None:
            raise RuntimeError("apply_model: this worker holds no model (it sleeps at level 2); call wake_up() "
                               "first.")
        return self.func(worker.model)


def _with_task(params: PoolingParams, task: str) -> PoolingParams:
    """`params` for a call of pooling task `task` (a copy naming it; ValueError if it names another)."""
    if params.task is None:
        return dataclasses.replace(params, task=task)
    if params.task != task and task != "encode":
        raise ValueError(f"PoolingParams(task={params.task!r}) was passed to LLM.{task}(): leave task unset, or "
                         f"call the method of that task.")
    return params


def _cosine_output(a: PoolingRequestOutput, b: PoolingRequestOutput) -> ScoringRequestOutput:
    """An embedding model's score of a pair: the cosine similarity of its two embeddings."""
    score = ScoringOutput(cosine_score(a.outputs.data, b.outputs.data))
    return ScoringRequestOutput(f"{a.request_id}_{b.request_id}", score, a.prompt_token_ids + b.prompt_token_ids,
                                a.finished and b.finished)


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """Copies of `params` that ask for the final output only (`generate` returns nothing else, and the engine
    then builds no output for a request's unfinished steps); the caller's objects stay as they are."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for p in params:
        if isinstance(p, SamplingParams) and p.output_kind != RequestOutputKind.FINAL_ONLY:
            if id(p) not in copies:
                copies[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            p = copies[id(p)]
        out.append(p)
    return out
