"""`pagedllm bench latency` (vLLM's `vllm bench latency`): its percentiles, its dummy batch, its checks, and one real
run on the bundled model with transformers in the same run."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm.benchmarks.latency import dummy_prompts, percentile
from pagedllm.entrypoints import cli


def _args(*argv: str):
    return cli.build_parser().parse_args(["bench", "latency", *argv])


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [0.5, 0.1, 0.9, 0.3, 0.7], list(np.linspace(0, 1, 31) ** 2)])
def test_percentiles_are_numpys(values):
    for p in (10, 25, 50, 75, 90, 99):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_the_dummy_batch_is_seeded_and_below_ten_thousand():
    a = dummy_prompts(4, 32, 49_152, seed=3)
    assert a == dummy_prompts(4, 32, 49_152, seed=3) != dummy_prompts(4, 32, 49_152, seed=4)
    assert len(a) == 4 and all(len(p) == 32 for p in a)
    assert max(max(p) for p in a) < 10_000
    assert max(max(p) for p in dummy_prompts(8, 64, 500)) < 500  # a small vocabulary bounds it instead


def test_vllms_defaults_and_bad_values():
    args = _args()
    assert (args.input_len, args.output_len, args.batch_size, args.n, args.num_iters_warmup, args.num_iters) == \
        (32, 128, 8, 1, 10, 30)
    for argv, message in [(["--batch-size", "0"], "--batch-size must be at least 1"),
                          (["--use-beam-search"], "--use-beam-search needs --n"),
                          (["--num-iters-warmup", "-1"], "--num-iters-warmup must be at least 0")]:
        with pytest.raises(ValueError, match=message):
            args = _args(*argv)
            args.func(args)


def test_a_batch_longer_than_max_model_len_is_refused_before_it_runs():
    args = _args("--input-len", "200", "--output-len", "100", "--max-model-len", "256",
                 "--num-gpu-blocks-override", "64", "--no-lower-bound")
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(256\)"):
        args.func(args)


def test_a_real_run_times_every_iteration_and_the_hf_peer(tmp_path, capsys):
    out = tmp_path / "latency.json"
    args = _args("--input-len", "8", "--output-len", "6", "--batch-size", "3", "--n", "2", "--num-iters-warmup", "1",
                 "--num-iters", "2", "--compare", "hf", "--quantization", "none", "--max-model-len", "128",
                 "--num-gpu-blocks-override", "64", "--output-json", str(out))
    assert args.func(args) == 0
    figures = json.loads(out.read_text())
    for system in ("pagedllm", "hf"):
        lat = figures[system]["latencies"]
        assert len(lat) == 2 and all(x > 0 for x in lat)
        assert figures[system]["avg_latency"] == pytest.approx(sum(lat) / 2)
        assert figures[system]["percentiles"]["50"] == pytest.approx(float(np.percentile(lat, 50)))
    assert figures["hf_over_pagedllm"] == pytest.approx(figures["hf"]["avg_latency"] / figures["pagedllm"]["avg_latency"])
    # The CPU work of the timed iterations only: 2 iterations x (3 prompts of 8 tokens + 3 x 2 samples x 5 decodes).
    work = figures["cpu_work"]["steps_flops"]["all"]
    assert work["steps"] >= 2 * 6 and work["flops"] > 0
    printed = capsys.readouterr().out
    assert "[pagedllm] Avg latency:" in printed and "[hf] 99% percentile latency:" in printed
    assert f"= {figures['hf_over_pagedllm']:.2f}x" in printed


def test_a_config_alone_runs_with_dummy_weights_on_both_sides(tmp_path):
    """--load-format dummy (a GPU-sized shape from its config.json alone): the HF peer is transformers' own random
    initialisation of the same config."""
    from transformers import LlamaConfig

    model_dir = tmp_path / "tiny"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=512, max_position_embeddings=128).save_pretrained(model_dir)
    out = tmp_path / "latency.json"
    args = _args("--model", str(model_dir), "--load-format", "dummy", "--skip-tokenizer-init", "--disable-detokenize",
                 "--input-len", "5", "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "0",
                 "--num-iters", "1", "--compare", "hf", "--num-gpu-blocks-override", "16", "--output-json", str(out))
    assert args.func(args) == 0
    figures = json.loads(out.read_text())
    assert len(figures["pagedllm"]["latencies"]) == len(figures["hf"]["latencies"]) == 1
