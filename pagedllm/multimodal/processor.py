"""vLLM's ``multi_modal_data`` → token ids with expanded placeholders, pixel values and placeholder ranges.

The model's own Hugging Face processor (``AutoProcessor`` from the model directory) expands each ``<image>`` of the
prompt text into the image's placeholder tokens and turns the images into pixel values; this module validates the
input, calls it, finds each image's placeholder range and hashes each image's pixel values (the encoder cache key
and the prefix cache's extra key).
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

from pagedllm.multimodal.inputs import MM_FEATURES_KEY, MultiModalFeature, PlaceholderRange
from pagedllm.json_object import parse_json_object


#: Architectures whose prompts may carry images (model/models/llava.py).
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)
#: Modalities a prompt's ``multi_modal_data`` may hold.
SUPPORTED_MODALITIES = ("image",)
#: vLLM's default ``limit_mm_per_prompt`` per modality.
DEFAULT_LIMIT_PER_PROMPT = 999


def is_multimodal_config(hf_config: Any) -> bool:
    """Whether a HF config's architecture takes images."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return bool(archs) and archs[0] in MULTIMODAL_ARCHITECTURES


def parse_limit_mm_per_prompt(value: str | dict | None) -> dict[str, int]:
    """vLLM's ``limit_mm_per_prompt`` (a dict, or its JSON text from the CLI) → {modality: most items per prompt}."""
    limits = {m: DEFAULT_LIMIT_PER_PROMPT for m in SUPPORTED_MODALITIES}
    if value is None or value == "":
        return limits
    if isinstance(value, str):
        value = parse_json_object("limit_mm_per_prompt", value, '{"image": 2}')
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be an object of modality → count, e.g. {{'image': 2}}; got "
                         f"{value!r}.")
    for modality, count in value.items():
        if modality not in SUPPORTED_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r}; allowed: "
                             f"{list(SUPPORTED_MODALITIES)}.")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an int >= 0, got {count!r}.")
        limits[modality] = count
    return limits


def has_multimodal_input(prompt: Any) -> bool:
    """Whether a prompt carries images: raw (``multi_modal_data``) or already processed (``mm_features``)."""
    return isinstance(prompt, dict) and (prompt.get("multi_modal_data") is not None
                                         or bool(prompt.get(MM_FEATURES_KEY)))


def text_only_error(hf_config: Any = None) -> ValueError:
    archs = list(getattr(hf_config, "architectures", None) or []) or [getattr(hf_config, "model_type", None)]
    which = f" ({archs[0]})" if archs[0] else ""
    return ValueError(f"this model{which} accepts only text, so a prompt cannot carry images (multi_modal_data, "
                      f"image content parts); image inputs need a multimodal model (supported: "
                      f"{', '.join(MULTIMODAL_ARCHITECTURES)}).")


def hash_pixel_values(pixel_values: Any) -> str:
    """A content hash of one image's pixel values (dtype, shape and bytes): equal images share it."""
    import torch

    t = pixel_values.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _as_image_list(data: Any) -> list[Any]:
    from PIL import Image

    images = data if isinstance(data, (list, tuple)) else [data]
    for i, img in enumerate(images):
        if not isinstance(img, Image.Image):
            where = "multi_modal_data['image']" + (f"[{i}]" if isinstance(data, (list, tuple)) else "")
            raise ValueError(f"{where} must be a PIL.Image.Image (or a list of them), got {type(img).__name__}.")
    return list(images)


class MultiModalProcessor:
    """The model's HF processor behind vLLM's prompt dicts; one per process that turns prompts into requests."""

    def __init__(self, model_dir: str, hf_config: Any, limits: dict[str, int] | None = None) -> None:
        from transformers import AutoProcessor

        try:
            self.hf_processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as e:
            raise ValueError(f"Could not load the multimodal processor (AutoProcessor) from {model_dir}: {e}") from e
        self.image_token = getattr(self.hf_processor, "image_token", None)
        if not self.image_token:
            raise ValueError(f"The processor in {model_dir} ({type(self.hf_processor).__name__}) names no image "
                             f"token; a LLaVA processor (processor_config.json with image_token) is needed.")
        self.image_token_id = int(getattr(hf_config, "image_token_id", None)
                                  or getattr(hf_config, "image_token_index", None)
                                  or self.hf_processor.tokenizer.convert_tokens_to_ids(self.image_token))
        self.limits = dict(limits or parse_limit_mm_per_prompt(None))
        # One call at a time: a fast tokenizer shared by threads can fail with "Already borrowed" (the server
        # processes requests on worker threads).
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model_dir: str | Path, hf_config: Any = None,
                  limit_mm_per_prompt: str | dict | None = None) -> MultiModalProcessor | None:
        """The processor of a multimodal model directory; None for a text-only model."""
        limits = parse_limit_mm_per_prompt(limit_mm_per_prompt)  # a bad value fails for any model
        if hf_config is None:
            from pagedllm.model.loader import load_config

            hf_config = load_config(model_dir)
        if not is_multimodal_config(hf_config):
            return None
        return cls(str(model_dir), hf_config, limits)

    @property
    def chat_template(self) -> str | None:
        """The processor's own chat template (LLaVA checkpoints keep it there), if any."""
        return getattr(self.hf_processor, "chat_template", None) or None

    def check_item_count(self, modality: str, count: int) -> None:
        limit = self.limits.get(modality, DEFAULT_LIMIT_PER_PROMPT)
        if count > limit:
            raise ValueError(f"the prompt has {count} {modality}s, more than this engine takes per prompt: at most "
                             f"{limit} (limit_mm_per_prompt, vLLM's --limit-mm-per-prompt).")

    def process(self, prompt: dict, add_special_tokens: bool = True) -> dict:
        """A prompt dict with ``multi_modal_data`` → ``{"prompt", "prompt_token_ids", "mm_features"}`` (other keys,
        e.g. ``cache_salt``, kept). Raises ValueError naming what is wrong. A prompt already processed is returned
        as it is."""
        if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
            return prompt
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': PIL.Image}}, got "
                             f"{type(data).__name__}.")
        unknown = sorted(set(data) - set(SUPPORTED_MODALITIES))
        if unknown:
            raise ValueError(f"multi_modal_data: modality {unknown} is not supported; allowed: "
                             f"{list(SUPPORTED_MODALITIES)}.")
        if "prompt_token_ids" in prompt:
            raise ValueError("multi_modal_data needs a text prompt ({'prompt': '... <image> ...', "
                             "'multi_modal_data': ...}): the processor expands each image placeholder; "
                             "prompt_token_ids with images are not supported.")
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError(f"a multimodal prompt needs 'prompt' text, got {type(text).__name__}.")
        images = _as_image_list(data.get("image", []))
        self.check_item_count("image", len(images))
        n_marks = text.count(self.image_token)
        if n_marks != len(images):
            raise ValueError(f"the prompt has {n_marks} {self.image_token!r} placeholder(s) for {len(images)} "
                             f"image(s): put one {self.image_token!r} in the text where each image goes.")
        rest = {k: v for k, v in prompt.items() if k not in ("prompt", "multi_modal_data")}
        if not images:
            return {**rest, "prompt": text}
        try:
            rgb = [img.convert("RGB") for img in images]
            with self._lock:
                out = self.hf_processor(text=[text], images=rgb, return_tensors="pt",
                                        add_special_tokens=add_special_tokens)
        except Exception as e:
            raise ValueError(f"the image processor could not process the prompt's images: {e}") from e
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        pixel_values = out["pixel_values"]
        ranges = placeholder_ranges(ids, self.image_token_id, len(images))
        features = [MultiModalFeature("image", hash_pixel_values(pv), pv.contiguous(), r)
                    for pv, r in zip(pixel_values, ranges)]
        return {**rest, "prompt": text, "prompt_token_ids": ids, MM_FEATURES_KEY: features}


def placeholder_ranges(ids: list[int], image_token_id: int, num_images: int) -> list[PlaceholderRange]:
    """Each image's run of placeholder tokens in `ids` (images in order, equal runs: LLaVA-1.5's fixed count);
    a ValueError when the runs do not split evenly into `num_images` contiguous ones."""
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    if num_images == 0 or not positions or len(positions) % num_images:
        raise ValueError(f"the processed prompt has {len(positions)} image tokens for {num_images} image(s); "
                         f"cannot assign them.")
    n = len(positions) // num_images
    ranges = []
    for k in range(num_images):
        run = positions[k * n:(k + 1) * n]
        if run[-1] - run[0] != n - 1:
            raise ValueError("an image's placeholder tokens are not contiguous in the processed prompt; write "
                             "the image token only where the processor expands it.")
        ranges.append(PlaceholderRange(run[0], n))
    return ranges


def prepare_multimodal_prompt(prompt: Any, processor: MultiModalProcessor | None, hf_config: Any) -> Any:
    """`prompt` with raw ``multi_modal_data`` processed (ids, pixel values, placeholder ranges); other prompts as
    they are. A ValueError for images sent to a text-only model (`processor` None)."""
    if not has_multimodal_input(prompt):
        return prompt
    if processor is None:
        raise text_only_error(hf_config)
    return processor.process(prompt)


def checked_features(prompt: Any, token_ids: list[int], processor: MultiModalProcessor | None,
                     hf_config: Any) -> list[MultiModalFeature]:
    """A processed prompt's images, checked against its token ids (each placeholder range inside the prompt and
    made of the image token, ranges apart, the per-prompt limit); [] for a prompt without images."""
    if not has_multimodal_input(prompt):
        return []
    if processor is None:
        raise text_only_error(hf_config)
    if prompt.get("multi_modal_data") is not None:
        raise ValueError("the prompt's multi_modal_data was not processed; call MultiModalProcessor.process first.")
    features = list(prompt[MM_FEATURES_KEY])
    if not all(isinstance(f, MultiModalFeature) for f in features):
        raise ValueError(f"{MM_FEATURES_KEY} must be a list of MultiModalFeature (MultiModalProcessor.process "
                         f"makes them).")
    for modality in {f.modality for f in features}:
        processor.check_item_count(modality, sum(f.modality == modality for f in features))
    prev_end = 0
    for f in sorted(features, key=lambda f: f.placeholder.offset):
        ph = f.placeholder
        if ph.length < 1 or ph.offset < prev_end or ph.end > len(token_ids):
            raise ValueError(f"image placeholder range [{ph.offset}, {ph.end}) does not fit the prompt's "
                             f"{len(token_ids)} tokens (or overlaps another image's).")
        if any(t != processor.image_token_id for t in token_ids[ph.offset:ph.end]):
            raise ValueError(f"image placeholder range [{ph.offset}, {ph.end}) holds tokens other than the image "
                             f"token ({processor.image_token_id}).")
        prev_end = ph.end
    return features
