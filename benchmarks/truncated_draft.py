"""Write a draft checkpoint for speculative decoding: a model's first N decoder layers, with its embeddings, final
norm and lm_head, as an HF directory (its tokenizer files included). For the bundled GGUF model this is the one
draft that can be built here (no other checkpoint shares its tokenizer, and nothing can be downloaded):

    python benchmarks/truncated_draft.py OUT_DIR [--layers 8] [--model PATH] [--dtype bfloat16]

then `--speculative-config '{"model": "OUT_DIR", "num_speculative_tokens": 4}'`.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedllm.model.loader import prepare_model_dir

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def write_truncated(model: str | None, out: Path, layers: int, dtype: torch.dtype) -> Path:
    """The first `layers` decoder layers of `model` (an HF directory, a GGUF file, None: the bundled model)."""
    src = prepare_model_dir(model)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 0 < layers < total:
        raise ValueError(f"--layers must be in [1, {total - 1}] for a {total}-layer model, got {layers}.")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                m = LAYER.match(name)
                if m is None or int(m.group(1)) < layers:
                    t = handle.get_tensor(name)
                    tensors[name] = t.to(dtype) if t.is_floating_point() else t
    save_file(tensors, str(out / "model.safetensors"))
    config["num_hidden_layers"] = layers
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    out = write_truncated(args.model, args.out, args.layers, getattr(torch, args.dtype))
    print(f"wrote {out} ({args.layers} layers)")


if __name__ == "__main__":
    main()
