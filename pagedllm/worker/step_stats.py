"""Per-step timing by step kind (decode-only / mixed / prefill-only) and path (graph / whole / piecewise / eager / direct).

Opt-in (``ModelRunner.enable_step_stats``): each step records two CUDA events around its forward and
logits (no host sync at record time); ``summary()`` synchronises once and reads them. The interval is
device-timeline time from the step's first kernel being queued to its last finishing, so idle gaps
between launches (host overhead) count, as they do for the user. On the CPU (synchronous) it is the
host's wall time of the same span. Each step also records its work (`StepWork`: tokens attended, logits
rows), from which benchmarks/cpu_flops.py counts its FLOPs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedllm.worker.model_input import SequenceChunk

STEP_KINDS = ("decode", "mixed", "prefill")
STEP_PATHS = ("graph", "whole", "piecewise", "eager", "direct")


def step_kind(chunks: list[SequenceChunk]) -> str:
    """'decode' (every chunk one token), 'prefill' (no leading one-token decode), else 'mixed'."""
    num_decodes = 0
    while num_decodes < len(chunks) and len(chunks[num_decodes].token_ids) == 1:
        num_decodes += 1
    if num_decodes == len(chunks):
        return "decode"
    return "prefill" if num_decodes == 0 else "mixed"


@dataclass(frozen=True)
class StepWork:
    """What a step computed beyond its token count: Σ over query tokens of the context each attends to
    (causal: a chunk of L tokens from position s attends L·s + L(L+1)/2), and the rows of logits."""

    attended: int
    logits_rows: int

    @classmethod
    def of(cls, chunks: list[SequenceChunk], logits_rows: int) -> StepWork:
        n = sum(len(c.token_ids) * c.start_pos + len(c.token_ids) * (len(c.token_ids) + 1) // 2 for c in chunks)
        return cls(n, logits_rows)


class WallClock:
    """A CPU step's host time stamp, with the CUDA event interface the records use; it also reads the
    process's CPU time, which excludes the time other processes had the cores (shared machines)."""

    __slots__ = ("cpu", "t")

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.cpu = time.process_time()

    def elapsed_time(self, end: WallClock) -> float:
        return (end.t - self.t) * 1e3

    def cpu_time(self, end: WallClock) -> float:
        """Seconds of CPU time, all threads, between the two stamps."""
        return end.cpu - self.cpu


@dataclass
class StepStats:
    records: list[tuple[str, str, int, object, object]] = field(default_factory=list)
    work: list[StepWork | None] = field(default_factory=list)  # one per record

    def start(self, device: torch.device):
        if device.type == "cpu":
            return WallClock()
        if device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, kind: str, path: str, num_tokens: int, start_event, work: StepWork | None = None) -> None:
        if start_event is None:
            return
        if isinstance(start_event, WallClock):
            end = WallClock()
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.records.append((kind, path, num_tokens, start_event, end))
        self.work.append(work)

    def clear(self) -> None:
        self.records.clear()
        self.work.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """{"kind/path": {count, mean_ms, total_s, mean_tokens}} over the recorded steps."""
        if self.records and not isinstance(self.records[0][3], WallClock):
            torch.cuda.synchronize()
        acc: dict[str, list[float]] = {}
        for kind, path, n, a, b in self.records:
            row = acc.setdefault(f"{kind}/{path}", [0, 0.0, 0])
            row[0] += 1
            row[1] += a.elapsed_time(b)
            row[2] += n
        return {k: {"count": c, "mean_ms": ms / c, "total_s": ms / 1e3, "mean_tokens": n / c}
                for k, (c, ms, n) in sorted(acc.items())}


def format_summary(summary: dict[str, dict[str, float]]) -> str:
    lines = [f"{'step kind/path':<20}{'count':>8}{'mean ms':>10}{'total s':>10}{'mean tok':>10}"]
    for k, v in summary.items():
        lines.append(f"{k:<20}{v['count']:>8}{v['mean_ms']:>10.2f}{v['total_s']:>10.2f}{v['mean_tokens']:>10.1f}")
    return "\n".join(lines)
