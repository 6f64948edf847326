"""State slots: where a running request keeps its recurrent state (linear-attention layers).

A hybrid model (Qwen3-Next, Qwen3.5: Gated DeltaNet layers beside full attention) carries, per
sequence and per linear-attention layer, a fixed-size state (the convolution's last inputs and the
delta rule's matrix) instead of KV blocks that grow with the context. The runner allocates
`max_num_seqs` such slots per layer; a request holds one slot index from admission until it
finishes or is preempted. The engine never clears a slot: a sequence that starts from its first
token starts from zeros (the kernels read a slot's state only for a sequence with tokens before
this step's), so a preempted request recomputed later simply takes any free slot.
"""

from __future__ import annotations

from baryon.request import Request


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def take(self, request: Request) -> None:
        if request.state_slot >= 0:
            raise AssertionError(f"request {request.request_id} already holds state slot {request.state_slot}")
        if not self.free_slots:  # the scheduler admits at most max_num_seqs = num_slots requests
            raise AssertionError(f"no free state slot for request {request.request_id}: all {self.num_slots} "
                                 f"are held")
        request.state_slot = self.free_slots.pop()
        request.pending_drafts = None

    def free(self, request: Request) -> None:
        if request.state_slot >= 0:
            self.free_slots.append(request.state_slot)
            request.state_slot = -1
            request.pending_drafts = None
