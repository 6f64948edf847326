"""Find a checkpoint's weight files and stream its tensors one at a time.

safetensors files are opened with `safe_open`: a tensor it returns lies over the memory map, so
only the pages a weight loader copies out are read (a tensor-parallel rank reads its own rows or
columns, not the whole tensor); a sharded checkpoint's index decides which file owns each tensor, so a
tensor repeated in two shards is loaded once. `.bin` files are the fallback when a checkpoint
has no safetensors.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

# Files named *.bin that are not model weights.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "scheduler.bin")


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing, unexpected, mis-shaped or unreadable (message names it)."""


def weight_files(model_path: str, load_format: str) -> tuple[list[str], dict[str, str] | None]:
    """The weight files to read and, for a sharded checkpoint, the index (tensor -> file)."""
    if load_format in ("auto", "safetensors"):
        files, index = _find(model_path, "model.safetensors.index.json", "*.safetensors")
        if files:
            return files, index
        if load_format == "safetensors":
            raise FileNotFoundError(f"no *.safetensors weights in {model_path}")
    files, index = _find(model_path, "pytorch_model.bin.index.json", "*.bin")
    files = [f for f in files if os.path.basename(f) not in _NOT_WEIGHTS]
    if not files:
        wanted = "*.bin" if load_format == "pt" else "*.safetensors or *.bin"
        raise FileNotFoundError(f"no model weights ({wanted}) in {model_path}")
    return files, index


def _find(model_path: str, index_name: str, pattern: str) -> tuple[list[str], dict[str, str] | None]:
    index_path = os.path.join(model_path, index_name)
    if not os.path.isfile(index_path):
        return sorted(glob.glob(os.path.join(model_path, pattern))), None
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    index = {name: os.path.join(model_path, file) for name, file in weight_map.items()}
    files = sorted(set(index.values()))
    for file in files:
        if not os.path.isfile(file):
            raise FileNotFoundError(f"weight file {file} listed in {index_path} is missing")
    return files, index


def iterate_weights(files: list[str], index: dict[str, str] | None) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (tensor name, tensor on CPU, file) for every tensor, one at a time."""
    for file in files:
        try:
            if file.endswith(".safetensors"):
                yield from _safetensors(file, index)
            else:
                state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                for name, tensor in state.items():
                    if index is None or index.get(name) == file:
                        yield name, tensor, file
                del state
        except Exception as e:  # safetensors/pickle errors for truncated or corrupt files
            raise WeightLoadError(f"cannot read weight file {file}: {type(e).__name__}: {e}") from e


def _safetensors(file: str, index: dict[str, str] | None) -> Iterator[tuple[str, torch.Tensor, str]]:
    with safe_open(file, framework="pt", device="cpu") as handle:
        for name in handle.keys():
            if index is None or index.get(name) == file:
                yield name, handle.get_tensor(name), file


def stored_tensor_names(model_path: str, load_format: str) -> set[str] | None:
    """The names of the checkpoint's tensors, from the index or the safetensors headers (no
    tensor is read); None for .bin checkpoints, whose names only unpickling tells."""
    files, index = weight_files(model_path, load_format)
    if index is not None:
        return set(index)
    if not all(file.endswith(".safetensors") for file in files):
        return None
    names = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            names.update(handle.keys())
    return names
