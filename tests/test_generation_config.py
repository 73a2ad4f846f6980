"""vLLM's --generation-config / --override-generation-config (engine/generation_defaults.py): the model's
generation_config.json supplies the sampling defaults of calls that leave them unset."""
from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.generation_defaults import default_sampling_params
from tiny_models import save_tiny_llama

WRITTEN = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 7,
           "do_sample": True, "eos_token_id": 2}


def _model_with_generation_config(tmp_path) -> str:
    model_dir = save_tiny_llama(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(WRITTEN))
    return model_dir


def test_defaults_come_from_the_file_the_override_or_nowhere(tmp_path):
    model_dir = _model_with_generation_config(tmp_path)
    assert default_sampling_params(model_dir) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                  "repetition_penalty": 1.1, "max_tokens": 7}
    assert default_sampling_params(model_dir, "vllm") == {}
    assert default_sampling_params(model_dir, "vllm", '{"temperature": 0.2}') == {"temperature": 0.2}
    assert default_sampling_params(model_dir, override={"max_new_tokens": 3})["max_tokens"] == 3
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert default_sampling_params(model_dir, str(other)) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="keys must be among"):
        default_sampling_params(model_dir, override={"do_sample": True})
    with pytest.raises(ValueError, match="JSON object"):
        default_sampling_params(model_dir, override="{temperature: 1}")
    with pytest.raises(ValueError, match="is not a folder"):
        default_sampling_params(model_dir, str(tmp_path / "missing"))


def test_llm_uses_the_model_defaults_when_given_no_sampling_params(tmp_path):
    model_dir = _model_with_generation_config(tmp_path)
    kw = dict(model=model_dir, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=256)
    llm = LLM(**kw)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.6, 0.9, 20, 1.1, 7)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs[0]
    assert 1 <= len(out.token_ids) <= 7
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 12  # explicit params stay as given
    plain = LLM(**kw, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)
    greedy = LLM(**kw, override_generation_config={"temperature": 0.0}).get_default_sampling_params()
    assert greedy.temperature == 0.0 and greedy.repetition_penalty == 1.1  # the file still gives the rest
