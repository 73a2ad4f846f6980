"""How FP8 weight recipes move perplexity, on the CPU (issue 21): the bundled model (float32, dequantized)
scores the accuracy benchmark's evaluation text in one forward pass while its linear layers (LM head excepted,
as ``--quantization fp8`` does) run on e4m3 round trips of their weights and/or activations, and optionally K/V
through the FP8 pool's round trip (scales 1.0). Prints perplexity against the unquantized pass per recipe.

    python benchmarks/fp8_weight_sweep.py
"""
import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from fp8_kv_scale_sweep import FakeQuantAttention, nll

from pagedllm import LLM
from pagedllm.benchmarks.fp8_accuracy import eval_text
from pagedllm.kernels import fp8_linear
from pagedllm.model.layers.linear import PackableGemm

E4M3 = torch.float8_e4m3fn


def round_trip_weight(w: torch.Tensor, recipe: str) -> torch.Tensor:
    """The dequantized e4m3 weight of one recipe."""
    if recipe == "amax":
        q, s = fp8_linear.quantize_weight(w)
        return q.float() * s.reshape(-1, 1)
    if recipe == "mse":
        return mse_round_trip(w)
    raise ValueError(recipe)


def mse_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Per row, of the scales amax / 448 · 2^(i/16), i < 16 (every alignment of e4m3's log-spaced grid, none
    saturating), the round trip with the least squared error."""
    base = w.abs().amax(dim=1).clamp(min=1e-12) / 448
    best, best_err = w.clone(), torch.full_like(base, float("inf"))
    for i in range(16):
        s = (base * 2.0 ** (i / 16))[:, None]
        rt = (w / s).to(E4M3).float() * s
        err = (w - rt).square().sum(dim=1)
        better = err < best_err
        best[better], best_err[better] = rt[better], err[better]
    return best


def round_trip_activation(x: torch.Tensor) -> torch.Tensor:
    q, s = fp8_linear.quantize_activation(x.reshape(-1, x.shape[-1]))
    return (q.float() * s).reshape(x.shape)


def patch_linears(model, weight_recipe: str | None, activations: bool, keep: Callable[[str], bool]) -> Callable:
    """Swap each quantized layer's matmul for the fake-quant one; returns the undo."""
    undo = []
    for name, layer in model.named_modules():
        if not isinstance(layer, PackableGemm) or name.endswith("lm_head") or keep(name):
            continue
        w = layer.weight.detach().float()
        wq = round_trip_weight(w, weight_recipe) if weight_recipe else w

        def matmul(x, bias, wq=wq):
            return F.linear(round_trip_activation(x) if activations else x, wq, bias)

        undo.append(layer)
        layer.matmul = matmul

    def restore():
        for layer in undo:
            del layer.matmul  # back to the class's
    return restore


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--text", default=None, help="score this text file instead of the evaluation text")
    p.add_argument("--offset", type=int, default=0, help="first character of --text to score")
    p.add_argument("--all", action="store_true", help="also the single-part recipes (weights, activations, KV)")
    a = p.parse_args()
    llm = LLM(quantization="none", dtype="float32", max_model_len=4096, num_gpu_blocks_override=16)
    model, tok = llm.llm_engine.executor.driver_worker.model, llm.get_tokenizer()
    layers = model.config.num_hidden_layers
    text = open(a.text, encoding='utf-8').read()[a.offset:] if a.text else eval_text()
    ids = tok.encode(text)[:a.tokens]
    ph = [(torch.empty(0), torch.empty(0)) for _ in range(layers)]
    exact_kv, fp8_kv = FakeQuantAttention(ph, None), FakeQuantAttention(ph, [(1.0, 1.0)] * layers)
    base = nll(model, ids, exact_kv, layers)
    never = lambda name: False  # noqa: E731
    last = layers - 1
    keeps = {
        "all quantized": never,
        "down_proj kept": lambda n: n.endswith("down_proj"),
        "o_proj kept": lambda n: n.endswith("o_proj"),
        "qkv kept": lambda n: n.endswith("qkv_proj"),
        "gate_up kept": lambda n: n.endswith("gate_up_proj"),
        "layer 0 kept": lambda n: n.startswith("model.layers.0."),
        f"layers 0,{last} kept": lambda n: n.startswith(("model.layers.0.", f"model.layers.{last}.")),
    }
    recipes = [(f"W+A+KV, {k}", "amax", True, f, fp8_kv) for k, f in keeps.items()]
    if a.all:
        recipes = [("fp8 KV only", None, False, never, fp8_kv), ("W amax", "amax", False, never, exact_kv),
                   ("A per-token", None, True, never, exact_kv), ("W amax + A", "amax", True, never, exact_kv),
                   ("W mse + A + KV", "mse", True, never, fp8_kv)] + recipes
    print(f"eval text {len(ids)} tokens; unquantized ppl {torch.exp(torch.tensor(base)):.4f}")
    print(f"{'recipe':<34}{'ppl':>9}{'vs fp':>9}")
    for name, wr, act, keep, backend in recipes:
        restore = patch_linears(model, wr, act, keep)
        v = nll(model, ids, backend, layers)
        restore()
        print(f"{name:<34}{float(torch.exp(torch.tensor(v))):>9.4f}{100 * (float(torch.exp(torch.tensor(v - base))) - 1):>+8.3f}%",
              flush=True)


if __name__ == "__main__":
    main()
