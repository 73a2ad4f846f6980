"""Shared fixtures: the bundled model, its HF transformers reference, and test prompts."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The bundled Q4_1 GGUF runs quantized by default on the CPU; the suite's HF-parity tests compare the dequantized
# path token for token, so they keep it (tests/test_quantized_gguf.py asks for quantization='gguf' itself).
os.environ.setdefault("PAGEDLLM_GGUF_QUANTIZATION", "none")
# Every step checks the worker's persistent block-table rows against the block manager's tables
# (worker/block_table_rows.py): a table change that did not bump its version fails the test that made it.
os.environ.setdefault("PAGEDLLM_CHECK_BLOCK_TABLE_ROWS", "1")
# Without CUDA the Triton kernel tests run Triton's interpreter, whose mode is read when triton is imported, and
# `import transformers` imports triton: set it (triton_setup) before any test module can import either, so the
# kernel tests pass in any order (tests/test_fused_moe.py after tests/test_lora.py failed before).
import triton_setup  # noqa: E402,F401

from pagedllm.benchmarks.gguf_quant import FIXED_TEXT as _TEXT  # noqa: E402 (the same fixed prose)


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pagedllm.model.loader import prepare_model_dir

    return prepare_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer(str(default_model_dir))


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own loading of the same GGUF, float32: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model.gguf_loader import transformers_dense_gguf_kwargs
    from pagedllm.model.loader import default_model_path

    path = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 **transformers_dense_gguf_kwargs())
    return model.eval()


@pytest.fixture(scope="session")
def parity_prompts(tokenizer) -> list[list[int]]:
    """16 prompts from 1 to several hundred tokens."""
    texts = [
        "Hello",
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea,",
        "List three primary colors:",
        "In 1969, the first humans",
        "Translate to French: I love programming.",
        "The quick brown fox",
        "Water boils at a temperature of",
        "A haiku about autumn:\n",
        "Question: What is 12 times 12?\nAnswer:",
        "import numpy as np\nx = np.arange(10)\n",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts[0] = prompts[0][:1]  # a one-token prompt
    long_ids = tokenizer.encode(_TEXT * 6)
    for n in (60, 150, 300, 420):
        prompts.append(long_ids[:n] + tokenizer.encode(" In summary,"))
    return prompts


@pytest.fixture(scope="session")
def hf_greedy(hf_model, parity_prompts) -> list[list[int]]:
    """HF greedy continuations (max 24 new tokens, stopping at EOS) for each prompt, one at a time."""
    import torch

    outs = []
    with torch.inference_mode():
        for p in parity_prompts:
            ids = torch.tensor([p])
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                    pad_token_id=hf_model.config.eos_token_id)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core box: one thread avoids OpenMP spin contention (≈20× faster)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def kernels_by_isa():
    """The native CPU kernels built for every ISA level this CPU runs (``cpu_isa.ISA_LEVELS`` up to the detected
    one), by level; skips without a C compiler."""
    from pagedllm.kernels import cpu_isa, cpu_kernels

    detected = cpu_isa.isa_from_flags(cpu_isa.cpu_flags()) if cpu_isa._is_x86_64() else "portable"
    runnable = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(detected) + 1]
    built = {isa: cpu_kernels.load_cpu_kernels(isa) for isa in runnable}
    if any(k is None for k in built.values()):
        pytest.skip("no C compiler: the CPU path runs torch")
    return built
