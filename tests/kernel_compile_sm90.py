"""Compiles the paged prefill and unified attention kernels for sm_90 (Hopper) with Triton's NVIDIA backend and its
bundled ptxas, no GPU needed: run by tests/test_kernel_compile.py in a process without TRITON_INTERPRET, so a CPU
machine proves the kernels still compile for the GPU. Prints one line per kernel variant."""
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedllm.kernels import triton_attention, triton_unified_attention

_INDEX_PTRS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"}
_FLOAT_ARGS = {"scale", "k_scale", "v_scale"}


def _signature(fn, ptr_types: dict[str, str], constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types[name]
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    return sig


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    for cache, dot in (("bf16", "query"), ("fp8e4nv", "fp16")):
        ptrs = dict(_INDEX_PTRS, q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}")
        prefill = dict(GROUP=4, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64, PREC="tf32", DOT=dot)
        kernels = [("prefill", triton_attention._prefill_kernel, prefill)]
        for group, group_pad in ((1, 1), (3, 4)):
            kernels.append((f"unified group {group}", triton_unified_attention._unified_kernel,
                            dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=64, DIM_PAD=64, BLOCK_SIZE=16,
                                 BLOCK_Q=16 // group_pad, BLOCK_N=64, PREC="tf32", DOT=dot)))
        for label, fn, constexprs in kernels:
            src = ASTSource(fn, _signature(fn, ptrs, constexprs), constexprs=constexprs)
            compiled = triton_compile(src, target=target, options={"num_warps": 4, "num_stages": 3})
            print(f"{label}, {cache} cache: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")


if __name__ == "__main__":
    main()
