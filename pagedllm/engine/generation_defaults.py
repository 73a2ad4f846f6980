"""vLLM's --generation-config: the sampling defaults a model's creator wrote into its generation_config.json.

With ``generation_config="auto"`` (vLLM's default) the model directory's file supplies the defaults of a request
that leaves them unset (``LLM.generate`` without SamplingParams, a server request without the field):
temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as a cap on every request's max_tokens.
``"vllm"`` ignores the file; a folder path reads that folder's file instead. ``override_generation_config`` (a
JSON object of those keys) wins over the file.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from pagedllm.json_object import parse_json_object

logger = logging.getLogger("pagedllm")

#: generation_config.json keys that become sampling defaults → their SamplingParams names (as vLLM picks them).
SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                 "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def load_generation_config(folder: str | Path) -> Any:
    """The folder's generation_config.json as a transformers GenerationConfig, or None when there is none (its eos
    ids also apply, as in vLLM)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError):
        return None


def _written_keys(folder: str | Path) -> dict[str, Any]:
    """What the folder's generation_config.json sets apart from transformers' defaults (vLLM's to_diff_dict)."""
    config = load_generation_config(folder)
    return {} if config is None else config.to_diff_dict()


def parse_override(override: str | dict | None) -> dict[str, Any]:
    """``override_generation_config`` as a dict of known keys; a ValueError names what is allowed."""
    if override is None:
        return {}
    override = parse_json_object("override_generation_config", override, '{"temperature": 0.6}')
    unknown = sorted(set(override) - SAMPLING_KEYS.keys())
    if unknown:
        raise ValueError(f"override_generation_config keys must be among {sorted(SAMPLING_KEYS)}; got {unknown}.")
    return override


def default_sampling_params(model_dir: str | Path, generation_config: str = "auto",
                            override: str | dict | None = None) -> dict[str, Any]:
    """SamplingParams keyword defaults ({} when the model sets none), as vLLM derives them."""
    if generation_config == "vllm":
        written: dict[str, Any] = {}
    else:
        folder = Path(model_dir if generation_config == "auto" else generation_config)
        if not folder.is_dir():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json; "
                             f"{str(folder)!r} is not a folder.")
        written = _written_keys(folder)
    written.update(parse_override(override))
    defaults = {SAMPLING_KEYS[k]: v for k, v in written.items() if k in SAMPLING_KEYS and v is not None}
    if defaults:
        logger.info("Default sampling parameters from the model's generation config: %s (relaunch with "
                    "--generation-config vllm to ignore them)", defaults)
    return defaults
