"""Images in chat messages: OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` parts (and,
offline, `{"type": "image", "image": <PIL image / bytes / URL / path>}` and vLLM's `image_pil`)
become the `{"type": "image"}` parts that chat templates render as an image placeholder; the
images themselves are collected in the order the placeholders appear.
"""

from __future__ import annotations

from typing import Any

from baryon.multimodal.processor import ImageError

IMAGE_PART_TYPES = ("image_url", "image", "image_pil")


def image_source(part: dict[str, Any]) -> Any:
    """The image an image part names (a URL string, or offline an image object or path)."""
    kind = part.get("type")
    value = part.get(kind)
    if kind == "image_url":
        value = value.get("url") if isinstance(value, dict) else value
        if not isinstance(value, str):
            raise ImageError("an image_url part needs {'image_url': {'url': 'data:image/...;base64,...' or an "
                             "http(s) URL}}")
    if value is None:
        raise ImageError(f"a {kind!r} part needs its image under the key {kind!r}")
    return value


def split_images(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the conversation with every image part as {"type": "image"}, the images in order)."""
    images, rendered = [], []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    images.append(image_source(part))
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        rendered.append(message)
    return rendered, images
