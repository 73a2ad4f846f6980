"""Why a float32 speculative step costs 2.5x a plain one on the GPU (BENCHMARKS.md §52.2): the bundled model's
GEMM shapes (SmolLM2-135M: hidden 576, q/k/v 576/192/192, MLP 1536, vocabulary 49 152) for all 30 layers (distinct
weights, so they stream from memory as in a step) plus the LM head, captured in one CUDA graph (launches do not
count) and timed at the row counts of decodes (1 row per sequence) and k=12 verifications (13 per sequence), in
float32 and bf16, with cuBLAS and cuBLASLt.

    python benchmarks/gpu/f32_skinny_gemm.py
"""
import torch
import torch.nn.functional as F

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LAYERS, HIDDEN, VOCAB = 30, 576, 49152


def bundled_gemm_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    """Distinct weights of the bundled model's GEMM shapes for all 30 layers, then the LM head."""
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(LAYERS)
               for k, n in SHAPES.values()]
    weights.append(torch.randn(VOCAB, HIDDEN, device="cuda", dtype=dtype) / HIDDEN**0.5)
    return weights


def graph_ms(forward) -> float:
    """`forward` captured in one CUDA graph (after 3 warm-up calls), ms per replay over 20 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def gemms_ms(rows: int, linear=None, dtype: torch.dtype = torch.float32) -> float:
    """One forward's GEMMs (30 layers × 4 plus the LM head), replayed from a CUDA graph: ms per replay.
    `linear(x, w, out)` runs one GEMM into `out`; None: `F.linear` (cuBLAS)."""
    weights = bundled_gemm_weights(dtype)
    inputs = {k: torch.randn(rows, k, device="cuda", dtype=dtype) for k in (576, 1536)}
    outs = {n: torch.empty(rows, n, device="cuda", dtype=dtype) for n in {w.shape[0] for w in weights}}

    def forward():
        for w in weights:
            if linear is None:
                F.linear(inputs[w.shape[1]], w)
            else:
                linear(inputs[w.shape[1]], w, outs[w.shape[0]])

    return graph_ms(forward)


def step_ms(rows: int, dtype: torch.dtype) -> float:
    """One forward's GEMMs through cuBLAS: ms per replay."""
    return gemms_ms(rows, None, dtype)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for dtype in (torch.float32, torch.bfloat16):
            row = [f"{r}: {step_ms(r, dtype):.3f}" for r in (1, 2, 4, 13, 26, 52)]
            print(f"{lib:9} {str(dtype):15} ms per step's GEMMs by rows -> " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
