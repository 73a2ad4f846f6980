"""Diagnostic (issue 19): llguidance's token table as `llguidance.hf.from_tokenizer` builds it (re-parsing the
tokenizer's JSON) vs the exact bytes the engine now gives it (`backends._TokenBytes`), on the bundled tokenizer."""
from __future__ import annotations

import llguidance
import llguidance.hf
import transformers

from pagedllm import LLM
from pagedllm.structured_output.backends import _TokenBytes

llm = LLM(num_gpu_blocks_override=16, max_model_len=128)
eng = llm.llm_engine
tok, vocab = eng.tokenizer, int(eng.hf_config.vocab_size)
ours = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tok, vocab, eng.eos_token_ids)), n_vocab=vocab)
ref = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=list(eng.eos_token_ids)[0])
diff = [i for i in range(vocab) if ours.decode_bytes([i]) != ref.decode_bytes([i])]
print(f"== transformers {transformers.__version__}: {len(diff)} of {vocab} tokens decode differently; e.g. "
      + ", ".join(f"{i}: {ours.decode_bytes([i])!r} vs {ref.decode_bytes([i])!r}" for i in diff[:5]), flush=True)
