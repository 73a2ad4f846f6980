"""Shared pieces of the paper's figures: systems, scales, engines, the sustained-rate rule, outputs."""
from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Self

logger = logging.getLogger("pagedllm.bench.paper")

# name → (kv_cache_manager, batching): the paper's five systems, all in this engine (§6.1).
SYSTEMS: dict[str, tuple[str, str]] = {
    "paged": ("paged", "iteration"),
    "orca-oracle": ("orca-oracle", "iteration"),
    "orca-pow2": ("orca-pow2", "iteration"),
    "orca-max": ("orca-max", "iteration"),
    "request-level": ("orca-max", "request"),  # FasterTransformer-style: static batches, max-length reservation
}
LABELS = {"paged": "pagedllm (paged)", "orca-oracle": "Orca (Oracle)", "orca-pow2": "Orca (Pow2)",
          "orca-max": "Orca (Max)", "request-level": "request-level (FT-style)"}
STYLE = {"paged": ("tab:red", "o"), "orca-oracle": ("tab:blue", "s"), "orca-pow2": ("tab:green", "^"),
         "orca-max": ("tab:purple", "v"), "request-level": ("tab:gray", "x")}

SUSTAINED_FACTOR = 2.0
SUSTAINED_RULE = (f"highest rate with normalized latency <= {SUSTAINED_FACTOR:g}x the unloaded latency (min over "
                  "the compared systems of their lowest-rate value)")
OPT_13B = {"hidden_size": 5120, "num_hidden_layers": 40, "ffn_dim": 20480, "num_attention_heads": 40, "vocab_size": 50272,
               "max_position_embeddings": 2048, "word_embed_proj_dim": 5120, "do_layer_norm_before": True}
LLAMA_13B = {"vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                 "num_attention_heads": 40, "num_key_value_heads": 40, "max_position_embeddings": 2048,
                 "tie_word_embeddings": False}
# --scale small: a tiny Llama with random weights. The figures compare KV memory management, which does not
# depend on the model's size; a tiny model keeps a 2-core CPU run to minutes (steps cost ~ms, not ~0.5 s).
TINY_LLAMA = {"vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
                  "tie_word_embeddings": False}
TABLE1_KV_BYTES = 12 * 10**9  # Table 1: OPT-13B on one A100-40GB leaves 12 GB for the KV cache
# That budget in blocks of 16 tokens (K and V, 40 layers x 5120 fp16 values each per token): 915. With the
# small scale's lengths x1/8 and block 2, a 915-block pool holds the same number of requests as the paper's.
PAPER_POOL_BLOCKS = TABLE1_KV_BYTES // (2 * 40 * 5120 * 2 * 16)


def sustained_rate(rates: list[float], normalized_latency: list[float], factor: float = SUSTAINED_FACTOR,
                   reference: float | None = None) -> float:
    """The highest rate up to which normalized latency stays <= `factor` x `reference`.

    `reference` is the unloaded normalized latency: the lowest lowest-rate value of all systems on the
    trace (they share model code and kernels, so unloaded they are equally fast); default: this system's
    own lowest-rate value. Rates are taken in increasing order and the first rate over the threshold ends
    the run ("stays"): a later point that dips back under does not count. 0.0 when the lowest measured rate
    is already over it (the system sustains less than that rate).
    """
    pts = sorted(zip(rates, normalized_latency))
    if not pts or not math.isfinite(pts[0][1]):
        return 0.0
    limit = factor * (reference if reference is not None else pts[0][1])
    best = 0.0
    for r, lat in pts:
        if not (math.isfinite(lat) and lat <= limit):
            break
        best = r
    return best


def unloaded_latency(per_system: dict[str, dict]) -> float | None:
    """The reference of `sustained_rate`: min over systems of the normalized latency at their lowest rate."""
    vals = [min(zip(d["rates"], d["normalized_latency"]))[1] for d in per_system.values()
            if isinstance(d, dict) and d.get("rates")]
    vals = [v for v in vals if math.isfinite(v)]
    return min(vals) if vals else None


def apply_common_rule(per_system: dict[str, dict]) -> float | None:
    """Recompute every system's `sustained_rate` against the trace's common unloaded latency."""
    ref = unloaded_latency(per_system)
    for d in per_system.values():
        if isinstance(d, dict) and d.get("rates"):
            d["sustained_rate"] = sustained_rate(d["rates"], d["normalized_latency"], reference=ref)
            d["sustained_below_lowest_rate"] = d["sustained_rate"] == 0.0
    return ref


@dataclass
class Scale:
    """One scale's shapes: `small` (bundled model, CPU) or `paper` (13B configs, dummy weights, GPU)."""

    name: str
    length_scale: float  # multiplies the traces' lengths
    block_size: int
    max_model_len: int
    num_blocks: int | None  # KV pool in blocks (small), or
    kv_cache_memory_bytes: int | None  # in bytes (paper, Table 1)
    num_requests: int
    device: str
    dtype: str


SCALES = {
    # lengths ×1/8 with block 2 and max_model_len 256: the paper's workload in units of blocks; 256 blocks.
    "small": Scale("small", 1 / 8, 2, 256, 256, None, 100, "cpu", "float32"),
    "paper": Scale("paper", 1.0, 16, 2048, None, TABLE1_KV_BYTES, 400, "cuda", "float16"),
}


def add_common_args(p) -> None:
    p.add_argument("--scale", choices=list(SCALES), default="small")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: the scale's (small: cpu, paper: cuda)")
    p.add_argument("--model", default=None, help="HF model dir, 'bundled' (SmolLM2-135M), or a config run with dummy "
                   "weights: 'tiny' (small-scale default: 2-layer Llama, hidden 64), 'opt-13b' (paper-scale "
                   "default), 'llama-13b'")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help=f"KV budget (paper scale default {TABLE1_KV_BYTES}: Table 1, OPT-13B on A100-40GB)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool in blocks (overrides the byte budget)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per trace point (default: the scale's)")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="request rates (req/s) to sweep")
    p.add_argument("--traces", nargs="+", default=None, choices=["sharegpt", "alpaca"])
    p.add_argument("--systems", nargs="+", default=None, choices=list(SYSTEMS))
    p.add_argument("--max-point-seconds", type=float, default=math.inf,
                   help="wall limit per trace point; a point that hits it counts as not sustained")
    p.add_argument("--rates-for", nargs="+", default=[], metavar="SYSTEM=R1,R2",
                   help="per-system rates (req/s), e.g. paged=4,6,8 orca-max=1,2; overrides --rates for that system")
    p.add_argument("--point-slack-seconds", type=float, default=math.inf,
                   help="a point also stops (not sustained) this long after its trace's last arrival")
    p.add_argument("--give-up-early", action="store_true",
                   help="stop a point once its normalized latency is sure to end over the sustained threshold "
                        "(saves GPU time; the point then shows no latency, only 'not sustained')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", required=True)


def rates_for(args, system: str) -> list[float] | None:
    """The rates `--rates-for` gives `system`, else `--rates` (None: the figure's defaults)."""
    for item in getattr(args, "rates_for", None) or []:
        name, _, vals = item.partition("=")
        if name not in SYSTEMS or not vals:
            raise ValueError(f"--rates-for takes SYSTEM=R1,R2 with SYSTEM in {list(SYSTEMS)}, got {item!r}")
        if name == system:
            return [float(v) for v in vals.split(",")]
    return args.rates


CONFIGS = {"opt-13b": OPT_13B, "llama-13b": LLAMA_13B, "tiny": TINY_LLAMA}


def model_dir(name: str | None, scale: Scale) -> tuple[str | None, bool]:
    """(model path, dummy weights?) — 'bundled' (the bundled model), a given dir, or a config
    ('tiny', 'opt-13b', 'llama-13b') saved with transformers and run with dummy weights."""
    key = (name or ("tiny" if scale.name == "small" else "opt-13b")).lower()
    if key == "bundled":
        return None, False
    if key not in CONFIGS:
        return name, False
    from pagedllm.cache_dir import pagedllm_cache_dir

    path = str(pagedllm_cache_dir("paper-configs") / key)
    if not os.path.exists(os.path.join(path, "config.json")):
        import transformers

        cls = transformers.OPTConfig if key == "opt-13b" else transformers.LlamaConfig
        cfg = cls(**CONFIGS[key])
        cfg.save_pretrained(path)
    return path, True


def make_engine(args, system: str, *, block_size: int | None = None, num_blocks: int | None = None,
                max_num_seqs: int = 256):
    """An LLMEngine for `system` at the scale of `args`; only the KV manager and batching differ between systems."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    scale = SCALES[args.scale]
    path, dummy = model_dir(args.model, scale)
    manager, batching = SYSTEMS[system]
    kw: dict[str, Any] = {
        "model": path, "device": args.device or scale.device, "dtype": scale.dtype if (args.device or scale.device) != "cpu" else "float32",
        "block_size": block_size or scale.block_size, "max_model_len": scale.max_model_len, "max_num_seqs": max_num_seqs,
        "swap_space": 0.5 if scale.name == "small" else 4,
        "seed": args.seed,
    }
    blocks = num_blocks or args.num_blocks or scale.num_blocks
    if blocks and not (scale.name == "paper" and args.num_blocks is None and num_blocks is None):
        kw["num_gpu_blocks_override"] = blocks
    else:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes or scale.kv_cache_memory_bytes
    if dummy:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    if manager != "paged":
        kw["kv_cache_manager"] = manager
    if batching != "iteration":
        kw["batching"] = batching
    return LLMEngine.from_engine_args(EngineArgs(**kw))


def switch_system(engine, system: str, *, prefix_caching: bool | None = None,
                  preemption_mode: str | None = None) -> None:
    """Turn an idle engine into `system`: a fresh KV manager of that kind over the same pool, and its batching.

    The model, kernels, pool and scheduler loop stay; only memory management (and batching) change, which is
    what §6.1 compares. Saves reloading the model per system (a 13B dummy load costs ~30 s of GPU time).
    `prefix_caching` and `preemption_mode`, when given, are set too: both are scheduler-side only.
    """
    from pagedllm.core.scheduler import make_kv_cache_manager

    if engine.has_unfinished_requests():
        raise RuntimeError("switch_system needs an idle engine (requests are still running)")
    manager, batching = SYSTEMS[system]
    cc, sc = engine.config.cache_config, engine.config.scheduler_config
    if prefix_caching is not None:
        cc.enable_prefix_caching = prefix_caching
    if preemption_mode is not None:
        cc.preemption_mode = preemption_mode
    if manager != "paged" and cc.enable_prefix_caching:
        raise ValueError(f"{system!r} cannot run with prefix caching on (contiguous reservations share nothing)")
    cc.kv_cache_manager, sc.batching = manager, batching
    engine.scheduler.block_manager = make_kv_cache_manager(sc, cc)


class EngineCache:
    """One engine at a time, built by `make_engine` and reused while the options that shape it (block size,
    pool, max_num_seqs) stay the same: a later `get` only switches the system, prefix caching and preemption
    mode (`switch_system`, a fresh KV manager over the same pool). A 13B dummy engine takes ~30 s to build on
    a GPU, so a figure of twelve configurations costs one build, not twelve. Use as a context manager."""

    def __init__(self, args) -> None:
        self.args = args
        self.engine = None
        self.key: tuple | None = None
        self.num_builds = 0

    def get(self, system: str, *, prefix_caching: bool = False, preemption_mode: str = "auto", **shape):
        key = tuple(sorted(shape.items()))
        if self.engine is None or key != self.key:
            self.close()  # one GPU holds one 13B model: free the old pool before building the next
            t0 = time.perf_counter()
            self.engine = make_engine(self.args, "paged", **shape)
            self.key = key
            self.num_builds += 1
            logger.info("engine ready in %.1f s (%d KV blocks, %s)", time.perf_counter() - t0,
                        self.engine.config.cache_config.num_gpu_blocks, dict(shape) or "default shape")
        switch_system(self.engine, system, prefix_caching=prefix_caching, preemption_mode=preemption_mode)
        return self.engine

    def close(self) -> None:
        engine, self.engine, self.key = self.engine, None, None
        if engine is not None:
            release(engine)
            del engine  # the last reference: the model and pool go now, before the next build
            free_device_memory()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def release(engine) -> None:
    """Shut an engine's executor down and free cached device memory. The model and pool are freed only once
    the caller holds no reference to `engine` (EngineCache drops its own before calling free_device_memory)."""
    ex = getattr(engine, "model_executor", None) or getattr(engine, "executor", None)
    if ex is not None and hasattr(ex, "shutdown"):
        ex.shutdown()
    del engine
    gc.unfreeze()  # the engine froze its start-up heap (engine/gc_heap.py); its cycles must be collectable
    free_device_memory()


def free_device_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def vocab_of(engine) -> int:
    return int(engine.hf_config.vocab_size)


def load_json(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=lambda x: None)
    os.replace(tmp, path)


def fmt(x: float, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finite(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None
