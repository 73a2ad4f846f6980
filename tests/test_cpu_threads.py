"""vLLM's VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU: the CPU lists each rank gets, the errors for
bad values, and real engines (one process, tensor-parallel worker processes) whose OpenMP threads end up pinned.

Engines that pin run in a child process: pinning the test process would slow every later test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.dp_client import rank_process_env
from pagedllm.worker.cpu_threads import (
    ALLOWED_ENV,
    BIND_ENV,
    RESERVED_ENV,
    allowed_cpus,
    cpus_for_ranks,
    format_cpu_list,
    parse_cpu_list,
)

TWO_CPUS = len(allowed_cpus()) >= 2


def test_cpu_lists_parse_and_format():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpu_list(parse_cpu_list(" 5 ")) == "5"
    with pytest.raises(ValueError, match=r"'x' in '0,x' is not a CPU number or range; write CPU lists like"):
        parse_cpu_list("0,x")
    with pytest.raises(ValueError, match="'3-1' in '3-1' is not a CPU range"):
        parse_cpu_list("3-1")
    with pytest.raises(ValueError, match=r"CPU\(s\) \[2\] listed more than once"):
        parse_cpu_list("0-2,2")


def test_auto_gives_each_rank_a_numa_node_or_an_equal_share(monkeypatch):
    monkeypatch.delenv(RESERVED_ENV, raising=False)
    sixteen = list(range(16))
    # as many nodes as ranks: a node each, one CPU per rank left for the rest of the process
    assert cpus_for_ranks("auto", 2, sixteen, [sixteen[:8], sixteen[8:]]) == [list(range(7)), list(range(8, 15))]
    # one rank: the whole machine, nothing reserved
    assert cpus_for_ranks("auto", 1, sixteen, [sixteen]) == [sixteen]
    # fewer nodes than ranks: contiguous equal shares (the first ones one larger), then the reservation
    assert cpus_for_ranks("auto", 3, sixteen, [sixteen]) == [[0, 1, 2, 3, 4], [6, 7, 8, 9], [11, 12, 13, 14]]
    # a share of one CPU keeps it: the default reservation never empties a rank
    assert cpus_for_ranks("auto", 2, [0, 1], [[0, 1]]) == [[0], [1]]
    monkeypatch.setenv(RESERVED_ENV, "2")
    assert cpus_for_ranks("auto", 1, sixteen, [sixteen]) == [list(range(14))]
    with pytest.raises(ValueError, match=f"{RESERVED_ENV}=2 leaves a rank no CPU"):
        cpus_for_ranks("auto", 8, sixteen, [sixteen])
    monkeypatch.setenv(RESERVED_ENV, "-1")
    with pytest.raises(ValueError, match="expected a whole number of CPUs >= 0"):
        cpus_for_ranks("auto", 1, sixteen, [sixteen])
    monkeypatch.delenv(RESERVED_ENV)
    with pytest.raises(ValueError, match="3 ranks need at least one CPU each; 2 physical cores are available"):
        cpus_for_ranks("auto", 3, [0, 1], [[0, 1]])


def test_auto_can_keep_smt_siblings(monkeypatch):
    """one_per_core reads the machine's topology; with physical_cores_only=False every allowed CPU is shared out."""
    monkeypatch.delenv(RESERVED_ENV, raising=False)
    siblings = {0: [0, 4], 4: [0, 4], 1: [1, 5], 5: [1, 5]}
    monkeypatch.setattr("pagedllm.worker.cpu_threads._read_cpu_list",
                        lambda path: siblings.get(int(path.parent.parent.name[3:])))
    assert cpus_for_ranks("auto", 1, [0, 1, 4, 5], [[0, 1, 4, 5]]) == [[0, 1]]
    assert cpus_for_ranks("auto", 1, [0, 1, 4, 5], [[0, 1, 4, 5]], physical_cores_only=False) == [[0, 1, 4, 5]]


def test_explicit_lists_and_nobind():
    assert cpus_for_ranks("0-3|4-7", 2, list(range(8))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cpus_for_ranks("nobind", 2, [0, 1]) is None
    assert cpus_for_ranks("all", 1, [0, 1]) is None  # older vLLM's spelling
    with pytest.raises(ValueError, match=r"gives 1 CPU list\(s\) for 2 rank\(s\); give one per rank"):
        cpus_for_ranks("0-3", 2, list(range(8)))
    with pytest.raises(ValueError, match=r"CPU\(s\) \[8, 9\] are not available to this process \(allowed: 0-7\)"):
        cpus_for_ranks("0|8-9", 2, list(range(8)))


def test_data_parallel_ranks_get_disjoint_lists(monkeypatch):
    monkeypatch.delenv(RESERVED_ENV, raising=False)
    cpu = EngineArgs(data_parallel_size=2, tensor_parallel_size=2, device="cpu")
    monkeypatch.setenv(BIND_ENV, "0-1|2-3|4-5|6-7")
    assert rank_process_env(1, cpu, 8, [], list(range(8))) == {"OMP_NUM_THREADS": "2", BIND_ENV: "4-5|6-7"}
    monkeypatch.setenv(BIND_ENV, "auto")
    env = rank_process_env(0, cpu, 8, [], list(range(8)))
    assert env[BIND_ENV] == "0|2" and env["OMP_NUM_THREADS"] == "1"  # shares of 2, one CPU each reserved
    monkeypatch.setenv(BIND_ENV, "nobind")
    assert rank_process_env(0, cpu, 8, [], list(range(8))) == {"OMP_NUM_THREADS": "4"}
    monkeypatch.setenv(BIND_ENV, "0-3|4-7")
    with pytest.raises(ValueError, match=r"gives 2 CPU list\(s\) for 4 rank\(s\)"):
        rank_process_env(0, cpu, 8, [], list(range(8)))


def _thread_affinities() -> dict:
    """Run in an engine's process: its thread count and each thread's CPUs."""
    import torch

    tasks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            tasks[tid] = sorted(os.sched_getaffinity(int(tid)))
        except OSError:
            pass
    return {"threads": torch.get_num_threads(), "main": sorted(os.sched_getaffinity(0)), "tasks": tasks}


def _run_child(script: str, bind: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (ALLOWED_ENV, RESERVED_ENV)}
    env.update({BIND_ENV: bind, "PYTHONPATH": os.pathsep.join(sys.path)})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


ENGINE_SCRIPT = """
    import json, os, sys
    sys.path.insert(0, {tests!r})
    from test_cpu_threads import _thread_affinities
    from pagedllm import LLM, SamplingParams
    llm = LLM({model!r}, skip_tokenizer_init=True, num_gpu_blocks_override=16, block_size=8, max_num_seqs=4,
              tensor_parallel_size={tp}, distributed_executor_backend="mp")
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    report = {{"tokens": out[0].outputs[0].token_ids, "ranks": llm.collective_rpc(lambda worker: _thread_affinities())}}
    if {tp} > 1:
        llm.llm_engine.executor.shutdown()
    report["after"] = sorted(os.sched_getaffinity(0))  # the caller's thread once the engine is gone
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=0, eos_token_id=127)
    path = tmp_path_factory.mktemp("tiny_bind")
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def _engine(tiny_dir: str, tp: int, bind: str) -> dict:
    return _run_child(ENGINE_SCRIPT.format(tests=os.path.dirname(__file__), model=tiny_dir, tp=tp), bind)


def _needs_pinning_library() -> None:
    """Per-thread pinning needs the C library (a C compiler); without one the process is confined instead."""
    from pagedllm.worker.cpu_threads import _affinity_lib

    try:
        _affinity_lib()
    except (OSError, RuntimeError) as e:
        pytest.skip(f"no per-thread pinning here: {e}")


def _pinned(rank: dict) -> list[list[int]]:
    """The single-CPU masks among a rank's threads (its pinned OpenMP workers)."""
    return sorted(cpus for cpus in rank["tasks"].values() if len(cpus) == 1)


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_one_process_engine_pins_its_worker_threads(tiny_dir):
    _needs_pinning_library()
    allowed = allowed_cpus()
    first, second = allowed[0], allowed[1]
    auto = _engine(tiny_dir, 1, "auto")
    nobind = _engine(tiny_dir, 1, "nobind")
    assert auto["tokens"] == nobind["tokens"]
    (rank,) = auto["ranks"]
    # OpenMP worker i > 0 sits on the i-th CPU; the engine's own thread keeps the whole share
    assert [cpus for cpus in _pinned(rank)] == [[c] for c in allowed[1:rank["threads"]]]
    assert rank["main"] == allowed
    assert _pinned(nobind["ranks"][0]) == []
    (one,) = _engine(tiny_dir, 1, str(second))["ranks"]
    assert one["threads"] == 1 and one["main"] == [second]
    (two,) = _engine(tiny_dir, 1, f"{second},{first}")["ranks"]
    assert two["threads"] == 2 and _pinned(two) == [[first]] and two["main"] == sorted([first, second])


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_tensor_parallel_ranks_run_on_their_own_lists(tiny_dir):
    allowed = allowed_cpus()
    first, second = allowed[0], allowed[1]
    report = _engine(tiny_dir, 2, f"{second}|{first}")
    rank0, rank1 = report["ranks"]
    assert rank0["threads"] == rank1["threads"] == 1
    assert rank0["main"] == [second] and rank1["main"] == [first]
    assert report["after"] == allowed  # rank 0 ran on the caller's thread: its CPUs are given back at shutdown
    assert report["tokens"] == _engine(tiny_dir, 2, "nobind")["tokens"]


def test_a_bad_binding_is_a_clear_error_before_the_model_loads(tiny_dir):
    env = {k: v for k, v in os.environ.items() if k != ALLOWED_ENV}
    env.update({BIND_ENV: "0-x", "PYTHONPATH": os.pathsep.join(sys.path)})
    script = f"from pagedllm import LLM; LLM({tiny_dir!r}, skip_tokenizer_init=True, num_gpu_blocks_override=16)"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "VLLM_CPU_OMP_THREADS_BIND: '0-x' in '0-x' is not a CPU number or range" in proc.stderr
