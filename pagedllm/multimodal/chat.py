"""Chat messages with image content parts (OpenAI's ``image_url``, vLLM's offline ``image_pil``) → the prompt text
the chat template renders, with the model's image placeholder where each image goes, and the images in order.

Templates come in vLLM's two content formats: "string" templates see each message's content as text, so the
placeholders go in front of it ("<image>\\n" per image, then the text, as vLLM writes them); "openai" templates
iterate over the content parts themselves (llava-hf's own templates) and see ``{"type": "image"}`` parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.chat_content_format import detect_content_format, resolve_content_format
from pagedllm.tokenizer import check_chat_template_options, render_chat_template

#: Content part types that carry an image.
IMAGE_PART_TYPES = ("image_url", "image_pil")
_TEXT_PART_TYPES = ("text", "input_text")


@dataclass(frozen=True)
class ImageRef:
    """An image of a message: a URL to load, or a PIL image given directly (offline ``image_pil``)."""

    url: str | None = None
    image: Any = None


def has_image_parts(messages: Any) -> bool:
    """Whether any message's content holds an image part."""
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content):
            return True
    return False


def needs_multimodal_render(messages: Any, multimodal_model: bool) -> bool:
    """Whether a conversation goes through `render_multimodal_chat`: it has an image part, or (a multimodal model)
    any part other than text, which that path names in its error."""
    if has_image_parts(messages):
        return True
    if not multimodal_model or not isinstance(messages, list):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(not isinstance(p, dict) or p.get("type") not in _TEXT_PART_TYPES for p in m["content"])
               for m in messages)


def content_format(template: str | None) -> str:
    """vLLM's content format of a chat template: "openai" when it iterates over content parts, else "string"."""
    return detect_content_format(template)


def _image_ref(part: dict, where: str) -> ImageRef:
    if part["type"] == "image_pil":
        from PIL import Image

        img = part.get("image_pil")
        if not isinstance(img, Image.Image):
            raise ValueError(f"{where}: an image_pil part needs 'image_pil': a PIL.Image.Image, got "
                             f"{type(img).__name__}.")
        return ImageRef(image=img)
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: an image_url part needs 'image_url': {{'url': 'data:image/...;base64,...' or "
                         f"'https://...'}}.")
    return ImageRef(url=url)


def split_image_parts(messages: list[dict], image_token: str, fmt: str) -> tuple[list[dict], list[ImageRef]]:
    """Messages as the template takes them (format `fmt`: "string" or "openai") and their images in order; a
    ValueError names a malformed part or a type that is neither text nor an image."""
    out: list[dict] = []
    images: list[ImageRef] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            if fmt == "openai" and isinstance(content, str):  # such templates iterate over every message's parts
                m = {**m, "content": [{"type": "text", "text": content}]}
            out.append(m)
            continue
        texts: list[str] = []
        parts: list[dict] = []
        n_images = 0
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
                texts.append(part["text"])
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_PART_TYPES:
                images.append(_image_ref(part, where))
                parts.append({"type": "image"})
                n_images += 1
            else:
                raise ValueError(f"{where}: content part type {kind!r} is not supported; allowed: text, "
                                 f"{', '.join(IMAGE_PART_TYPES)}.")
        if fmt == "openai":
            out.append({**m, "content": parts})
        else:
            text = "\n".join(texts)
            out.append({**m, "content": "\n".join([image_token] * n_images + ([text] if texts else []))})
    return out, images


def render_multimodal_chat(tokenizer: Any, messages: list[dict], image_token: str, chat_template: str | None,
                           add_generation_prompt: bool = True, tools: list[dict] | None = None,
                           continue_final_message: bool = False,
                           chat_template_kwargs: dict[str, Any] | None = None,
                           content_format: str = "auto") -> tuple[str, list[ImageRef]]:
    """(prompt text with one `image_token` per image, the images in order) of a conversation with image parts,
    rendered by `chat_template` (or the tokenizer's) in `content_format` ("auto": the template's own)."""
    check_chat_template_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    fmt = resolve_content_format(content_format, template if isinstance(template, str) else None)
    msgs, images = split_image_parts(messages, image_token, fmt)
    if fmt == "string":
        text = render_chat_template(tokenizer, msgs, add_generation_prompt, chat_template, tools,
                                    continue_final_message, chat_template_kwargs, content_format="string")
    else:
        text = tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template,
            continue_final_message=continue_final_message, **({"tools": tools} if tools else {}),
            **(chat_template_kwargs or {}))
    if text.count(image_token) != len(images):
        raise ValueError(f"the chat template rendered {text.count(image_token)} {image_token!r} placeholder(s) for "
                         f"{len(images)} image(s); use a template that places one per image part.")
    return text, images
