"""vLLM's in-memory metrics reader (``vllm/v1/metrics/reader.py``): what /metrics exports, as dataclasses.

`LLM.get_metrics()` returns these for the offline engine; they are read from the same
`EngineMetrics` registry the server's /metrics renders (engine/metrics.py), so names and labels match.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

#: The metric families read: vLLM's own and pagedllm's (both are in /metrics).
_PREFIXES = ("vllm:", "pagedllm:")


@dataclass
class Metric:
    """A metric's name and labels (one metric name may appear once per label set)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer count."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's vllm:spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each bucket's upper bound (its "le" label, "+Inf" last) to the
    cumulative count; `count` is the total count and `sum` the sum of the observed values."""

    count: int
    sum: float
    buckets: dict[str, int]


def _labels(sample_labels: dict[str, str], drop: str | None = None) -> dict[str, str]:
    return {k: v for k, v in sample_labels.items() if k != drop}


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every gauge, counter and histogram of `registry` whose name starts with vllm: or pagedllm:."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(_PREFIXES):
            continue
        if family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples
                    if s.name == family.name]
        elif family.type == "counter":
            samples = [s for s in family.samples if s.name == family.name + "_total"]
            if family.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                out += _vectors(family.name, samples)
            else:
                out += [Counter(family.name, dict(s.labels), int(s.value)) for s in samples]
        elif family.type == "histogram":
            out += _histograms(family)
    return out


def _vectors(name: str, samples) -> list[Vector]:
    by_labels: dict[frozenset, dict[int, int]] = {}
    for s in samples:
        key = frozenset(_labels(s.labels, "position").items())
        by_labels.setdefault(key, {})[int(s.labels["position"])] = int(s.value)
    return [Vector(name, dict(key), [values.get(i, 0) for i in range(max(values) + 1)])
            for key, values in by_labels.items()]


def _histograms(family) -> list[Histogram]:
    buckets: dict[frozenset, dict[str, int]] = {}
    counts: dict[frozenset, int] = {}
    sums: dict[frozenset, float] = {}
    for s in family.samples:
        if s.name == family.name + "_bucket":
            buckets.setdefault(frozenset(_labels(s.labels, "le").items()), {})[s.labels["le"]] = int(s.value)
        elif s.name == family.name + "_count":
            counts[frozenset(s.labels.items())] = int(s.value)
        elif s.name == family.name + "_sum":
            sums[frozenset(s.labels.items())] = float(s.value)
    return [Histogram(family.name, dict(key), counts.get(key, 0), sums.get(key, 0.0), b) for key, b in buckets.items()]
