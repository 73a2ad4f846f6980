"""GPT-OSS's MXFP4 experts served as such against the same experts dequantized to bf16, and transformers (BENCHMARKS
§85): a gpt-oss-20b-shaped model cut to LAYERS layers (hidden 2880, 64 query / 8 KV heads of 64, 32 experts top-4 of
width 2880, vocab 201 088, 128-token windows on every other layer, sinks), random bf16 weights whose experts are
rounded to MXFP4 and saved as the released files store them (``*_blocks`` / ``*_scales``, quant_method mxfp4); the
same values also saved dense for transformers. All three run the same requests; the script prints times, ratios, the
weights' GPU memory and KV blocks, and how many greedy tokens the MXFP4 and the dequantized engines share.

    python benchmarks/gpu/gpt_oss_mxfp4.py OUT_DIR [--layers 4] [--num-prompts 64] [--compare hf]
        [--device cpu --shape small]   (on the CPU: "mxfp4" named, the default there dequantizes)
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch


#: gpt-oss-20b's layer shape; the CPU comparison model of BENCHMARKS §84.3 (make_gpt_oss_small.py); a toy.
SHAPES = {
    "20b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4),
    "small": dict(vocab_size=8000, hidden_size=512, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, num_local_experts=16, num_experts_per_tok=4),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_local_experts=4, num_experts_per_tok=2),
}


def make_checkpoints(out: Path, layers: int, device: str, shape: str) -> tuple[Path, Path]:
    import transformers
    from safetensors.torch import save_file

    from pagedllm.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    torch.manual_seed(0)
    dims = SHAPES[shape]
    cfg = transformers.GptOssConfig(num_hidden_layers=layers,
                                    layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                    sliding_window=128, max_position_embeddings=131072, pad_token_id=0,
                                    eos_token_id=1, attn_implementation="eager", **dims)
    with torch.device(device):
        m = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.normal_(0, 1.0 if "sinks" in n else 0.02)
    dense, mx = out / "dense", out / "mxfp4"
    state = {}
    for name, p in m.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(p.transpose(1, 2).contiguous())  # [E, out, in]: the files' layout
            state[name + "_blocks"], state[name + "_scales"] = blocks.cpu(), scales.cpu()
            p.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))  # the dense copy: the same values
        else:
            state[name] = p.detach().cpu().contiguous()
    m.save_pretrained(dense)
    mx.mkdir(parents=True, exist_ok=True)
    save_file(state, str(mx / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(config))
    print(f"{sum(p.numel() for p in m.parameters()) / 1e9:.3f} B params; MXFP4 file "
          f"{(mx / 'model.safetensors').stat().st_size / 2**30:.2f} GiB", flush=True)
    del m
    gc.collect()
    torch.cuda.empty_cache()
    return dense, mx


def run_engine(path: Path, quantization: str | None, wl, max_model_len: int, device: str) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.throughput import run_pagedllm
    from pagedllm.model.layers.quantized_linear import resident_weight_bytes

    llm = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16" if device == "cuda" else "float32", device=device,
              quantization=quantization, max_model_len=max_model_len, gpu_memory_utilization=0.6)
    worker = llm.llm_engine.executor.driver_worker
    res = run_pagedllm(llm, wl)
    first = llm.generate([{"prompt_token_ids": p} for p in wl.prompts[:16]],
                         SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                         use_tqdm=False)
    row = {"quantization": quantization or "default", "elapsed_s": res.elapsed_s,
           "out_tok_s": res.output_tokens_per_s, "weights_gib": resident_weight_bytes(worker.model) / 2**30,
           "kv_blocks": llm.llm_engine.scheduler.block_manager.num_gpu_blocks,
           "greedy": [list(o.outputs[0].token_ids) for o in first]}
    print(json.dumps({k: v for k, v in row.items() if k != "greedy"}), flush=True)
    llm.llm_engine.executor.shutdown()
    del llm, worker
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--compare", choices=["none", "hf"], default="hf")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="20b")
    args = ap.parse_args()
    from pagedllm.benchmarks.throughput import make_workload, run_hf_static

    out = Path(args.out)
    t0 = time.perf_counter()
    dense, mx = make_checkpoints(Path("/tmp/gptoss_ckpt"), args.layers, args.device, args.shape)
    print(f"checkpoints in {time.perf_counter() - t0:.1f} s", flush=True)
    wl = make_workload(args.num_prompts, 64, 512, 128, SHAPES[args.shape]["vocab_size"], seed=0)
    # the default holds the experts as MXFP4 on CUDA; "mxfp4" says so on the CPU too
    quantization = None if args.device == "cuda" else "mxfp4"
    rows = [run_engine(mx, quantization, wl, 2048, args.device), run_engine(mx, "none", wl, 2048, args.device)]
    same = sum(a == b for x, y in zip(rows[0]["greedy"], rows[1]["greedy"]) for a, b in zip(x, y))
    total = sum(len(x) for x in rows[0]["greedy"])
    summary = {"mxfp4_vs_dequantized_time": rows[1]["elapsed_s"] / rows[0]["elapsed_s"],
               "weights_gib": [r["weights_gib"] for r in rows], "kv_blocks": [r["kv_blocks"] for r in rows],
               "greedy_tokens_shared": f"{same}/{total}"}
    if args.compare == "hf":
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            dense, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32, device_map=args.device)
        res = run_hf_static(hf, wl, args.hf_batch_size, 0)
        summary["hf_elapsed_s"] = res.elapsed_s
        summary["mxfp4_vs_hf"] = res.elapsed_s / rows[0]["elapsed_s"]
        summary["dequantized_vs_hf"] = res.elapsed_s / rows[1]["elapsed_s"]
    print(json.dumps(summary, indent=1), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpt_oss_mxfp4.json").write_text(json.dumps({"rows": rows, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
