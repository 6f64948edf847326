"""The batch's allowed-token bitmask on its way from the grammars to the sampler.

One host buffer (pinned where the device is a GPU) the matchers fill, and one device buffer it
is copied into, both kept across steps: allocating a fresh [64, 4748] int32 mask and pinning it
for the copy cost ~0.7 ms a step on the H100 host, as much as filling it. A step writes the
host buffer only after the previous step's copy has left it.
"""

from __future__ import annotations

import torch

from baryon.transfer import to_device

_ROW_GRANULE = 16  # buffers grow in whole multiples of this many rows


class BitmaskStaging:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = -(-vocab_size // 32)
        self.device = device
        self.host = torch.empty(0, self.words, dtype=torch.int32)  # [capacity, words]
        self.on_device = self.host  # [capacity, words] on `device` (the host buffer itself on a CPU)
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy (one event, reused)
        self._copy_pending = False  # the host buffer's last copy may not have run yet
        self._first_rows = torch.arange(0, device=device)  # [capacity] 0, 1, 2, ... on the device

    def host_rows(self, rows: int) -> torch.Tensor:
        """int32 [rows, words] on the host, free to be filled (the previous copy has finished)."""
        if self._copy_pending:
            self._copied.synchronize()
            self._copy_pending = False
        if self.host.shape[0] < rows:
            capacity = -(-rows // _ROW_GRANULE) * _ROW_GRANULE
            pinned = self.device.type == "cuda"
            self.host = torch.empty(capacity, self.words, dtype=torch.int32, pin_memory=pinned)
            self.on_device = torch.empty_like(self.host, device=self.device) if pinned else self.host
            self._first_rows = torch.arange(capacity, device=self.device)
        return self.host[:rows]

    def upload(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the host buffer on the device (queued on the current stream)."""
        if self.device.type != "cuda":
            return self.host[:rows]
        on_device = self.on_device[:rows]
        on_device.copy_(self.host[:rows], non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        self._copy_pending = True
        return on_device

    def logits_rows(self, rows: list[int]) -> torch.Tensor:
        """int64 [len(rows)] on the device: the logits row of each bitmask row (rows 0, 1, 2, ...,
        each step's usual case, from a buffer already there; after host_rows)."""
        if rows == list(range(len(rows))):
            return self._first_rows[:len(rows)]
        return to_device(torch.tensor(rows, dtype=torch.int64), self.device)
