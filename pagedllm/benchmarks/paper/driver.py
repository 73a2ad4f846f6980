"""Open-loop trace driver over one LLMEngine, in one process.

Each request is added once its arrival time has passed; the engine is stepped; per request the
arrival, first-token and finish times and the output length are recorded, and per step the number
of batched (running) requests, the waiting queue and the KV memory breakdown.

Clock: an event-driven clock, not a sleep. Time advances by each step's measured duration; when
the engine is idle the clock jumps to the next arrival instead of sleeping. Latencies are the same
as a real-time open-loop client would see (the engine does nothing while idle), but an idle gap
costs no benchmark time. A step's duration is its wall time on a GPU, and on a CPU the CPU time of
this process (`time.process_time`; the figures run one torch thread): on a shared machine, time the
process spends descheduled while other jobs run is not the engine's, and would otherwise land on
whichever system happened to run then (measured: a concurrent job made every latency ~2.5x larger).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.benchmarks.paper.workloads import TraceRequest

logger = logging.getLogger("pagedllm.bench.paper")
BREAKDOWN_KEYS = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")


@dataclass
class RequestRecord:
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    output_len: int = 0


@dataclass
class StepRecord:
    time: float
    num_running: int
    num_waiting: int
    breakdown: dict[str, float] | None  # fractions of the pool


@dataclass
class TraceResult:
    requests: dict[str, RequestRecord]
    steps: list[StepRecord] = field(default_factory=list)
    completed: bool = True  # False: stopped at the wall-time limit (overloaded)
    wall_s: float = 0.0
    num_preemptions: int = 0

    @property
    def normalized_latency(self) -> float:
        """The paper's metric: mean over requests of end-to-end latency ÷ output length (s/token)."""
        done = [r for r in self.requests.values() if r.finish is not None and r.output_len]
        if not self.completed or not done:
            return math.inf
        return sum((r.finish - r.arrival) / r.output_len for r in done) / len(done)

    @property
    def mean_batched_requests(self) -> float:
        busy = [s.num_running for s in self.steps if s.num_running]
        return sum(busy) / len(busy) if busy else 0.0

    @property
    def duration(self) -> float:
        return self.steps[-1].time if self.steps else 0.0

    def output_tokens_per_s(self) -> float:
        return sum(r.output_len for r in self.requests.values()) / self.duration if self.duration else 0.0

    def mean_breakdown(self, only_when_waiting: bool = True) -> dict[str, float]:
        """Time-weighted mean KV breakdown over the steps where a request waits (memory binds)."""
        sel = [(i, s) for i, s in enumerate(self.steps) if s.breakdown and (s.num_waiting or not only_when_waiting)]
        tot = {k: 0.0 for k in BREAKDOWN_KEYS}
        weight = 0.0
        for i, s in sel:
            dt = s.time - (self.steps[i - 1].time if i else 0.0)
            weight += dt
            for k in BREAKDOWN_KEYS:
                tot[k] += dt * s.breakdown.get(k, 0.0)
        return {k: v / weight for k, v in tot.items()} if weight else {}


def kv_breakdown(engine) -> dict[str, float] | None:
    """The engine's KV breakdown as fractions of the pool (None if the engine has no breakdown)."""
    fn = getattr(engine, "kv_memory_breakdown", None)
    if fn is None:
        return None
    b = fn()
    b = b if isinstance(b, dict) else vars(b)
    total = b.get("total") or 1
    scale = 1.0 / total if total > 1 else 1.0
    return {k: float(b.get(k, 0)) * scale for k in BREAKDOWN_KEYS}


def run_trace(engine, trace: list[TraceRequest], make_params: Callable[[TraceRequest], object],
              max_wall_s: float = math.inf, record_breakdown: bool = True,
              give_up_above: float = math.inf, breakdown_at: str = "step_end") -> TraceResult:
    """Replay `trace` (sorted by arrival) open-loop on `engine`; returns per-request and per-step records.

    `give_up_above`: stop (not completed) once a lower bound of the trace's normalized latency exceeds it:
    finished requests count exactly, unfinished ones as (now − arrival) ÷ true output length, which their
    final value can only exceed, and requests not yet arrived as 0. The point is then past the sustained
    threshold whatever happens next, so running it to the end would only spend time.
    `breakdown_at`: "step_end" reads the KV breakdown after each step (after finished requests freed their
    memory, before the next step admits anyone); "schedule" reads it right after each scheduling decision,
    with the tokens of the step being launched counted as computed: the memory that step computes with.
    """
    trace = sorted(trace, key=lambda r: r.arrival)
    res = TraceResult({r.request_id: RequestRecord(r.arrival) for r in trace})
    pre0 = engine.stats()["num_preemptions"]
    at_schedule: list[tuple[int, dict[str, float] | None]] = []  # (num_waiting after the decision, breakdown)
    restore = _sample_at_schedule(engine, at_schedule) if record_breakdown and breakdown_at == "schedule" else None
    clock, i, n = 0.0, 0, len(trace)
    step_timer = time.process_time if str(getattr(engine.executor, "device", "")) == "cpu" else time.perf_counter
    t_start = time.perf_counter()
    while i < n or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and trace[i].arrival > clock:
            clock = trace[i].arrival  # idle: jump to the next arrival
        while i < n and trace[i].arrival <= clock:
            r = trace[i]
            engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, make_params(r))
            i += 1
        t0 = step_timer()
        outs = engine.step()
        clock += step_timer() - t0
        st = engine.stats()
        if restore is not None and at_schedule:
            waiting, b = at_schedule.pop()
            at_schedule.clear()
            res.steps.append(StepRecord(clock, st["num_running"], waiting, b))
        else:
            res.steps.append(StepRecord(clock, st["num_running"], st["num_waiting"] + st.get("num_swapped", 0),
                                        kv_breakdown(engine) if record_breakdown and restore is None else None))
        for o in outs:
            rec = res.requests[o.request_id]
            n_out = max((len(c.token_ids) for c in o.outputs), default=0)
            if rec.first_token is None and n_out:
                rec.first_token = clock
            if o.finished:
                rec.finish, rec.output_len = clock, n_out
        over = math.isfinite(give_up_above) and len(res.steps) % 16 == 0 and \
            _latency_lower_bound(res, trace[:i], clock) > give_up_above
        if over or time.perf_counter() - t_start > max_wall_s:
            logger.warning("stopping a trace %s: %d of %d requests unfinished",
                           f"whose normalized latency is already > {give_up_above:.3g} s/token" if over else
                           f"at the {max_wall_s:.0f} s wall limit",
                           sum(r.finish is None for r in res.requests.values()), n)
            engine.abort_request([r for r, rec in res.requests.items() if rec.finish is None])
            for _ in range(1000):  # an aborted engine drains in a step or two; say so if it does not
                if not engine.has_unfinished_requests():
                    break
                engine.step()
            else:
                raise RuntimeError(f"the engine still has unfinished requests 1000 steps after aborting them all: "
                                   f"{engine.stats()['num_running']} running, {engine.stats()['num_waiting']} waiting")
            res.completed = False
            break
    if restore is not None:
        restore()
    res.wall_s = time.perf_counter() - t_start
    res.num_preemptions = engine.stats()["num_preemptions"] - pre0
    return res


def _latency_lower_bound(res: TraceResult, arrived: list[TraceRequest], clock: float) -> float:
    """A lower bound of the final normalized latency (see run_trace's `give_up_above`)."""
    tot = 0.0
    for r in arrived:
        rec = res.requests[r.request_id]
        end = rec.finish if rec.finish is not None else clock
        tot += (end - rec.arrival) / max(1, rec.output_len if rec.finish is not None else r.output_len)
    return tot / len(res.requests)


def _sample_at_schedule(engine, sink: list) -> Callable[[], None]:
    """Wrap the engine's scheduler so every decision appends (requests still waiting, KV breakdown with the
    launched step's tokens counted as computed) to `sink`; returns the function that unwraps it."""
    sched = engine.scheduler
    orig = sched.schedule

    def schedule():
        out = orig()
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        try:
            sink.append((len(sched.waiting) + len(sched.swapped), kv_breakdown(engine)))
        finally:
            for item in out.scheduled:
                item.seq.num_computed_tokens -= item.num_new_tokens
        return out

    sched.schedule = schedule
    return lambda: delattr(sched, "schedule")
