"""A new schema's TTFT on a CPU engine, a short prompt run whole while the grammar compiles and its first token
sampled from the kept logits (defer) against waiting for the grammar before the prompt runs (wait, the previous
CPU behaviour), alternating on one engine with fresh schemas; structured_outputs.py's measurement (8 plain
requests decode meanwhile; bound = the plain twin's TTFT + the compile time).

    python benchmarks/results/cpu_1127i/ttft_defer_ab.py [--words 0 20 40] [--pairs 5]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from structured_outputs import _ttft_while_compiling, ttft_summary  # noqa: E402

from pagedllm import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, nargs="+", default=[0, 20, 40])
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args()
    llm = LLM(num_gpu_blocks_override=1024, max_num_seqs=64, max_model_len=1024)
    eng = llm.llm_engine
    _ = eng.structured_output.backend
    _ttft_while_compiling(llm)  # warm-up
    for words in a.words:
        filler = " ".join(("the quick brown fox jumps over the lazy dog " * (words // 9 + 1)).split()[:words])
        prompt = f"{filler} JSON:" if filler else "JSON:"
        n_tok = len(llm.get_tokenizer().encode(prompt))
        res = {"defer": [], "wait": []}
        for _ in range(a.pairs):
            for mode in ("defer", "wait"):
                eng._defer_sample_max_prompt = 10_000 if mode == "defer" else 0
                res[mode].append(_ttft_while_compiling(llm, prompt=prompt))
        for mode, samples in res.items():
            med, excess = ttft_summary(samples)
            print(f"prompt {n_tok:3d} tokens, {mode:5s}: TTFT {med['ttft_new_ms']:6.1f} ms vs bound "
                  f"{med['ttft_plain_ms'] + med['compile_ms']:6.1f} (twin {med['ttft_plain_ms']:.1f} + compile "
                  f"{med['compile_ms']:.1f}); TTFT - bound per schema: {excess}; others' step "
                  f"{med['tpot_before_ms']:.1f} -> {med['tpot_during_ms']:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
