"""What a request carries of its images into the engine core: each image's patches and grid and
where its placeholder tokens sit in the prompt (`MultiModalInputs`, sent as it is between the
server and engine-core processes), and what the engine derives from it (`RequestImages`): the
prompt's multimodal-RoPE positions and a digest of the pixels that keys the prefix cache (two
images of one size have the same placeholder tokens).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec
import numpy as np


class ImageInput(msgspec.Struct, frozen=True):
    patches: bytes  # [num_patches, patch_dim] float32, in the image processor's patch order
    patch_dim: int  # C * T * P * P
    grid: tuple[int, int, int]  # (t, h, w): the image's patch grid
    num_tokens: int  # its placeholder tokens: t * h * w / merge^2
    digest: bytes  # of the decoded image's size and RGB pixels (what the processor turned into patches)

    def patch_array(self) -> np.ndarray:
        """[num_patches, patch_dim] float32 (read-only, over the bytes)."""
        return np.frombuffer(self.patches, dtype=np.float32).reshape(-1, self.patch_dim)


class MultiModalInputs(msgspec.Struct, frozen=True):
    images: list[ImageInput]
    offsets: list[int]  # the first placeholder token of each image in the prompt
    spatial_merge: int  # merge x merge patches make one token

    def check(self, prompt_token_ids: list[int], image_token_id: int) -> None:
        """Refuse images whose placeholders are not image tokens of the prompt, in order."""
        if len(self.offsets) != len(self.images) or not self.images:
            raise ValueError(f"{len(self.images)} image(s) with {len(self.offsets)} placeholder offset(s)")
        end = 0
        for offset, image in zip(self.offsets, self.images):
            span = prompt_token_ids[offset:offset + image.num_tokens]
            if offset < end or len(span) != image.num_tokens or any(t != image_token_id for t in span):
                raise ValueError(f"an image's {image.num_tokens} placeholder tokens at {offset} are not image tokens "
                                 f"({image_token_id}) of the prompt after the previous image's")
            t, h, w = image.grid
            if len(image.patches) != t * h * w * image.patch_dim * 4 or \
                    image.num_tokens * self.spatial_merge ** 2 != t * h * w:
                raise ValueError(f"an image of grid {image.grid} has {len(image.patches) // 4} patch values and "
                                 f"{image.num_tokens} tokens: they do not match the grid")
            end = offset + image.num_tokens


@dataclass
class RequestImages:
    """A request's images as the engine core keeps them."""

    inputs: MultiModalInputs
    num_prompt_tokens: int
    positions: np.ndarray = field(init=False)  # [3, num_prompt_tokens] int64: (t, h, w) of each prompt token
    position_delta: int = field(init=False)  # a token after the prompt at index i sits at i + delta on every axis
    digest: int = field(init=False)  # of every image's grid and pixel digest

    def __post_init__(self) -> None:
        images = self.inputs.images
        self.positions, self.position_delta = mrope_positions(
            self.num_prompt_tokens, self.inputs.offsets, [i.grid for i in images], self.inputs.spatial_merge)
        h = hashlib.blake2b(digest_size=8)
        for image in images:
            h.update(np.asarray(image.grid, dtype=np.int64).tobytes())
            h.update(image.digest)
        self.digest = int.from_bytes(h.digest(), "little")

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(first placeholder token, token count) of each image."""
        return [(offset, image.num_tokens) for offset, image in zip(self.inputs.offsets, self.inputs.images)]

    @property
    def end(self) -> int:
        """One past the last prompt token whose position is not plain (index + delta on all axes)."""
        offset, count = self.spans[-1]
        return offset + count


def mrope_positions(num_tokens: int, offsets: list[int], grids: list[tuple[int, int, int]],
                    spatial_merge: int) -> tuple[np.ndarray, int]:
    """Qwen3-VL's (t, h, w) positions of a prompt of num_tokens tokens whose images' placeholders
    start at `offsets` with patch grids `grids`: text advances all three axes by one a token; an
    image's tokens sit at (start + frame, start + row, start + column) of its merged grid, and the
    text after it starts at start + max(rows, columns). Returns positions [3, num_tokens] int64 and
    the delta of the tokens after the prompt (last position + 1 - num_tokens)."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    index, start = 0, 0  # the next token, its position
    for offset, (t, h, w) in zip(offsets, grids):
        positions[:, index:offset] = start + np.arange(offset - index)
        start += offset - index
        rows, cols = h // spatial_merge, w // spatial_merge
        frame, row, col = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        count = t * rows * cols
        positions[:, offset:offset + count] = start + np.stack([frame.reshape(-1), row.reshape(-1), col.reshape(-1)])
        start += max(rows, cols)
        index = offset + count
    positions[:, index:] = start + np.arange(num_tokens - index)
    last = int(positions.max()) if num_tokens else -1
    return positions, last + 1 - num_tokens
