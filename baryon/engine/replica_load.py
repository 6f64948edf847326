"""Which data-parallel replica a new request goes to: the one with the least work outstanding,
counted in tokens (SGLang's "minimum tokens" rule), not in requests.

A request's work is its prompt plus the most tokens it may generate (max_tokens, or what is left
of the context when it has none), times its samples, held against its replica until it ends.
Counting requests instead splits a batch of mixed lengths evenly by number and unevenly by work:
nano's 256 requests (outputs of 100-1,024 tokens) gave one of two replicas 75,964 output tokens
and the other 68,196, and the run lasts as long as the busier one.

Both the offline engine's replicas (engine/core_processes.py) and the server's
(engine/core_client.py) place requests with it.
"""

from __future__ import annotations

from baryon.sampling_params import SamplingParams


def request_tokens(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """The tokens a request may cost: its prompt and every token it may generate, per sample."""
    new = params.max_tokens if params.max_tokens is not None else max(max_model_len - prompt_len, 1)
    return params.n * (prompt_len + new)


class ReplicaLoad:
    def __init__(self, num_replicas: int) -> None:
        self.tokens = [0] * num_replicas  # outstanding work per replica
        self._held: dict[str, tuple[int, int]] = {}  # request id -> (replica, its tokens)

    def assign(self, request_id: str, tokens: int) -> int:
        """The replica with the least outstanding work (the first of equals) now holds the request."""
        replica = min(range(len(self.tokens)), key=self.tokens.__getitem__)
        self.tokens[replica] += tokens
        self._held[request_id] = (replica, tokens)
        return replica

    def replica_of(self, request_id: str) -> int | None:
        held = self._held.get(request_id)
        return None if held is None else held[0]

    def release(self, request_id: str) -> int | None:
        """The request ended (finished, aborted, failed): its replica no longer counts it. Returns
        that replica (None: not held)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        replica, tokens = held
        self.tokens[replica] -= tokens
        return replica

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)
