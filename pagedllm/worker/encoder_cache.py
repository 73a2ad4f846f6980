"""Image embeddings for the steps that hold image placeholder tokens (multimodal models).

An image is encoded (vision tower + projector) at the first chunk that reaches any of its placeholder positions,
and its embeddings stay here, keyed by the image's content hash, until a chunk consumes the end of its range:
chunked prefill may split an image's placeholders across steps, and each step takes the rows it covers. Every
chunk carries its images' pixel values, so an evicted or released entry (a preempted request recomputing its
prompt, an image shared by two requests) is simply encoded again.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagedllm.worker.model_input import SequenceChunk

#: Most images kept at once (least recently used dropped first): a bound for entries of aborted requests.
DEFAULT_MAX_ENTRIES = 64


class EncoderCache:
    """Per-image embeddings [placeholder tokens, hidden] by content hash, with vLLM's release-when-consumed rule."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images run through the encoder since start (tests, stats)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._entries

    def inputs_embeds(self, model: nn.Module, chunks: list[SequenceChunk], input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings: the token embeddings of `input_ids` (the chunks' tokens, flattened), with
        each image's rows written over the placeholder positions the chunks cover."""
        embeds = model.embed_input_ids(input_ids)
        self._encode_missing(model, chunks, embeds.device)
        base = 0
        consumed: set[str] = set()
        still_needed: set[str] = set()
        for c in chunks:
            start, end = c.start_pos, c.start_pos + len(c.token_ids)
            for f in c.mm_features or ():
                ph = f.placeholder
                image = self._entries[f.identifier]
                if image.shape[0] != ph.length:
                    raise ValueError(f"image {f.identifier[:12]}: the encoder gave {image.shape[0]} embeddings for "
                                     f"{ph.length} placeholder tokens; the processor and the model disagree.")
                lo, hi = max(start, ph.offset), min(end, ph.end)
                embeds[base + lo - start:base + hi - start] = image[lo - ph.offset:hi - ph.offset]
                (consumed if end >= ph.end else still_needed).add(f.identifier)
            base += len(c.token_ids)
        for identifier in consumed - still_needed:
            del self._entries[identifier]
        return embeds

    def _encode_missing(self, model: nn.Module, chunks: list[SequenceChunk], device: torch.device) -> None:
        """Run the encoder once over every image of the step not held yet (one batch per pixel shape)."""
        missing: dict[str, torch.Tensor] = {}
        used: set[str] = set()
        for c in chunks:
            for f in c.mm_features or ():
                used.add(f.identifier)
                if f.identifier in self._entries:
                    self._entries.move_to_end(f.identifier)
                else:
                    missing.setdefault(f.identifier, f.pixel_values)
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for identifier, pixels in missing.items():
            by_shape.setdefault(tuple(pixels.shape), []).append(identifier)
        for identifiers in by_shape.values():
            pixels = torch.stack([missing[i] for i in identifiers]).to(device, non_blocking=True)
            out = model.get_image_embeddings(pixels)
            for identifier, rows in zip(identifiers, out):
                self._entries[identifier] = rows
            self.num_encoded += len(identifiers)
        while len(self._entries) > max(self.max_entries, len(used)):  # this step's images are the newest
            self._entries.popitem(last=False)
