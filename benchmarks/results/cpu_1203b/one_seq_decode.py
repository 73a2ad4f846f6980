"""One sequence's decode speed at a long context (the bundled GGUF, served quantized): python one_seq_decode.py
PROMPT_TOKENS [OUTPUT_TOKENS]. The prompt is this repository's README.md tokens; the output greedy, EOS ignored.
Prints decode tok/s (first token to last) and a hash of the output tokens."""
import hashlib
import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams

n_prompt = int(sys.argv[1])
n_out = int(sys.argv[2]) if len(sys.argv) > 2 else 256
llm = LLM(max_model_len=4096, num_gpu_blocks_override=1024)
tok = llm.get_tokenizer()
text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
ids = tok.encode(text)[:n_prompt]
engine = llm.llm_engine
engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
times, tokens = [], []
while engine.has_unfinished_requests():
    for out in engine.step():
        times.append(time.perf_counter())
        tokens = out.outputs[0].token_ids
decode_s = times[-1] - times[0]
print(f"prompt {len(ids)} tokens, {len(tokens)} out: decode {(len(tokens) - 1) / decode_s:.1f} tok/s "
      f"({1e3 * decode_s / (len(tokens) - 1):.2f} ms/token); tokens {hashlib.sha1(str(list(tokens)).encode()).hexdigest()[:12]}")
