"""What a multimodal request carries across the process boundary to the engine core (plain data, picklable)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The key of an already processed multimodal prompt: ``{"prompt_token_ids": [...], MM_FEATURES_KEY: [...]}``.
MM_FEATURES_KEY = "mm_features"


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt positions [offset, offset + length) that an item's embeddings replace (vLLM's name)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultiModalFeature:
    """One image of a prompt: its processed pixel values (a CPU tensor [channels, height, width]), where its
    embeddings go in the prompt, and a hash of its content (`identifier`: the encoder cache key and the prefix
    cache's extra key for the blocks it touches)."""

    modality: str
    identifier: str
    pixel_values: Any  # torch.Tensor; untyped so importing this module needs no torch
    placeholder: PlaceholderRange

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions [start, end) include any of this item's placeholders."""
        return self.placeholder.offset < end and start < self.placeholder.end


def features_in_range(features: list[MultiModalFeature], start: int, end: int) -> list[MultiModalFeature]:
    """The items whose placeholders fall (at least partly) in positions [start, end)."""
    return [f for f in features if f.overlaps(start, end)]
