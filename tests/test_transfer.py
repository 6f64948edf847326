"""to_device_many: a step's host arrays in one copy, each back with its own shape, dtype and values."""

import numpy as np
import pytest
import torch

from baryon.transfer import ALIGN, to_device_many


def random_arrays(rng: np.random.Generator) -> list:
    """Arrays of every dtype a step sends, odd byte sizes (so packing must align), empty ones and
    a CPU tensor among them."""
    n = int(rng.integers(1, 70))
    return [
        rng.integers(-2**40, 2**40, size=n, dtype=np.int64),
        rng.integers(0, 1000, size=(n, int(rng.integers(1, 9))), dtype=np.int32),
        rng.random(n).astype(np.float32),
        rng.random(3) < 0.5,  # bool, 3 bytes
        np.zeros(0, dtype=np.int64),
        np.zeros((0, 1), dtype=np.int32),
        rng.integers(0, 255, size=5, dtype=np.uint8),
        torch.from_numpy(rng.random(7)).to(torch.float16),
        rng.integers(-5, 5, size=(2, 3), dtype=np.int64)[:, ::2],  # not contiguous
    ]


def as_numpy(a) -> np.ndarray:
    return a.numpy() if isinstance(a, torch.Tensor) else a


def check(arrays: list, tensors: list[torch.Tensor], device: torch.device) -> None:
    assert len(tensors) == len(arrays)
    for a, t in zip(arrays, tensors):
        expected = as_numpy(a)
        assert t.device.type == device.type
        assert tuple(t.shape) == expected.shape
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(expected)).dtype
        np.testing.assert_array_equal(t.cpu().numpy(), expected)


def test_cpu_returns_the_host_arrays(seed):
    arrays = random_arrays(np.random.default_rng(seed))
    tensors = to_device_many(arrays, torch.device("cpu"))
    check(arrays, tensors, torch.device("cpu"))
    tensors[0][0] = 12345  # no copy on a CPU device: the tensor is the array
    assert arrays[0][0] == 12345


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, packed copy needs CUDA")
def test_cuda_one_copy_of_every_array(seed):
    device = torch.device("cuda")
    rng = np.random.default_rng(seed)
    arrays = random_arrays(rng)
    tensors = to_device_many(arrays, device)
    check(arrays, tensors, device)
    # Views of one buffer, each at an aligned offset, none overlapping another.
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    assert len({t.untyped_storage().data_ptr() for t in tensors if t.numel()}) == 1
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    # The host may change its arrays right after the call: the device keeps what was sent.
    before = [as_numpy(a).copy() for a in arrays]
    for a in arrays:
        as_numpy(a)[...] = 0
    check(before, tensors, device)
