"""`pagedllm bench paper`: the synthetic traces, the sustained-rate rule, and tiny Fig. 2 / 12 / 13 runs."""
from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from pagedllm.benchmarks.paper import cli, common
from pagedllm.benchmarks.paper.workloads import (
    TRACES,
    clipped_lognormal_mean,
    make_trace,
    poisson_arrivals,
)


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_args(p)
    return p.parse_args([*extra, "--output-dir", str(tmp_path)])


def test_traces_match_the_papers_statistics():
    sg, al = TRACES["sharegpt"], TRACES["alpaca"]
    for d in (sg.input, sg.output, al.input, al.output):
        assert clipped_lognormal_mean(d.mu, d.sigma, d.lo, d.hi) == pytest.approx(d.mean, rel=1e-6)
        xs = d.sample(random.Random(1), 20000)
        assert min(xs) >= d.lo and max(xs) <= d.hi
        assert sum(xs) / len(xs) == pytest.approx(d.mean, rel=0.05)
    assert sg.input.mean / al.input.mean == pytest.approx(8.4, rel=0.01)  # §6.1
    assert sg.output.mean / al.output.mean == pytest.approx(5.8, rel=0.01)


def test_trace_is_seeded_and_rate_independent():
    a = make_trace(TRACES["sharegpt"], 20, 2.0, 1000, seed=3, max_model_len=512)
    b = make_trace(TRACES["sharegpt"], 20, 8.0, 1000, seed=3, max_model_len=512)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(len(r.prompt_token_ids) + r.output_len <= 512 for r in a)
    gaps = poisson_arrivals(random.Random(0), 5.0, 5000)
    assert gaps[-1] / 5000 == pytest.approx(1 / 5.0, rel=0.05)  # mean inter-arrival 1/rate
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(random.Random(0), 0.0, 3)


def test_sustained_rate_rule():
    rates, lat = [1, 2, 4, 8], [1.0, 1.5, 2.5, 1.2]
    assert common.sustained_rate(rates, lat) == 2  # 4 is over 2x; the dip at 8 does not count
    assert common.sustained_rate(rates, lat, reference=2.0) == 8
    assert common.sustained_rate(rates, [5.0, 9.0, 9.0, 9.0], reference=1.0) == 0.0
    assert common.sustained_rate([1, 2], [math.inf, 1.0]) == 0.0
    per = {"a": {"rates": [1, 2], "normalized_latency": [1.0, 3.0]},
           "b": {"rates": [1, 2], "normalized_latency": [3.0, 3.0]}}
    assert common.apply_common_rule(per) == 1.0
    assert per["a"]["sustained_rate"] == 1 and per["b"]["sustained_rate"] == 0.0
    assert per["b"]["sustained_below_lowest_rate"]


def test_fig12_fig13_tiny(tmp_path):
    """Paged batches more requests than Orca (Max) on the same requests (memory binds at a high rate)."""
    args = _args(tmp_path, "fig12", "--traces", "sharegpt", "--systems", "paged", "orca-max",
                 "--num-requests", "10", "--num-blocks", "192", "--rates", "1000")
    assert cli.run(args) == 0
    data = json.loads((tmp_path / "fig12.json").read_text())
    per = data["traces"]["sharegpt"]
    for s in ("paged", "orca-max"):
        d = per[s]
        assert d["rates"] == [1000.0] and d["completed"] == [True]
        assert math.isfinite(d["normalized_latency"][0]) and d["normalized_latency"][0] > 0
        assert d["sustained_rate"] in (0.0, 1000.0)
    assert per["paged"]["mean_batched_requests"][0] > 1.5 * per["orca-max"]["mean_batched_requests"][0]
    assert data["kv_pool"]["num_gpu_blocks"] == 192
    for f in ("fig12.png", "fig12.md", "fig13.png", "fig13.md", "fig13.json"):
        assert (tmp_path / f).stat().st_size > 0
    assert "Orca (Max)" in (tmp_path / "fig12.md").read_text()
    f13 = json.loads((tmp_path / "fig13.json").read_text())
    assert f13["traces"]["sharegpt"]["paged"]["mean_batched_requests"] == per["paged"]["mean_batched_requests"]


def test_fig2_tiny(tmp_path):
    """Fractions of the pool sum to 1; paged keeps more of it on token states than Orca (Max)."""
    args = _args(tmp_path, "fig2", "--systems", "paged", "orca-max", "--num-requests", "16", "--num-blocks", "160")
    assert cli.run(args) == 0
    data = json.loads((tmp_path / "fig2.json").read_text())
    for s in ("paged", "orca-max"):
        parts = data["systems"][s]
        assert sum(parts[k] for k in ("token_states", "reservation", "internal_fragmentation",
                                      "external_fragmentation", "free")) == pytest.approx(1.0, abs=1e-6)
        assert all(0.0 <= parts[k] <= 1.0 for k in ("token_states", "reservation", "internal_fragmentation",
                                                     "external_fragmentation", "free"))
        assert 0 < parts["num_averaged_steps"] <= parts["num_steps"]
    assert data["systems"]["paged"]["external_fragmentation"] == 0.0
    assert data["systems"]["paged"]["token_states"] > 2 * data["systems"]["orca-max"]["token_states"]
    assert (tmp_path / "fig2.png").stat().st_size > 0 and "Orca (Max)" in (tmp_path / "fig2.md").read_text()


def test_fig12_paged_sustains_at_least_orca_max(tmp_path):
    """The paper's ordering on a short sweep: paged sustains >= Orca (Max)'s rate on the same requests."""
    args = _args(tmp_path, "fig12", "--traces", "sharegpt", "--systems", "paged", "orca-max",
                 "--num-requests", "40", "--rates", "8", "32", "128")
    cli.run(args)
    per = json.loads((tmp_path / "fig12.json").read_text())["traces"]["sharegpt"]
    assert per["paged"]["sustained_rate"] >= per["orca-max"]["sustained_rate"] > 0
    assert max(per["paged"]["mean_batched_requests"]) > max(per["orca-max"]["mean_batched_requests"])


def test_cli_lists_every_figure():
    from pagedllm.entrypoints.cli import main  # noqa: F401  (the bench parser must import)

    assert {"fig2", "fig12", "fig13"} <= set(cli.FIGURES)
