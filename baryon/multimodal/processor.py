"""Images to what the engine reads: load each image (a PIL image, bytes, a data: URL, an http(s) URL
or, offline, a file path), cut it into patches with the checkpoint's own image processor
(transformers' AutoImageProcessor, from preprocessor_config.json), and expand each image's
placeholder token in the prompt to its number of tokens.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import urllib.request
from typing import Any

import numpy as np

from baryon.multimodal.inputs import ImageInput, MultiModalInputs

MAX_IMAGE_BYTES = 32 << 20  # an image fetched from a URL or decoded from a data: URL
FETCH_TIMEOUT_S = 10.0


class ImageError(ValueError):
    """An image that cannot be read or does not fit the prompt (the server answers 400)."""


def load_image(source: Any, allow_local_files: bool = True):
    """A PIL image (RGB) from a PIL image, bytes, a `data:image/...;base64,` URL, an http(s) URL or
    a file path (only where allow_local_files: the server refuses paths)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source if source.mode == "RGB" else source.convert("RGB")
    if isinstance(source, str) and source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header or not header[5:].startswith("image/"):
            raise ImageError(f"a data URL image must be data:image/<format>;base64,<data>; got {header[:40]!r}")
        try:
            source = base64.b64decode(payload, validate=True)
        except ValueError as e:
            raise ImageError(f"the data URL's base64 payload does not decode: {e}") from e
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        source = _fetch(source)
    elif isinstance(source, (str, os.PathLike)):
        if not allow_local_files:
            raise ImageError("image URLs must be data:image/...;base64 or http(s) URLs (file paths are not "
                             "read by the server)")
        try:
            with open(source, "rb") as f:
                source = f.read()
        except OSError as e:
            raise ImageError(f"cannot read the image file {str(source)!r}: {e}") from e
    if not isinstance(source, (bytes, bytearray)):
        raise ImageError(f"an image must be a PIL image, bytes, a data: URL, an http(s) URL or a file path; "
                         f"got {type(source).__name__}")
    if len(source) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is {len(source)} bytes; at most {MAX_IMAGE_BYTES} are read")
    try:
        image = Image.open(io.BytesIO(source))
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ImageError(f"the image data is not an image PIL can read: {e}") from e
    return image.convert("RGB")


def pixel_digest(image) -> bytes:
    """16 bytes naming a decoded RGB image: its size and pixels (hashing these, not the float32
    patches made of them, is 8x less to read: the patches took 0.64 s of a 4.5 s cProfile of 64
    448-pixel image requests on the H200 host)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(image.size, dtype=np.int64).tobytes())
    h.update(image.tobytes())
    return h.digest()


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise ImageError(f"cannot fetch the image {url!r}: {e}") from e
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image at {url!r} is over {MAX_IMAGE_BYTES} bytes")
    return data


def largest_image_tokens(model_path: str) -> int | None:
    """Placeholder tokens of the largest image the checkpoint's image processor makes (its
    `size.longest_edge` pixels, or `max_pixels`, in merged patches); None without a processor."""
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
    size = getattr(processor, "size", None)
    pixels = getattr(size, "longest_edge", None) or getattr(processor, "max_pixels", None)
    side = getattr(processor, "patch_size", None), getattr(processor, "merge_size", None)
    if not pixels or None in side:
        return None
    return int(pixels) // (side[0] * side[1]) ** 2


class ImageProcessor:
    """The checkpoint's image processor and its image placeholder token."""

    @classmethod
    def for_model(cls, model_path: str, hf_config: Any) -> ImageProcessor:
        """The processor of an image-and-text model; a model that reads no images is refused."""
        if getattr(hf_config, "vision_config", None) is None:
            raise ImageError(f"{hf_config.architectures[0]} does not read images; image prompts need an "
                             f"image-and-text model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5)")
        return cls(model_path, hf_config)

    def __init__(self, model_path: str, hf_config: Any) -> None:
        from transformers import AutoImageProcessor

        self.image_token_id = hf_config.image_token_id
        self.spatial_merge = hf_config.vision_config.spatial_merge_size
        try:
            self.hf_processor = AutoImageProcessor.from_pretrained(model_path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_path}: no image processor could be loaded (preprocessor_config.json): {e}") from e

    def process(self, images: list[Any], allow_local_files: bool = True) -> list[ImageInput]:
        loaded = [load_image(image, allow_local_files) for image in images]
        out = self.hf_processor(images=loaded, return_tensors="np")
        patches, grids = np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"])
        result, start = [], 0
        for t, h, w in grids.tolist():
            count = t * h * w
            result.append(ImageInput(patches=patches[start:start + count].tobytes(), patch_dim=patches.shape[1],
                                     grid=(t, h, w), num_tokens=count // self.spatial_merge ** 2,
                                     digest=pixel_digest(loaded[len(result)])))
            start += count
        return result

    def prompt(self, token_ids: list[int], images: list[Any], allow_local_files: bool = True
               ) -> tuple[list[int], MultiModalInputs]:
        """The prompt with its images' placeholders expanded, and its images' inputs."""
        if not images:
            raise ImageError("no images given")
        return self.expand(token_ids, self.process(images, allow_local_files))

    def expand(self, token_ids: list[int], images: list[ImageInput]) -> tuple[list[int], MultiModalInputs]:
        """The prompt with each image's placeholder (one image token, or a run of exactly its
        token count) expanded to its tokens, and what the request carries of its images."""
        runs = _runs(token_ids, self.image_token_id)
        if len(runs) != len(images):
            raise ImageError(f"the prompt has {len(runs)} image placeholder(s) (token {self.image_token_id}) "
                             f"for {len(images)} image(s): give one placeholder per image")
        expanded, offsets, index = [], [], 0
        for (start, length), image in zip(runs, images):
            if length not in (1, image.num_tokens):
                raise ImageError(f"an image placeholder of {length} tokens: give one image token per image "
                                 f"(or exactly its {image.num_tokens} tokens)")
            expanded.extend(token_ids[index:start])
            offsets.append(len(expanded))
            expanded.extend([self.image_token_id] * image.num_tokens)
            index = start + length
        expanded.extend(token_ids[index:])
        return expanded, MultiModalInputs(images=images, offsets=offsets, spatial_merge=self.spatial_merge)


def _runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in token_ids."""
    runs, i = [], 0
    while i < len(token_ids):
        if token_ids[i] == token:
            j = i
            while j < len(token_ids) and token_ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
