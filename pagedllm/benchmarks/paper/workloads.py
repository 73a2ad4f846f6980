"""ShareGPT-like and Alpaca-like request traces, synthesized from the paper's statistics.

The datasets cannot be downloaded here, so request lengths are drawn from clipped log-normal
distributions fitted to what the paper reports (§6.1 and Fig. 11 of Kwon et al., SOSP 2023):

==========  ======================  =====================  =================================
trace       input tokens            output tokens          source
==========  ======================  =====================  =================================
ShareGPT    mean 161.3, σ_log 1.0,  mean 338.0, σ_log 1.0, §6.1 / Fig. 11: 8.4× longer
            clipped to [4, 1024]    clipped to [4, 1024]   prompts, 5.8× longer outputs than
                                                           Alpaca, with higher variance
Alpaca      mean 19.3, σ_log 0.5,   mean 58.5, σ_log 0.7,  Fig. 11 (short instructions,
            clipped to [4, 256]     clipped to [4, 512]    short answers, narrow spread)
==========  ======================  =====================  =================================

σ_log is the standard deviation of log(length); μ is solved (bisection on the closed-form mean of
a clipped log-normal) so that the *clipped* distribution has exactly the paper's mean, and the
clip keeps prompt + output within OPT's 2048-token context. ``scale`` multiplies the means and
clip bounds (small-scale CPU runs use 1/8 with block size 2 and max_model_len 256: measured in
blocks, the workload is the same). Arrivals are a Poisson process (exponential inter-arrival
times, mean 1/rate), seeded; ``rate=inf`` means every request arrives at t=0.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length distribution clipped to [lo, hi], with μ fitted so the clipped mean is `mean`."""

    mean: float
    sigma: float
    lo: int
    hi: int

    @property
    def mu(self) -> float:
        a, b = math.log(self.mean) - 10.0, math.log(self.mean) + 3.0
        for _ in range(100):  # the clipped mean increases with μ
            m = (a + b) / 2
            if clipped_lognormal_mean(m, self.sigma, self.lo, self.hi) < self.mean:
                a = m
            else:
                b = m
        return (a + b) / 2

    def scaled(self, scale: float) -> LengthDist:
        return replace(self, mean=self.mean * scale, lo=max(1, round(self.lo * scale)), hi=max(2, round(self.hi * scale)))

    def sample(self, rng: random.Random, n: int) -> list[int]:
        mu = self.mu
        return [min(self.hi, max(self.lo, round(rng.lognormvariate(mu, self.sigma)))) for _ in range(n)]


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[min(max(X, lo), hi)] for X ~ LogNormal(μ, σ), in closed form."""
    za, zb = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    partial = math.exp(mu + sigma * sigma / 2) * (_phi(zb - sigma) - _phi(za - sigma))
    return lo * _phi(za) + partial + hi * (1.0 - _phi(zb))


@dataclass(frozen=True)
class TraceSpec:
    name: str
    input: LengthDist
    output: LengthDist

    def scaled(self, scale: float) -> TraceSpec:
        return TraceSpec(self.name, self.input.scaled(scale), self.output.scaled(scale))


TRACES = {
    "sharegpt": TraceSpec("sharegpt", LengthDist(161.3, 1.0, 4, 1024), LengthDist(338.0, 1.0, 4, 1024)),
    "alpaca": TraceSpec("alpaca", LengthDist(19.3, 0.5, 4, 256), LengthDist(58.5, 0.7, 4, 512)),
}


@dataclass
class TraceRequest:
    request_id: str
    arrival: float  # seconds from the trace start
    prompt_token_ids: list[int]
    output_len: int  # the true output length: max_tokens with ignore_eos


def poisson_arrivals(rng: random.Random, rate: float, n: int) -> list[float]:
    """n arrival times of a Poisson process of `rate` requests/s starting at 0 (all 0 for rate=inf)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def make_trace(spec: TraceSpec, num_requests: int, rate: float, vocab: int, seed: int,
               max_model_len: int | None = None) -> list[TraceRequest]:
    """A seeded trace: lengths from `spec`, Poisson arrivals at `rate`, random prompt token ids.

    The lengths depend only on (spec, num_requests, seed), not on the rate, so every point of a rate
    sweep serves the same requests. With `max_model_len`, outputs are cut so prompt + output fits.
    """
    rng = random.Random(seed)
    ins = spec.input.sample(rng, num_requests)
    outs = spec.output.sample(rng, num_requests)
    prompts = [random_prompt(rng, n, vocab) for n in ins]
    arrivals = poisson_arrivals(random.Random(seed + 1), rate, num_requests)
    reqs = []
    for i, (p, o, t) in enumerate(zip(prompts, outs, arrivals)):
        if max_model_len is not None:
            p = p[: max_model_len - 2]
            o = max(1, min(o, max_model_len - len(p)))
        reqs.append(TraceRequest(f"{spec.name}-{i}", t, p, o))
    return reqs


def with_arrivals(reqs: list[TraceRequest], rate: float, seed: int) -> list[TraceRequest]:
    """The same requests with fresh Poisson arrivals at `rate`."""
    times = poisson_arrivals(random.Random(seed + 1), rate, len(reqs))
    return [replace(r, arrival=t) for r, t in zip(reqs, times)]
