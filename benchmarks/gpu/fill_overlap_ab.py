"""Issue 19 probe: does handing every grammar fill to the mask thread pay once the GIL changes hands every
0.1 ms while it runs? benchmarks/structured_outputs.py's end-to-end measurement (64 JSON-schema requests vs
their unconstrained twins) under three settings, alternating: cheap fills inline (the former default), every
fill on the mask thread with Python's 5 ms switch interval, and every fill on the mask thread with a 0.1 ms one.

    python benchmarks/gpu/fill_overlap_ab.py [config dir, dummy weights] [rounds]
"""
import importlib.util
import statistics
import sys

import pagedllm.structured_output.manager as manager_module
from pagedllm import LLM

SETTINGS = {  # name: (min_overlapped_fill_s, switch interval while a fill runs on the mask thread)
    "inline cheap fills": (manager_module.MIN_OVERLAPPED_FILL_S, 0.005),
    "mask thread, 5 ms switch": (0.0, 0.005),
    "mask thread, 0.1 ms switch": (0.0, 1e-4),
}


def main() -> None:
    spec = importlib.util.spec_from_file_location("so_bench", "benchmarks/structured_outputs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = sys.argv[1:]
    model_kwargs = {"model": args[0], "load_format": "dummy"} if args and not args[0].isdigit() else {}
    rounds = int(args[-1]) if args and args[-1].isdigit() else 3
    llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=64, max_model_len=1024, **model_kwargs)
    manager = llm.llm_engine.structured_output
    ratios: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, (threshold, interval) in SETTINGS.items():
            manager.min_overlapped_fill_s = threshold
            manager_module.FILL_SWITCH_INTERVAL_S = interval
            ratios[name] += bench._end_to_end(llm, 64, 3)["round_ratios"]
    for name, rs in ratios.items():
        print(f"{name:28s}: constrained / unconstrained median {100 * statistics.median(rs):.1f} % "
              f"(rounds {', '.join(f'{100 * r:.1f}' for r in rs)})", flush=True)


if __name__ == "__main__":
    main()
