"""A GGUF file of a random-weight HF checkpoint made by llama.cpp's own converter (convert_hf_to_gguf.py from the
llama.cpp sources that the llama-cpp-python sdist vendors), with a placeholder vocabulary of the model's size
(no tokenizer ships with random checkpoints; benchmarks send token ids). Then `llama-quantize` makes the types.

    python random_gguf.py LLAMA_CPP_DIR HF_DIR OUT.gguf [--outtype f32]
"""
import sys
from pathlib import Path

llama_dir, hf_dir, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
outtype = sys.argv[sys.argv.index("--outtype") + 1] if "--outtype" in sys.argv else "f32"
sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
import convert_hf_to_gguf as conv  # noqa: E402
from conversion.base import TextModel  # noqa: E402


def placeholder_vocab(self) -> None:
    n = int(self.hparams["vocab_size"])
    w = self.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>" for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([1] * n)  # normal tokens
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)


# The model classes load lazily; their set_vocab ends in one of these (Gemma 3: the GPT-2 one without tokenizer.model).
TextModel._set_vocab_gpt2 = placeholder_vocab
TextModel._set_vocab_sentencepiece = placeholder_vocab
# Gemma's converter trims the embedding to the tokenizer's size, read from tokenizer.json: a stub of the full size,
# there only while converting (a real tokenizer.json would otherwise be what loaders of the directory read).
stub = Path(hf_dir) / "tokenizer.json"
if stub.exists():
    sys.exit(f"{stub} exists: this script is for random checkpoints without a tokenizer")
import json  # noqa: E402

n_vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
stub.write_text(json.dumps({"model": {"vocab": {f"<t{i}>": i for i in range(n_vocab)}}, "added_tokens": []}))
try:
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype]
    conv.main()
finally:
    stub.unlink()
