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

    assert {"fig2", "fig12", "fig13", "fig14", "fig15", "fig16", "fig17", "fig18", "fig19"} <= set(cli.FIGURES)


def _run(tmp_path, fig: str, *extra: str) -> dict:
    assert cli.run(_args(tmp_path, fig, *extra)) == 0
    for ext in ("png", "md"):
        assert (tmp_path / f"{fig}.{ext}").stat().st_size > 0
    return json.loads((tmp_path / f"{fig}.json").read_text())


def test_fig14_beam_search_batches_more_paged(tmp_path):
    """Beam width 6, all requests at once: paged shares the beams' blocks, so it batches more groups
    than Orca (Oracle), which reserves prompt + output for every beam."""
    data = _run(tmp_path, "fig14", "--widths", "6", "--num-requests", "16", "--rates", "5000")
    assert set(data["panels"]) == {"parallel n=6", "beam width=6"}
    for panel in data["panels"].values():
        per = panel["systems"]
        assert set(per) == {"paged", "orca-oracle"}
        assert per["paged"]["rates"] == [5000.0] and per["paged"]["completed"] == [True]
        assert panel["paged_over_oracle"].rstrip("×").lstrip("≥ ")
    beam = data["panels"]["beam width=6"]["systems"]
    assert beam["paged"]["mean_batched_requests"][0] > beam["orca-oracle"]["mean_batched_requests"][0]
    assert data["engine_builds"] == 1  # four configurations, one engine (EngineCache)


def test_fig15_wider_beams_save_more(tmp_path):
    data = _run(tmp_path, "fig15", "--traces", "alpaca", "--widths", "2", "6", "--num-requests", "4")
    pts = {(p["method"], p["width"]): p["saving_pct"] for p in data["points"]}
    assert set(pts) == {("parallel", 2), ("parallel", 6), ("beam", 2), ("beam", 6)}
    assert all(0 < v < 100 for v in pts.values())
    assert pts[("beam", 6)] > pts[("beam", 2)] and pts[("parallel", 6)] > pts[("parallel", 2)]
    assert pts[("beam", 2)] > pts[("parallel", 2)]  # beams share generated blocks too, samples only the prompt


def test_fig16_prefix_caching_batches_more(tmp_path):
    """5-shot prefix, all requests at once: with prefix caching the prefix's blocks are held once."""
    data = _run(tmp_path, "fig16", "--shots", "5", "--num-requests", "16", "--rates", "5000", "--num-blocks", "96")
    per = data["panels"]["5-shot"]["systems"]
    assert set(per) == {"prefix-caching", "paged", "orca-oracle"}
    assert per["prefix-caching"]["mean_batched_requests"][0] > per["orca-oracle"]["mean_batched_requests"][0]
    assert per["prefix-caching"]["mean_batched_requests"][0] > per["paged"]["mean_batched_requests"][0]
    assert data["engine_builds"] == 1  # prefix caching is switched on the same engine


def test_fig17_chatbot_prompts_truncated(tmp_path):
    data = _run(tmp_path, "fig17", "--num-requests", "12", "--rates", "5000", "--systems", "paged", "orca-max")
    assert set(data["systems"]) == {"paged", "orca-max"} and data["truncated_to"] == 128
    assert data["mean_input"] <= 128
    per = data["systems"]
    assert per["paged"]["mean_batched_requests"][0] > per["orca-max"]["mean_batched_requests"][0]


def test_fig18_kernels_agree_and_block_sizes(tmp_path):
    """fig18a checks the paged, contiguous and SDPA outputs against each other (assert_close inside)."""
    data = _run(tmp_path, "fig18", "--traces", "sharegpt", "--block-sizes", "2", "8", "--num-requests", "10")
    assert len(data["kernel"]) == 10 and all(p["paged_ms"] > 0 and p["contiguous_ms"] > 0 for p in data["kernel"])
    d = data["block_size"]["sharegpt"]
    assert d["block_sizes"] == [2, 8] and all(math.isfinite(y) for y in d["normalized_latency"])


def test_fig19_swap_vs_recompute(tmp_path):
    """A small pool at a high rate forces preemption: swap mode swaps out, recompute mode never does."""
    data = _run(tmp_path, "fig19", "--block-sizes", "4", "--num-requests", "16", "--rates", "5000",
                "--num-blocks", "96")
    rec = data["recovery"][0]
    assert rec["block_size"] == 4 and rec["seq_len"] == 128 and rec["num_blocks"] == 32 and rec["swap_ms"] > 0 and rec["recompute_ms"] > 0
    e = data["end_to_end"]
    assert e["recompute"]["num_preemptions"][0] > 0 and e["recompute"]["num_swap_outs"][0] == 0
    assert e["swap"]["num_swap_outs"][0] > 0
    assert data["engine_builds"] == 1  # the preemption mode is switched on the same engine


def test_switch_system_keeps_the_pool(tmp_path):
    """One engine serves every system: switching swaps the KV manager over the same pool, idle only."""
    from pagedllm.core.baselines import ContiguousBlockManager
    from pagedllm.core.block_manager import BlockManager

    args = _args(tmp_path, "fig12", "--num-blocks", "160")
    engine = common.make_engine(args, "paged")
    try:
        common.switch_system(engine, "request-level")
        bm = engine.scheduler.block_manager
        assert isinstance(bm, ContiguousBlockManager) and bm.num_gpu_blocks == 160
        assert engine.config.scheduler_config.batching == "request"
        common.switch_system(engine, "paged")
        assert isinstance(engine.scheduler.block_manager, BlockManager)
        assert engine.config.scheduler_config.batching == "iteration"
        from pagedllm import SamplingParams

        engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
        with pytest.raises(RuntimeError, match="idle"):
            common.switch_system(engine, "orca-max")
    finally:
        common.release(engine)


def test_engine_cache_reuses_one_engine_per_shape(tmp_path):
    """Same shape: one build, only the KV manager, prefix caching and preemption mode change; another block
    size: the old engine goes first (one GPU holds one 13B model), then a new one is built."""
    import gc
    import weakref

    from pagedllm.core.baselines import ContiguousBlockManager
    from pagedllm.core.block_manager import BlockManager

    args = _args(tmp_path, "fig12", "--num-blocks", "64")
    with common.EngineCache(args) as engines:
        first = engines.get("paged", prefix_caching=True)
        assert isinstance(first.scheduler.block_manager, BlockManager)
        assert first.config.cache_config.enable_prefix_caching
        again = engines.get("orca-oracle", preemption_mode="swap")
        assert again is first and engines.num_builds == 1
        assert isinstance(first.scheduler.block_manager, ContiguousBlockManager)
        assert not first.config.cache_config.enable_prefix_caching
        assert first.config.cache_config.preemption_mode == "swap"
        gone = weakref.ref(first)
        del first, again
        other = engines.get("paged", block_size=4)
        gc.collect()
        assert engines.num_builds == 2 and other.config.cache_config.block_size == 4
        assert gone() is None  # the first engine was freed, not kept beside the second
    assert engines.engine is None
