"""LLaVA (LLaVA-1.5 style): a CLIP vision tower, a two-layer projector, and pagedllm's paged Llama language model.

The vision tower is transformers' own module (``AutoModel.from_config(vision_config)``, CLIPVisionModel for
LLaVA-1.5), run eagerly once per image at the image's first prefill chunk (worker/encoder_cache.py); the projector
maps the selected layer's patch features into the language model's embedding space, and the model runner writes
those rows over the image placeholder tokens' embeddings before the decoder layers run.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.models.weights import default_weight_loader

# Checkpoint prefixes → (part, prefix inside that part). Both layouts: llava-hf's (language_model.model.*,
# vision_tower.vision_model.*) and transformers >= 4.52's own (model.language_model.*, model.vision_tower.*).
_LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""), ("lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class LlavaMultiModalProjector(nn.Module):
    """linear_1 → activation → linear_2 (HF names), vision features → the language model's hidden size."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


def _check_config(config: Any, tp: TensorParallelGroup) -> None:
    if tp.size != 1:
        raise ValueError(f"LLaVA runs with tensor_parallel_size=1 only (its vision tower is not sharded); got "
                         f"{tp.size}.")
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported; allowed: 'default' "
                         f"(drop the CLS token), 'full'.")


class LlavaForConditionalGeneration(nn.Module):
    """`language_model`: the text model class the registry gives `text_config` (Llama for LLaVA-1.5)."""

    supports_multimodal = True
    loads_fp8_checkpoints = False

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import AutoModel

        from pagedllm.model.models.registry import get_model_class

        _check_config(config, tp)
        self.config = config
        text_config, vision_config = config.text_config, config.vision_config
        self.language_model = get_model_class(text_config)(text_config, tp, dtype)
        self.vision_tower = AutoModel.from_config(vision_config).to(dtype=dtype)
        layer = config.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.drop_cls = getattr(config, "vision_feature_select_strategy", "default") == "default"
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision_config.hidden_size * len(self.feature_layers), text_config.hidden_size,
            getattr(config, "projector_hidden_act", "gelu"), bool(getattr(config, "multimodal_projector_bias", True)),
            dtype)
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        from pagedllm.model.models.registry import get_model_class

        return get_model_class(config.text_config).sliding_windows(config.text_config)

    @property
    def tie_word_embeddings(self) -> bool:
        return self.language_model.tie_word_embeddings

    # -- images ------------------------------------------------------------------------------------------
    def get_image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, height, width] → [images, placeholder tokens per image, text hidden size]."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True, return_dict=True)
        feats = [out.hidden_states[i] for i in self.feature_layers]
        if self.drop_cls:
            feats = [f[:, 1:] for f in feats]
        return self.multi_modal_projector(torch.cat(feats, dim=-1))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    # -- the language model ----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` (a step with image rows): the embeddings to run instead of `input_ids`'."""
        return self.language_model.model(input_ids, positions, kv_caches, meta, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    # -- weights -------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A LLaVA checkpoint: the language model's tensors through its own loader, the vision tower's and the
        projector's by name; errors name a tensor that matches nothing, or what is missing."""
        own = dict(self.vision_tower.named_parameters(prefix="vision_tower"))
        own.update(self.multi_modal_projector.named_parameters(prefix="multi_modal_projector"))
        buffers = dict(self.vision_tower.named_buffers(prefix="vision_tower"))
        known = {**own, **buffers}
        loaded: set[str] = set()

        def language(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                target = _vision_or_projector_name(name, known)
                if target is None:
                    yield _language_name(name), tensor
                    continue
                if target in buffers:  # e.g. position_ids: rebuilt from the config
                    continue
                param = own.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                     f"{type(self).__name__}")
                default_weight_loader(param, tensor.to(param.dtype))
                loaded.add(target)

        self.language_model.load_weights(language(weights))
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision/projector tensors, e.g. {missing[:5]}")


def _language_name(name: str) -> str:
    for prefix, replacement in _LANGUAGE_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def _vision_or_projector_name(name: str, own: dict[str, Any]) -> str | None:
    """Our parameter name for a vision tower or projector tensor of either layout; None for the language model's."""
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            # llava-hf: vision_tower.vision_model.X; transformers 5's CLIPVisionModel has no vision_model level
            # (older ones do): whichever the installed module has.
            for candidate in (rest, rest.removeprefix("vision_model."), "vision_model." + rest):
                if "vision_tower." + candidate in own:
                    return "vision_tower." + candidate
            return "vision_tower." + rest
    for prefix in _PROJECTOR_PREFIXES:
        if name.startswith(prefix):
            return "multi_modal_projector." + name[len(prefix):]
    return None
