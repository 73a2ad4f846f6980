"""`pagedllm bench fp8-accuracy`'s pieces: the shipped text, the deterministic prompts, the agreement metrics."""
from __future__ import annotations

import pytest

from pagedllm.benchmarks.fp8_accuracy import CONFIGS, agreement, eval_text, make_prompts


def test_eval_text_and_prompts_are_fixed(tokenizer):
    ids = tokenizer.encode(eval_text())
    assert 1900 <= len(ids) <= 2200  # "~2k tokens" of shipped text
    a, b = make_prompts(ids, 64), make_prompts(ids, 64)
    assert a == b and len(a) == 64
    assert all(32 <= len(p) <= 128 for p in a)
    assert len({tuple(p) for p in a}) == 64  # distinct windows
    with pytest.raises(ValueError, match="max_len"):
        make_prompts(ids[:100], 4)


def test_agreement_all_positions_and_prefix():
    base = [[1, 2, 3, 4], [5, 6, 7, 8]]
    out = [[1, 2, 9, 4], [5, 6, 7, 8]]  # one flip at position 2 of request 0, then agreement again
    ag = agreement(out, base)
    assert ag["agreement_all"] == 7 / 8
    assert ag["agreement_prefix"] == (2 + 4) / 8  # tokens before each request's first divergence
    assert ag["identical_requests"] == 1 and ag["num_requests"] == 2
    assert agreement(base, base)["agreement_prefix"] == 1.0
    short = agreement([[1, 2]], [[1, 2, 3, 4]])  # a shorter output counts its missing tokens as different
    assert short["agreement_all"] == 0.5 and short["agreement_prefix"] == 0.5


def test_configs_name_the_issue_21_flags():
    from pagedllm.engine.arg_utils import EngineArgs

    assert CONFIGS["fp8-kv"] == {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}  # scales of 1.0: the default
    assert CONFIGS["fp8-kv-w8"]["quantization"] == "fp8" and CONFIGS["fp8-kv-w8"]["kv_cache_dtype"] == "fp8"
    for fixed, calibrated in (("fp8-kv", "fp8-kv-cal"), ("fp8-kv-w8", "fp8-kv-cal-w8"), ("fp8-kv-e5m2", "fp8-kv-e5m2-cal")):
        assert CONFIGS[calibrated] == {**CONFIGS[fixed], "calculate_kv_scales": True}
    for kw in CONFIGS.values():
        EngineArgs.from_kwargs(**kw)  # every configuration names real engine arguments
