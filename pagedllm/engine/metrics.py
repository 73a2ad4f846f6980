"""Prometheus metrics with vLLM's names, plus pagedllm's own KV-cache gauges.

Gauges and counters are read from the engine thread's stats snapshot at scrape time (a custom
collector), so scraping never touches the engine. Latency histograms are observed on the engine
thread as outputs come out of `step()` (prometheus_client objects are thread-safe). Each
`EngineMetrics` owns its own `CollectorRegistry`: no process-wide state.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedllm.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
#: Token counts per request: 1, 2, 5, 10, 20, 50, ... (vLLM's build_1_2_5_buckets), up to 10^7.
_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5)) + (1e7,)
#: vLLM's phases of a finished request (arrival, first scheduled, first token, finished): histogram name, help,
#: start and end of the span. A phase whose start was never stamped (aborted before it) is not observed.
_PHASES = (
    ("vllm:request_queue_time_seconds", "Time a request waited before it was first scheduled.",
     "arrival_time", "first_scheduled_time"),
    ("vllm:request_prefill_time_seconds", "Time from a request's first scheduling to its first token.",
     "first_scheduled_time", "first_token_time"),
    ("vllm:request_decode_time_seconds", "Time from a request's first token to its last.",
     "first_token_time", "finished"),
    ("vllm:request_inference_time_seconds", "Time from a request's first scheduling to its last token.",
     "first_scheduled_time", "finished"),
)

# (metric name, help, stats key) — read from the engine-thread snapshot.
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("vllm:num_requests_running", "Requests in the running set.", "num_running"),
    ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("vllm:num_requests_swapped", "Requests swapped out to the CPU pool.", "num_swapped"),
    ("pagedllm:kv_blocks_total", "Physical KV blocks in the device pool.", "kv_blocks_total"),
    ("pagedllm:kv_blocks_free", "Free physical KV blocks in the device pool.", "kv_blocks_free"),
    ("pagedllm:kv_slots_allocated", "Token slots in allocated KV blocks.", "kv_slots_allocated"),
    ("pagedllm:kv_slots_filled", "Allocated KV token slots that hold a real token.", "kv_slots_filled"),
    ("pagedllm:kv_blocks_shared", "Physical KV blocks referenced by more than one sequence.", "kv_blocks_shared"),
    ("pagedllm:kv_blocks_saved_by_sharing",
     "Blocks that sharing (parallel sampling, prefixes) saves versus one copy per sequence.",
     "kv_blocks_saved_by_sharing"),
    ("pagedllm:cpu_blocks_free", "Free blocks in the CPU swap pool.", "num_cpu_blocks_free"),
)

_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("vllm:num_preemptions", "Cumulative preemptions.", "num_preemptions"),
    ("vllm:prompt_tokens", "Prefill tokens processed.", "prompt_tokens_total"),
    ("vllm:generation_tokens", "Generated tokens.", "generation_tokens_total"),
    ("vllm:prefix_cache_queries", "Prefix cache lookups.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits.", "prefix_cache_hits"),
    ("pagedllm:cow_copies", "Copy-on-write block copies.", "num_cow_copies"),
    ("pagedllm:swap_outs", "Sequence groups swapped out.", "num_swap_outs"),
    ("pagedllm:swap_ins", "Sequence groups swapped in.", "num_swap_ins"),
    ("pagedllm:engine_steps", "Engine steps run.", "num_steps"),
    ("pagedllm:engine_step_faults", "Engine steps that raised.", "num_step_faults"),
)

_OFFLOAD_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("pagedllm:kv_offload_stored_blocks", "Evicted device blocks copied to the CPU tier.", "kv_offload_stored_blocks"),
    ("pagedllm:kv_offload_loaded_blocks", "CPU tier blocks copied back for a prefix hit.", "kv_offload_loaded_blocks"),
    ("pagedllm:kv_offload_hit_tokens", "Prompt tokens found in the CPU tier (also prefix cache hits).",
     "kv_offload_hit_tokens"),
)


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]], labels: dict[str, str]) -> None:
        self._snapshot = snapshot
        self._labels = labels

    def collect(self) -> Iterable:
        stats = self._snapshot() or {}
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            return g

        for name, doc, key in _GAUGES:
            yield gauge(name, doc, stats.get(key, 0))
        total = stats.get("kv_blocks_total", 0) or 0
        usage = 1.0 - stats.get("kv_blocks_free", 0) / total if total else 0.0
        yield gauge("vllm:gpu_cache_usage_perc", "Fraction of device KV blocks in use (1 = full).", usage)
        yield gauge("vllm:kv_cache_usage_perc", "Alias of vllm:gpu_cache_usage_perc.", usage)
        allocated = stats.get("kv_slots_allocated", 0)
        frac = stats.get("kv_slots_filled", 0) / allocated if allocated else 1.0
        yield gauge("pagedllm:kv_slot_utilization",
                    "Fraction of allocated KV token slots that hold real tokens (1 - internal fragmentation).",
                    frac)
        yield gauge("pagedllm:engine_healthy", "1 while the engine can serve.", 1.0 if stats.get("healthy") else 0.0)
        for name, doc, key in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(stats.get(key, 0)))
            yield c
        if "spec_decode_num_draft_tokens" in stats:  # speculative decoding is configured
            yield from _spec_decode_metrics(stats, names, values)
        if "kv_offload_blocks_total" in stats:  # the KV offloading tier is configured
            yield gauge("pagedllm:kv_offload_blocks_total", "Blocks of the CPU tier under the prefix cache.",
                        stats["kv_offload_blocks_total"])
            yield gauge("pagedllm:kv_offload_blocks_cached", "CPU tier blocks holding a cached block.",
                        stats.get("kv_offload_blocks_cached", 0))
            for name, doc, key in _OFFLOAD_COUNTERS:
                c = CounterMetricFamily(name, doc, labels=names)
                c.add_metric(values, float(stats.get(key, 0)))
                yield c


_SPEC_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("vllm:spec_decode_num_drafts", "Sequences that speculated, summed over steps.", "spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Proposed tokens.", "spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens the target accepted.", "spec_decode_num_accepted_tokens"),
)


def _spec_decode_metrics(stats: dict[str, Any], names: list[str], values: list[str]) -> Iterable:
    for name, doc, key in _SPEC_COUNTERS:
        c = CounterMetricFamily(name, doc, labels=names)
        c.add_metric(values, float(stats.get(key, 0)))
        yield c
    g = GaugeMetricFamily("vllm:spec_decode_draft_acceptance_rate", "Accepted / proposed tokens.", labels=names)
    g.add_metric(values, float(stats.get("spec_decode_acceptance_rate", 0.0)))
    yield g
    per_pos = GaugeMetricFamily("vllm:spec_decode_acceptance_rate_per_pos",
                                "Acceptance rate of the draft token at each position.", labels=[*names, "position"])
    pos = 0
    while f"spec_decode_acceptance_rate_pos_{pos}" in stats:
        per_pos.add_metric([*values, str(pos)], float(stats[f"spec_decode_acceptance_rate_pos_{pos}"]))
        pos += 1
    yield per_pos


class EngineMetrics:
    """Registry + engine-thread observer (`on_outputs`, `on_abort`) for an AsyncLLMEngine."""

    def __init__(self, model_name: str, snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model_name}
        self._snapshot = snapshot or (dict)
        self.registry.register(_SnapshotCollector(lambda: self._snapshot(), self._labels))
        names = list(self._labels)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", names,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(**self._labels)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", names,
                              buckets=_TPOT_BUCKETS, registry=self.registry).labels(**self._labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", names,
                             buckets=_TPOT_BUCKETS, registry=self.registry).labels(**self._labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", names,
                             buckets=_E2E_BUCKETS, registry=self.registry).labels(**self._labels)
        self.phases = [(Histogram(name, doc, names, buckets=_E2E_BUCKETS, registry=self.registry)
                         .labels(**self._labels), start, end) for name, doc, start, end in _PHASES]
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.", names,
                                       buckets=_TOKEN_BUCKETS, registry=self.registry).labels(**self._labels)
        self.generation_tokens = Histogram("vllm:request_generation_tokens",
                                           "Generated tokens per finished request (all its sequences).", names,
                                           buckets=_TOKEN_BUCKETS, registry=self.registry).labels(**self._labels)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               [*names, "finished_reason"], registry=self.registry)
        self.aborted = Counter("pagedllm:request_aborted", "Requests aborted (client gone, shutdown, fault).",
                               names, registry=self.registry).labels(**self._labels)
        # Engine-thread-only state: request id -> (time of its last token, tokens seen so far).
        self._progress: dict[str, tuple[float, int]] = {}

    def set_snapshot(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def leave_out(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        """From now on the counters leave out what the engine counted between two of its snapshots (the server's
        own warm-up request: not a client's)."""
        keys = [key for _, _, key in _COUNTERS + _SPEC_COUNTERS if key in after]
        offsets = {key: after[key] - before.get(key, 0) for key in keys}
        snapshot = self._snapshot

        def discounted() -> dict[str, Any]:
            stats = dict(snapshot() or {})
            for key, offset in offsets.items():
                if key in stats:
                    stats[key] -= offset
            return stats

        self._snapshot = discounted

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- engine-thread observer -------------------------------------------------------------
    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            # A pooling request (an embedding) generates nothing: it finishes with reason "stop" after its prompt.
            comps = out.outputs if isinstance(out, RequestOutput) else ()
            n_tokens = max((len(o.token_ids) for o in comps), default=0)
            prev = self._progress.get(out.request_id)
            arrival = out.metrics.get("arrival_time")
            if prev is None:
                if n_tokens > 0 and arrival is not None:
                    first = out.metrics.get("first_token_time") or now
                    self.ttft.observe(max(first - arrival, 0.0))
                    self._progress[out.request_id] = (now, n_tokens)
            elif n_tokens > prev[1]:
                self.itl.observe(max(now - prev[0], 0.0) / (n_tokens - prev[1]))
                self._progress[out.request_id] = (now, n_tokens)
            if out.finished:
                self._progress.pop(out.request_id, None)
                if arrival is not None:
                    self.e2e.observe(max(now - arrival, 0.0))
                first = out.metrics.get("first_token_time")
                if first is not None and n_tokens > 1:
                    self.tpot.observe(max(now - first, 0.0) / (n_tokens - 1))
                stamps = {**out.metrics, "finished": now}
                for hist, start, end in self.phases:
                    if stamps.get(start) is not None and stamps.get(end) is not None:
                        hist.observe(max(stamps[end] - stamps[start], 0.0))
                self.prompt_tokens.observe(len(out.prompt_token_ids or ()))
                self.generation_tokens.observe(sum(len(o.token_ids) for o in comps))
                reasons = [c.finish_reason or "unknown" for c in comps] if comps else ["stop"]
                for reason in reasons:
                    self.success.labels(**self._labels, finished_reason=reason).inc()

    def on_abort(self, request_id: str) -> None:
        self._progress.pop(request_id, None)
        self.aborted.inc()
