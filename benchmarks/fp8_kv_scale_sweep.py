"""How FP8 KV scales move perplexity, on the CPU (issue 21): the bundled model (float32, dequantized) scores the
accuracy benchmark's evaluation text in one forward pass while every layer's K and V go through an e4m3
quantize/dequantize round trip (what the FP8 pool stores) with the scales of each policy: fixed 1.0, and
per-layer amax / constant from the start-up calibration pass (``kv_scale_calibration``) for several constants
(vLLM's 200 / 100, and more headroom). Prints perplexity against the unquantized pass, and per policy the
share of stored values saturated (|x| / scale > 448) or below e4m3's normal range (|x| / scale < 2^-6).

    python benchmarks/fp8_kv_scale_sweep.py
"""
import argparse

import torch

from pagedllm import LLM
from pagedllm.benchmarks.fp8_accuracy import eval_text
from pagedllm.kernels import kv_quant
from pagedllm.worker.kv_scale_calibration import calibrate_kv_amax, calibration_token_ids, causal_attention
from pagedllm.kernels.metadata import AttentionMetadata

E4M3 = torch.float8_e4m3fn


class FakeQuantAttention:
    """Stand-in attention backend: K, V through an e4m3 round trip with per-layer scales, then causal attention."""

    name = "fake-fp8"

    def __init__(self, kv_caches, scales):
        self.kv_caches, self.scales = kv_caches, scales
        self.saturated = self.subnormal = self.total = 0

    def forward(self, query, key, value, kv_cache, meta, scale, out=None):
        layer = next(i for i, c in enumerate(self.kv_caches) if c is kv_cache)
        if self.scales is not None:
            ks, vs = self.scales[layer]
            for x, s in ((key, ks), (value, vs)):
                r = x.abs().float() / s
                self.saturated += int((r > 448).sum())
                self.subnormal += int(((r < 2 ** -6) & (r > 0)).sum())
                self.total += r.numel()
            key = kv_quant.dequantize(kv_quant.quantize(key, E4M3, ks), key.dtype, ks)
            value = kv_quant.dequantize(kv_quant.quantize(value, E4M3, vs), value.dtype, vs)
        return causal_attention(query, key, value, scale)


@torch.inference_mode()
def nll(model, ids, backend, num_layers) -> float:
    n = len(ids)
    placeholders = backend.kv_caches
    meta = AttentionMetadata(slot_mapping=torch.full((n,), -1), block_tables=torch.zeros(1, 0, dtype=torch.int32),
                             seq_lens=torch.tensor([n]), query_start_loc=torch.tensor([0, n]), seq_lens_cpu=[n],
                             query_lens_cpu=[n], num_decodes=0, max_seq_len=n, max_query_len=n, backend=backend)
    hidden = model(torch.tensor(ids), torch.arange(n), placeholders, meta)
    logits = model.compute_logits(hidden).float()
    return float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--constants", nargs="+", default=["200,100", "100,50", "50,25", "50,50", "28,28", "16,16"])
    a = p.parse_args()
    llm = LLM(quantization="none", dtype="float32", max_model_len=4096, num_gpu_blocks_override=16)
    worker = llm.llm_engine.executor.driver_worker
    model, tok = worker.model, llm.get_tokenizer()
    layers = model.config.num_hidden_layers
    ids = tok.encode(eval_text())[:2048]
    cal = calibrate_kv_amax(model, calibration_token_ids(tok, model.config.vocab_size, 4096), layers, "cpu")
    ev = calibrate_kv_amax(model, ids, layers, "cpu")
    print(f"eval text {len(ids)} tokens; eval amax / calibration amax per layer: "
          f"K {min(e / c for e, c in zip(ev.k_amax, cal.k_amax)):.2f}..{max(e / c for e, c in zip(ev.k_amax, cal.k_amax)):.2f}, "
          f"V {min(e / c for e, c in zip(ev.v_amax, cal.v_amax)):.2f}..{max(e / c for e, c in zip(ev.v_amax, cal.v_amax)):.2f}")
    ph = [(torch.empty(0), torch.empty(0)) for _ in range(layers)]
    base = nll(model, ids, FakeQuantAttention(ph, None), layers)
    policies = {"fixed 1.0": [(1.0, 1.0)] * layers}
    for c in a.constants:
        kc, vc = (float(x) for x in c.split(","))
        policies[f"amax/({kc:g},{vc:g})"] = list(cal.scales(kc, vc))
    print(f"{'policy':<18}{'ppl':>9}{'vs fp':>9}{'saturated':>11}{'subnormal':>11}")
    print(f"{'unquantized':<18}{torch.exp(torch.tensor(base)):>9.4f}")
    for name, scales in policies.items():
        be = FakeQuantAttention(ph, scales)
        v = nll(model, ids, be, layers)
        print(f"{name:<18}{float(torch.exp(torch.tensor(v))):>9.4f}{100 * (float(torch.exp(torch.tensor(v - base))) - 1):>+8.3f}%"
              f"{100 * be.saturated / be.total:>10.4f}%{100 * be.subnormal / be.total:>10.3f}%")


if __name__ == "__main__":
    main()
