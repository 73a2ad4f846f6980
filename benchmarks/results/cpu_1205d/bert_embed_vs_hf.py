"""BERT-base-shaped random encoder (12 layers, hidden 768): LLM.embed against transformers' BertModel on the same
weights and token ids, CLS pooling + L2 norm, float32, 2 threads. transformers runs padded batches of 32 prompts
(its usual use through sentence-transformers), pagedllm the engine's own steps. Same prompts, alternating, best of 2.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/results/cpu_1205d/bert_embed_vs_hf.py [num_prompts]
"""
import sys, tempfile, time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_encoder_models import save_bert_tokenizer  # noqa: E402

from pagedllm import LLM  # noqa: E402

torch.set_num_threads(2)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
d = Path(tempfile.mkdtemp())
tok = save_bert_tokenizer(d)
cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                              intermediate_size=3072, max_position_embeddings=512)
torch.manual_seed(0)
hf = transformers.BertModel(cfg).eval()
hf.save_pretrained(d)
g = torch.Generator().manual_seed(1)
lens = torch.randint(16, 129, (n,), generator=g).tolist()
prompts = [[2] + torch.randint(5, len(tok), (L - 2,), generator=g).tolist() + [3] for L in lens]


def run_hf():
    out = []
    with torch.inference_mode():
        for i in range(0, n, 32):
            batch = prompts[i:i + 32]
            m = max(map(len, batch))
            ids = torch.tensor([p + [0] * (m - len(p)) for p in batch])
            mask = torch.tensor([[1] * len(p) + [0] * (m - len(p)) for p in batch])
            h = hf(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
            out.append(F.normalize(h, dim=-1))
    return torch.cat(out)


llm = LLM(model=str(d), dtype="float32", max_num_seqs=64)
inputs = [{"prompt_token_ids": p} for p in prompts]


def run_pagedllm():
    return torch.stack([torch.tensor(o.outputs.embedding) for o in llm.embed(inputs, use_tqdm=False)])


best = {"pagedllm": 1e9, "hf": 1e9}
for _ in range(2):
    for name, fn in (("pagedllm", run_pagedllm), ("hf", run_hf)):
        t0 = time.perf_counter(); res = fn(); best[name] = min(best[name], time.perf_counter() - t0)
        if name == "pagedllm": ours = res
        else: ref = res
tokens = sum(lens)
print(f"{n} prompts, {tokens} tokens (16-128 each), BERT-base shape, float32, 2 threads")
for k, v in best.items():
    print(f"{k:9s} {v:6.2f} s  {n / v:7.1f} prompts/s  {tokens / v:8.0f} tok/s")
print(f"ratio pagedllm/hf (prompts/s): {best['hf'] / best['pagedllm']:.2f}x; max |cos - 1| between the two: "
      f"{(1 - (ours * ref).sum(-1)).abs().max().item():.2e}")
