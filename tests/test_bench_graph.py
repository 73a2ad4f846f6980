"""The kernel benchmarks' timer: its L2-flush modes (the timing itself needs CUDA)."""
import pytest
import torch

from pagedllm.benchmarks.kernels import FLUSH_MODES, bench_graph


def test_an_unknown_flush_mode_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="flush must be one of"):
        bench_graph(lambda: None, flush="dirty")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flush", FLUSH_MODES)
def test_every_flush_mode_times_a_captured_call(flush):
    x = torch.ones(1 << 20, device="cuda")
    ms, captured = bench_graph(lambda: x.mul_(1.0), reps=5, warmup=1, flush=flush)
    assert captured and ms > 0
