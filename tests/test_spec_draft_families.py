"""Self-speculation (`draft_model`: the target's own first layers) on every decoder family: the draft must be the
target's inner model cut after n layers, with the model's own embedding scaling (Gemma's normalizer, Granite's
multiplier) and layer structure (OLMo 2's post-norms, GPT-NeoX's parallel residual).

Each tiny transformers model has the outputs of its layers past the first zeroed (attention output and MLP down
projections, weights and biases), so those layers pass the residual stream through unchanged: the one-layer draft
then computes exactly what the whole model does, and every drafted token must be accepted. A draft that skipped an
embedding scale or ran a layer the wrong way would propose other tokens. Greedy outputs must equal transformers'.
"""
from __future__ import annotations

import pytest
import torch
from test_models_hf import PROMPT_LENS, Family, _random_model, build_from_model
from test_models_hf_layernorm_families import FAMILIES as LAYERNORM_FAMILIES
from test_models_hf_llama_variants import FAMILIES as LLAMA_VARIANTS

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128)
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE),
    # sqrt(hidden) = 8 on the embeddings: a draft without the normalizer proposes other tokens
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", {**_LLAMA_LIKE, "head_dim": 16}),
    "granite": LLAMA_VARIANTS["granite"],
    "olmo2": LLAMA_VARIANTS["olmo2"],
    "gpt-neox": LAYERNORM_FAMILIES["gpt-neox"],
}
# The projections whose outputs join the residual stream, by transformers' module names.
_OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "attention.dense", "dense_4h_to_h")
MAX_TOKENS = 12


def _layers_past_first_pass_through(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            parts = name.split(".")
            if "layers" not in parts:
                continue
            layer = int(parts[parts.index("layers") + 1])
            if layer > 0 and any(f".{proj}." in f".{name}" for proj in _OUTPUT_PROJECTIONS):
                param.zero_()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_layer_draft_of_a_pass_through_model_is_always_accepted(name: str, tmp_path) -> None:
    family = FAMILIES[name]
    model = _random_model(Family(family.config_cls, family.model_cls, {**family.kwargs, "num_hidden_layers": 3}))
    _layers_past_first_pass_through(model)
    built = build_from_model(model, tmp_path, PROMPT_LENS[:4])
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", device="cpu",
              num_gpu_blocks_override=64, block_size=4, swap_space=0.01,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1,
                                  "draft_length_policy": "fixed"})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in built.prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [r[:MAX_TOKENS] for r in built.reference]
    stats = llm.llm_engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], name
