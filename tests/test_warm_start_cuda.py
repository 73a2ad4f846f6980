"""Issue 16's warm start on CUDA: after LLM() returns, no step builds a Triton kernel. Each model runs in a fresh
process (Triton keeps built kernels per process: an earlier test's build would hide a gap), under a varied
workload: prompts of 1 to 1 500 tokens beside up to ~100 decodes, long contexts (the split decode), and the sampling
options that pick kernel variants. The runner's CompileWatch (kernels/compile_watch.py) hears every build."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, random, sys
    import torch, transformers
    from pagedllm import LLM, SamplingParams

    kind, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    common = dict(vocab_size=2000, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **common))
    elif kind == "bamba":
        model = transformers.BambaForCausalLM(transformers.BambaConfig(
            num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
            mamba_d_state=64, mamba_d_conv=4, mamba_chunk_size=256, **common))
    elif kind == "jamba":  # a hybrid (eager prefill and mixed steps) with MoE layers: every tile height eagerly
        model = transformers.JambaForCausalLM(transformers.JambaConfig(
            num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=8, num_experts_per_tok=2, mamba_d_state=16, mamba_expand=2,
            mamba_dt_rank=16, **common))
    else:  # a Qwen3-MoE: the fused MoE kernels' tile variants by tokens per expert
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_hidden_layers=2, head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
            norm_topk_prob=True, **common))
    model.to(torch.bfloat16).save_pretrained(path)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", device="cuda", max_model_len=2048,
              max_num_seqs=128, gpu_memory_utilization=0.3)
    watch = llm.llm_engine.executor.driver_worker.model_runner.compile_watch
    rng = random.Random(0)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=0.7, top_p=0.9, seed=2),
             dict(temperature=1.0, top_k=20, seed=3), dict(temperature=0.0, repetition_penalty=1.2),
             dict(temperature=0.0, logprobs=3), dict(temperature=0.9, n=2, seed=4),
             dict(temperature=0.6, presence_penalty=0.5, frequency_penalty=0.3, seed=5)]
    prompts, params = [], []
    for i in range(120):
        n = rng.choice([1, 3, 7, 16, 33, 100, 257, 600, 1500]) if i % 4 else rng.randint(1, 1500)
        prompts.append({"prompt_token_ids": [rng.randrange(3, 2000) for _ in range(n)]})
        params.append(SamplingParams(max_tokens=min(rng.choice([1, 5, 40, 200]), 2048 - n), ignore_eos=True,
                                     **kinds[i % len(kinds)]))
    llm.generate(prompts, params, use_tqdm=False)
    print("RESULT " + json.dumps({"watching": watch._installed,
                                  "builds": [[e.kernel, e.specialization[:400]] for e in watch.events]}))
""")


@pytest.mark.parametrize("kind", ["llama", "bamba", "qwen3-moe", "jamba"])
def test_no_triton_build_after_the_warm_start(kind: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT, kind, str(tmp_path / kind)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(next(ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("RESULT "))[7:])
    assert got["watching"]
    assert got["builds"] == [], "\n".join(f"{k}: {s}" for k, s in got["builds"])
