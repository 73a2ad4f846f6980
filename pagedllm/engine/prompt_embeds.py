"""vLLM's prompt-embedding inputs: ``{"prompt_embeds": tensor [num_tokens, hidden_size]}`` (its EmbedsPrompt).

An engine started with ``enable_prompt_embeds`` (``--enable-prompt-embeds``) runs such a prompt's rows in place of
token embeddings; the tokens it generates are embedded by the model's own table as usual. The request's sequence
holds placeholder token ids (``[0] * num_tokens``, what vLLM returns as an embeds prompt's ``prompt_token_ids``), and
a content hash of the embeddings keys its prefix-cache blocks (as an image's hash keys the blocks of its
placeholders), so two embeds prompts share cached blocks only when their embeddings are equal.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch

from pagedllm.multimodal.processor import hash_pixel_values

#: The key of an embeds prompt (vLLM's EmbedsPrompt).
PROMPT_EMBEDS_KEY = "prompt_embeds"
#: Keys an embeds prompt may carry besides PROMPT_EMBEDS_KEY.
_OTHER_KEYS = ("cache_salt",)
_FLAG = "enable_prompt_embeds=True (vLLM's --enable-prompt-embeds)"
#: How much of torch's own reason for a payload it cannot load goes back to the caller (built from their bytes).
_MAX_REASON_CHARS = 200


def is_embeds_prompt(prompt: Any) -> bool:
    """Whether `prompt` is an embeds prompt (a dict with ``prompt_embeds``)."""
    return isinstance(prompt, dict) and PROMPT_EMBEDS_KEY in prompt


def checked_prompt_embeds(prompt: dict, enabled: bool, hidden_size: int, max_seq_len: int,
                          keep_last: int | None = None) -> torch.Tensor:
    """An embeds prompt's tensor [num_tokens, hidden_size] (a leading batch dimension of 1 squeezed, as vLLM),
    its last `keep_last` rows when given (truncate_prompt_tokens); a ValueError naming what is wrong and what is
    allowed: the engine's flag, the prompt's other keys, the tensor's type, rank, size, dtype and length (at most
    `max_seq_len` - 1 rows: one token must still fit)."""
    if not enabled:
        raise ValueError(f"prompt_embeds inputs are off in this engine: start it with {_FLAG} to pass "
                         f"{{'prompt_embeds': tensor}} prompts.")
    other = sorted(set(prompt) - {PROMPT_EMBEDS_KEY, *_OTHER_KEYS})
    if other:
        raise ValueError(f"an embeds prompt carries 'prompt_embeds' (and optionally {list(_OTHER_KEYS)}), not "
                         f"{other}: give the prompt as embeddings or as text/token ids, not both.")
    embeds = prompt[PROMPT_EMBEDS_KEY]
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor of shape [num_tokens, hidden_size={hidden_size}], "
                         f"got {type(embeds).__name__}.")
    if embeds.layout != torch.strided:
        raise ValueError(f"prompt_embeds must be a dense tensor, got layout {embeds.layout}; call .to_dense().")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2:
        raise ValueError(f"prompt_embeds must have shape [num_tokens, hidden_size={hidden_size}] (or [1, num_tokens, "
                         f"hidden_size]), got shape {tuple(embeds.shape)}.")
    if not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must be a floating-point tensor (float32, float16 or bfloat16; it is cast "
                         f"to the model's dtype), got {embeds.dtype}.")
    n, width = embeds.shape
    if width != hidden_size:
        raise ValueError(f"prompt_embeds has hidden size {width}, but this model's is {hidden_size}: the shape must "
                         f"be [num_tokens, {hidden_size}].")
    if n == 0:
        raise ValueError("prompt_embeds is empty (0 rows): give at least one token's embedding.")
    if keep_last is not None and n > keep_last:
        embeds, n = embeds[n - keep_last:], keep_last
    if n >= max_seq_len:
        raise ValueError(f"prompt_embeds has {n} rows (prompt tokens), but this engine fits at most "
                         f"{max_seq_len - 1} prompt tokens (max_model_len and the KV pool) plus one generated token.")
    return embeds


def as_model_input(embeds: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows the engine keeps for the request: on the CPU, contiguous, cast to the model's dtype (as vLLM does,
    so callers need not know the server's --dtype)."""
    return embeds.detach().to(device="cpu", dtype=dtype).contiguous()


def embeds_identifier(embeds: torch.Tensor) -> str:
    """The prefix cache's extra key for the blocks of an embeds prompt: a hash of its dtype, shape and bytes (the
    image path's content hash)."""
    return "prompt_embeds:" + hash_pixel_values(embeds)


def load_prompt_embeds(data: str | bytes, param: str = "prompt_embeds") -> torch.Tensor:
    """vLLM's wire format: base64 of a ``torch.save``d tensor → the tensor (CPU, dense). ValueError for a payload
    that is not base64 or not one tensor."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"{param} must be base64 of a torch.save()d tensor; it is not valid base64 ({e}).") from None
    # weights_only=True: torch's restricted unpickler, which builds tensors and plain containers only and never
    # imports or calls anything else, so a request cannot run code through a crafted pickle (as vLLM loads them).
    # The sparse-invariant check stops a crafted sparse tensor from indexing out of bounds in to_dense().
    with torch.sparse.check_sparse_tensor_invariants():
        try:
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # torch raises many types for bytes it cannot read; all mean a bad payload
            reason = (str(e).strip() or type(e).__name__)[:_MAX_REASON_CHARS]
            raise ValueError(f"{param} could not be loaded as a torch.save()d tensor: {reason}") from None
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{param} must hold one tensor (torch.save(tensor, buffer)), got "
                             f"{type(tensor).__name__}.")
        if tensor.layout != torch.strided:
            try:
                tensor = tensor.to_dense()
            except Exception as e:
                raise ValueError(f"{param}: its sparse tensor is malformed: {str(e)[:_MAX_REASON_CHARS]}") from None
    return tensor


def check_takes_prompt_embeds(model_class: type) -> None:
    """ValueError at start-up for enable_prompt_embeds on a model class that cannot run input embeddings (it needs
    ``embed_input_ids`` and a forward taking ``inputs_embeds``: the Llama and Gemma families and LLaVA)."""
    if not callable(getattr(model_class, "embed_input_ids", None)):
        raise ValueError(f"enable_prompt_embeds: {model_class.__name__} does not take input embeddings; prompt "
                         f"embeddings are supported for the Llama family (Llama, Mistral, Qwen2/3, Phi-3, Mixtral, "
                         f"Qwen MoE), the Gemma family (Gemma 1/2/3) and LLaVA. Start the engine without --enable-prompt-embeds for this model.")
