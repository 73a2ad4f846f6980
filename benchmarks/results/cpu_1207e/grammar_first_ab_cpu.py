"""Issue 19 on the CPU, in the GPU's regime: a host-bound engine (a 2-layer, 64-wide Llama with random weights and
the bundled tokenizer's 49 152-token vocabulary; one torch thread) under asynchronous scheduling. The 64
JSON-schema requests against their unconstrained twins (benchmarks/structured_outputs.py's _end_to_end), 3 rounds
each, in the tree this runs from (PYTHONPATH): run it alternately from two trees for an A/B (see README.md).
Usage: PYTHONPATH=<tree> python grammar_first_ab_cpu.py <tree>"""
from __future__ import annotations

import shutil
import sys
import tempfile

import torch
from transformers import LlamaConfig

tree = sys.argv[1]
sys.path.insert(0, f"{tree}/benchmarks")
from structured_outputs import _end_to_end  # noqa: E402

from pagedllm import LLM  # noqa: E402

torch.set_num_threads(1)
d = tempfile.mkdtemp()
LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True).save_pretrained(d)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"/work/main/.tok/{f}", d)
llm = LLM(model=d, load_format="dummy", dtype="float32", num_gpu_blocks_override=1024, max_num_seqs=64,
          max_model_len=1024, async_scheduling=True)
e = _end_to_end(llm, 64, 4)
print(f"{tree}: constrained {e['constrained_tok_s']:.0f} vs unconstrained {e['unconstrained_tok_s']:.0f} tok/s -> "
      f"{100 * e['ratio']:.1f} % (rounds {', '.join(f'{100 * x:.1f}' for x in e['round_ratios'])})", flush=True)
