"""The KV block manager: a free list, reference counts and prefix caching by chained hashes.

The cache is `num_blocks` blocks of `block_size` token slots. A request owns a list of blocks
(its block table). Once a block is full of computed tokens it gets a hash that chains the hash of
the block before it with its own token ids, so equal hashes mean equal prefixes; a later request
whose prompt starts with the same blocks shares them (reference count + 1) instead of
recomputing. A block whose count drops to 0 goes to the back of the free queue but keeps its
hash: it can still be hit until it is reused, least recently freed first. Each block is offered
to the cache once, when it fills; a copy computed beside an identical cached block stays
unhashed (one entry per hash).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from baryon.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the cache


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first (evicted first).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover every full block in its first num_tokens tokens."""
        tokens = request.all_token_ids
        for i in range(len(request.block_hashes), num_tokens // self.block_size):
            # (an image prompt's first block chains from its images' digest: equal placeholder
            # tokens of other pixels are another prefix)
            parent = request.block_hashes[-1] if request.block_hashes else \
                (request.images.digest if request.images is not None else None)
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            request.block_hashes.append(chain_hash(parent, chunk))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens. The last token is
        never taken from the cache (its logits are needed), so at most num_tokens - 1 tokens hit."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_full_blocks(request, max_blocks * self.block_size)
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose token ids are all known on the host (not the pending one).
        num_full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        self._hash_full_blocks(request, num_full * self.block_size)
        for i in range(request.num_registered_blocks, num_full):  # each block once
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None and request.block_hashes[i] not in self.cached:
                block.block_hash = request.block_hashes[i]
                self.cached[block.block_hash] = block.block_id
        request.num_registered_blocks = num_full

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give the request blocks for num_new_tokens more tokens (after cached_blocks, the
        prefix-cache hits of a request's first schedule). False, changing nothing, if the free
        blocks do not suffice."""
        num_cached = len(cached_blocks)
        total = request.num_computed_tokens + num_cached * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(request.block_ids) - num_cached
        if num_new_blocks <= 0 and not num_cached:
            return True  # most steps of a running request: its blocks hold the new tokens
        # Hits that sit in the free queue stop being free once taken.
        free_hits = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - free_hits:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            request.block_ids.append(block_id)
        for _ in range(max(num_new_blocks, 0)):
            request.block_ids.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached contents
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Release the request's blocks; the last blocks go first in the eviction order, since a
        prefix's tail is the least likely to be shared."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block_id} freed more times than it was taken")
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        request.block_ids = []
        request.num_registered_blocks = 0
