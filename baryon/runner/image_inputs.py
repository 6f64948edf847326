"""A step's image inputs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): the RoPE positions of image
requests' tokens, and for a step that computes their prompt tokens the `MultiModalStep` the model
reads (every token's (t, h, w) position, the image tokens' vision embeddings and DeepStack features).

The vision tower runs once per request, over all its images, at the first step that computes one
of its image tokens (one call for all such requests of a step); the outputs stay here until its prefill is past its last image (a chunked
prefill takes them chunk by chunk) or it ends. A preempted request that comes back recomputes them.
With tensor parallelism the tower runs on rank 0, which broadcasts each step's MultiModalStep to
the other ranks after the step's plan (`share`, `receive`): they hold the tower too, but idle.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from baryon.distributed.parallel_state import broadcast_from_first
from baryon.layers.forward_context import MultiModalStep
from baryon.request import Request


def rope_positions(scheduled: list[tuple[Request, int]]) -> np.ndarray:
    """The step's 1-D RoPE positions [num_tokens] int64 where an image request is scheduled (empty:
    every token at its cache position): a token after the images sits at index + delta, and a token
    among them at its temporal position (the step's MultiModalStep then rotates those)."""
    if not any(r.images is not None for r, _ in scheduled):
        return np.zeros(0, dtype=np.int64)
    parts = []
    for request, n in scheduled:
        index = np.arange(request.num_computed_tokens, request.num_computed_tokens + n)
        parts.append(index if request.images is None else _positions(request, index)[0])
    return np.concatenate(parts)


def _positions(request: Request, index: np.ndarray) -> np.ndarray:
    """(t, h, w) positions [3, len(index)] of an image request's tokens at `index`."""
    images = request.images
    inside = index < images.num_prompt_tokens
    out = np.broadcast_to(index + images.position_delta, (3, len(index))).copy()
    out[:, inside] = images.positions[:, index[inside]]
    return out


class ImageEncoder:
    """Runs the model's vision tower and keeps each request's outputs while its prefill needs them."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, budget: int,
                 largest_image: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype  # of the tower's outputs
        # Image tokens one tower call encodes at most (one image larger than that alone), and the
        # largest image's: the memory profile runs the tower on `budget` of them (`profile`).
        self.budget, self.largest_image = budget, largest_image
        # request id -> (embeddings [N, hidden], DeepStack [k, N, hidden]) of all its image tokens
        self.outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(self, scheduled: list[tuple[Request, int]]) -> MultiModalStep | None:
        """The step's MultiModalStep, or None when it computes no token before an image request's
        last image (its decodes and later prompt tokens rotate as plain RoPE at rope_positions)."""
        if not any(r.images is not None and r.num_computed_tokens < r.images.end for r, _ in scheduled):
            return None
        self._encode([r for r, n in scheduled if r.images is not None and r.request_id not in self.outputs
                      and any(o < r.num_computed_tokens + n and r.num_computed_tokens < o + c for o, c in r.images.spans)])
        positions, rows, embeddings, deepstack, start = [], [], [], [], 0
        for request, n in scheduled:
            first = request.num_computed_tokens
            index = np.arange(first, first + n)
            if request.images is None:
                positions.append(np.broadcast_to(index, (3, n)))
            else:
                positions.append(_positions(request, index))
                self._take_image_tokens(request, first, n, start, rows, embeddings, deepstack)
            start += n
        hidden = self.model.config.hidden_size
        return MultiModalStep(
            positions=torch.from_numpy(np.concatenate(positions, axis=1)).to(self.device),
            rows=torch.tensor(rows, dtype=torch.int64, device=self.device),
            embeddings=torch.cat(embeddings) if embeddings else torch.zeros(0, hidden, dtype=self.dtype,
                                                                             device=self.device),
            deepstack=torch.cat(deepstack, dim=1) if deepstack else torch.zeros(0, 0, hidden, dtype=self.dtype,
                                                                                device=self.device))

    def _take_image_tokens(self, request: Request, first: int, n: int, start: int, rows: list[int],
                           embeddings: list[torch.Tensor], deepstack: list[torch.Tensor]) -> None:
        """Add the rows, embeddings and DeepStack features of the request's image tokens in
        [first, first + n), which sit at token `start` of the step."""
        images, done = request.images, 0  # done: image tokens before this image
        for offset, count in images.spans:
            lo, hi = max(offset, first), min(offset + count, first + n)
            if lo < hi:
                encoded, features = self.outputs[request.request_id]
                rows.extend(range(start + lo - first, start + hi - first))
                embeddings.append(encoded[done + lo - offset:done + hi - offset])
                deepstack.append(features[:, done + lo - offset:done + hi - offset])
            done += count
        if first + n >= images.end:
            self.outputs.pop(request.request_id, None)  # (the tensors taken above stay alive for the step)

    def _encode(self, requests: list[Request]) -> None:
        """The images of every request that needs them this step, through the tower in as few
        calls as `budget` allows (one, unless they hold more image tokens than it)."""
        if not requests:
            return
        images = [image for r in requests for image in r.images.inputs.images]
        calls, tokens = [[]], 0
        for image in images:
            if calls[-1] and tokens + image.num_tokens > self.budget:
                calls.append([])
                tokens = 0
            calls[-1].append(image)
            tokens += image.num_tokens
        outputs = [self._tower(call) for call in calls]
        embeddings = torch.cat([e for e, _ in outputs])  # [image tokens, hidden]
        deepstack = torch.cat([d for _, d in outputs], dim=1)  # [k, image tokens, hidden]
        start = 0
        for request in requests:
            count = sum(i.num_tokens for i in request.images.inputs.images)
            self.outputs[request.request_id] = (embeddings[start:start + count], deepstack[:, start:start + count])
            start += count

    def _tower(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        patches = torch.from_numpy(np.concatenate([i.patch_array() for i in images])).to(self.device)
        return self.model.encode_images(patches, [i.grid for i in images])

    def profile(self) -> None:
        """The tower's largest call once, on blank images worth `budget` tokens (each at most the
        largest image), so that the memory profile counts its activations."""
        vision = self.model.config.vision_config
        merge = vision.spatial_merge_size
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        grids, left = [], self.budget
        while left > 0:
            side = max(1, int(min(left, self.largest_image) ** 0.5))  # merged patches a side
            grids.append((1, side * merge, side * merge))
            left -= side * side
        patches = torch.zeros(sum(t * h * w for t, h, w in grids), patch_dim, dtype=self.dtype, device=self.device)
        self.model.encode_images(patches, grids)

    @staticmethod
    def shape(step: MultiModalStep | None) -> tuple[int, int] | None:
        """(image tokens, DeepStack layers) of a step: what the other ranks need to receive it."""
        return None if step is None else (step.rows.shape[0], step.deepstack.shape[0])

    @staticmethod
    def share(step: MultiModalStep) -> None:
        """Rank 0's step tensors on every tensor-parallel rank (in place: rank 0 sends, the others
        receive into the tensors `receive` allocates)."""
        for tensor in (step.positions, step.rows, step.embeddings, step.deepstack):  # (each contiguous)
            if tensor.numel():
                broadcast_from_first(tensor)

    def receive(self, shape: tuple[int, int], num_tokens: int) -> MultiModalStep:
        """A rank > 0: the MultiModalStep rank 0 shares for a step of num_tokens tokens."""
        rows, layers = shape
        hidden = self.model.config.hidden_size
        step = MultiModalStep(
            positions=torch.empty(3, num_tokens, dtype=torch.int64, device=self.device),
            rows=torch.empty(rows, dtype=torch.int64, device=self.device),
            embeddings=torch.empty(rows, hidden, dtype=self.dtype, device=self.device),
            deepstack=torch.empty(layers if rows else 0, rows, hidden, dtype=self.dtype, device=self.device))
        self.share(step)
        return step

    def forget(self, request_id: str) -> None:
        self.outputs.pop(request_id, None)
