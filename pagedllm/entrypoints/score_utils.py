"""What `LLM.score` and the server's /v1/score and /rerank share: pairing the two sides, a cross-encoder's prompt
for a text pair, and the cosine similarity of two embeddings.

A pair's prompt (a cross-encoder: a classifier of one label) is the tokenizer's own pair encoding,
``tokenizer(text_1, text_pair=text_2)``, as in vLLM, where that encoding marks the boundary itself (a tokenizer
whose pair template adds special tokens, e.g. BERT's ``[SEP]`` or Llama's second ``<s>``). A tokenizer that only
concatenates the two (most byte-level BPE tokenizers of decoder models) gets ``text_1``'s tokens, its separator
token (``sep_token``, else ``eos_token``), then ``text_2``'s tokens without special tokens; with neither token,
the plain pair encoding.
"""
from __future__ import annotations

from typing import Any

import torch


def as_texts(data: Any, name: str) -> list[str]:
    """One side of a score call: a string or a list of strings (ValueError/TypeError naming `name`)."""
    if isinstance(data, str):
        return [data]
    if isinstance(data, (list, tuple)) and all(isinstance(t, str) for t in data):
        if not data:
            raise ValueError(f"{name} is empty: give a string or a non-empty list of strings.")
        return list(data)
    raise TypeError(f"{name} must be a string or a list of strings, got {type(data).__name__}.")


def score_pairs(n_1: int, n_2: int, names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[int, int]]:
    """The (index in side 1, index in side 2) pairs to score: 1→N (the one text against each of the others) or
    N→N (element by element); ValueError for other lengths."""
    a, b = names
    if n_1 < 1 or n_2 < 1:
        raise ValueError(f"{a if n_1 < 1 else b} is empty: give at least one text on each side.")
    if n_1 == 1:
        return [(0, j) for j in range(n_2)]
    if n_1 != n_2:
        raise ValueError(f"{a} has {n_1} texts and {b} has {n_2}: the lengths allowed are 1 and N (one text "
                         f"against each of N) or N and N (pairs element by element).")
    return [(i, i) for i in range(n_1)]


def score_prompt_ids(tokenizer: Any, text_1: str, text_2: str) -> list[int]:
    """A cross-encoder's prompt for the pair (text_1, text_2) (see the module docstring)."""
    return score_prompt(tokenizer, text_1, text_2)["prompt_token_ids"]


def score_prompt(tokenizer: Any, text_1: str, text_2: str) -> dict[str, list[int]]:
    """A cross-encoder's prompt for the pair as a token-id prompt: ``prompt_token_ids``, and the pair encoding's
    ``token_type_ids`` where its second segment has type 1 (BERT's; RoBERTa and decoder tokenizers have none)."""
    marks_pairs = tokenizer.num_special_tokens_to_add(pair=True) > tokenizer.num_special_tokens_to_add(pair=False)
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    if not marks_pairs and sep is not None:
        ids = [*tokenizer.encode(text_1), sep, *tokenizer.encode(text_2, add_special_tokens=False)]
        return {"prompt_token_ids": ids}
    encoded = tokenizer(text_1, text_pair=text_2)
    prompt = {"prompt_token_ids": list(encoded["input_ids"])}
    types = encoded.get("token_type_ids")
    if types is not None and any(types):
        prompt["token_type_ids"] = list(types)
    return prompt


def cosine_score(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine similarity of two embeddings (an embedding model's score)."""
    return float(torch.nn.functional.cosine_similarity(a.float().reshape(1, -1), b.float().reshape(1, -1))[0])
