"""Issue 19 probe: does a grammar compile wait for the GIL? A new-schema request's TTFT against its bound (plain
twin's TTFT + compile time), as benchmarks/structured_outputs.py measures it, repeated with Python's default thread
switch interval (5 ms) and a short one, alternating. A background thread that needs the GIL while the step thread
runs Python waits until the step thread is forced to drop it (after the switch interval), so the compile's start
and its result can each lag the step loop by up to that interval.

    python benchmarks/gpu/ttft_switch_interval.py [config dir, dummy weights] [rounds]
"""
import importlib.util
import statistics
import sys

from pagedllm import LLM


def main() -> None:
    spec = importlib.util.spec_from_file_location("so_bench", "benchmarks/structured_outputs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = [a for a in sys.argv[1:]]
    model_kwargs = {"model": args[0], "load_format": "dummy"} if args and not args[0].isdigit() else {}
    rounds = int(args[-1]) if args and args[-1].isdigit() else 6
    llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=64, max_model_len=1024, **model_kwargs)
    _ = llm.llm_engine.structured_output.backend
    bench._ttft_while_compiling(llm)  # warm-up
    results: dict[float, list[dict]] = {0.005: [], 0.0002: []}
    for _ in range(rounds):
        for interval in results:
            sys.setswitchinterval(interval)
            results[interval].append(bench._ttft_while_compiling(llm))
    sys.setswitchinterval(0.005)
    for interval, rs in results.items():
        excess = [r["ttft_new_ms"] - r["ttft_plain_ms"] - r["compile_ms"] for r in rs]
        print(f"switch interval {1e3 * interval:.1f} ms: TTFT new {statistics.median(r['ttft_new_ms'] for r in rs):.1f} ms, "
              f"twin {statistics.median(r['ttft_plain_ms'] for r in rs):.1f}, compile "
              f"{statistics.median(r['compile_ms'] for r in rs):.1f}; TTFT - bound (ms): "
              f"{', '.join(f'{x:.1f}' for x in excess)} (median {statistics.median(excess):.1f}); others' step "
              f"{statistics.median(r['tpot_before_ms'] for r in rs):.2f} before vs "
              f"{statistics.median(r['tpot_during_ms'] for r in rs):.2f} ms while compiling", flush=True)


if __name__ == "__main__":
    main()
