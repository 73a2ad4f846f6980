"""The GPU pool budget (worker/gpu_profiling.py) with the device's memory figures stubbed, so it runs on CPU: an
engine's gpu_memory_utilization share excludes what the process held before its model (another engine)."""
from __future__ import annotations

import pytest
import torch

from tiny_models import save_tiny_llama

GIB = 1 << 30


@pytest.mark.parametrize("baseline_gib", [0, 40])
def test_budget_leaves_out_memory_held_before_this_engine(tmp_path, monkeypatch, baseline_gib):
    """140 GiB card, utilization 0.4 (56 GiB): the engine's own weights 1 GiB and peak 2 GiB. With another
    engine's 40 GiB already allocated in the process, the pool is the same as alone, not 40 GiB smaller."""
    from test_kv_scale_calibration import _worker

    from pagedllm.worker import gpu_profiling

    save_tiny_llama(tmp_path)
    worker = _worker(tmp_path, gpu_memory_utilization=0.4)
    worker.memory_baseline = baseline_gib * GIB
    own = {"allocated": (baseline_gib + 1) * GIB, "peak": (baseline_gib + 2) * GIB}
    fake = {
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "memory_allocated": lambda *a, **k: own["allocated"],
        "max_memory_allocated": lambda *a, **k: own["peak"],
        "memory_reserved": lambda *a, **k: own["peak"],
        "mem_get_info": lambda *a, **k: (140 * GIB - own["peak"], 140 * GIB),  # nothing outside torch
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    block_bytes = 1 << 20
    blocks = gpu_profiling.profile_num_gpu_blocks(worker, block_bytes)
    assert blocks == (int(140 * GIB * 0.4) - 2 * GIB) // block_bytes  # 54 GiB of 1 MiB blocks either way
