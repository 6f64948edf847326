"""Tile sizes of the Triton expert GEMMs, per shape and batch size.

Tuned tables live in `configs/<GPU name>.json` (written by `benchmarks/tune_moe.py`, which times
every candidate on the GPU): for each shape `E=<local experts>,H=<hidden>,I=<inter>,<dtype>` (the
weights' dtype, or "int4" / "mxfp4" for packed 4-bit experts), a
map from a batch size (tokens in the step) to what measured fastest at that size: a Triton layout
with the tiles of its gate/up and down GEMMs, or torch's grouped GEMM. A step uses the entry of the nearest batch size at or above its own (the largest
otherwise). Shapes or GPUs without a table get the heuristic below.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace

import torch

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    scan: int = 256  # scan layout: expert ids read per step of the pair scan
    fuse_act: bool = True  # gate/up GEMM: SiLU-and-mul in its epilogue (else a separate kernel)

    def to_json(self) -> dict:
        return asdict(self)


def shape_key(num_experts: int, hidden: int, inter: int, dtype: torch.dtype | str) -> str:
    """dtype: the experts' weights, a torch dtype or a packed format's name ("int4", "mxfp4")."""
    return f"E={num_experts},H={hidden},I={inter},{str(dtype).removeprefix('torch.')}"


def config_file(device_name: str) -> str:
    return os.path.join(CONFIG_DIR, device_name.replace(" ", "_") + ".json")


@dataclass(frozen=True)
class MoETiles:
    """How one step's expert GEMMs run: `mode` "pairs", "scan" or "sorted" (the Triton layouts, see
    experts_triton) with the tiles of the gate/up and the down GEMM, or "grouped_mm" (torch's
    grouped GEMM measured faster at this size; no tiles)."""

    mode: str
    up: TileConfig | None = None
    down: TileConfig | None = None

    def to_json(self) -> dict:
        if self.mode == "grouped_mm":
            return {"mode": self.mode}
        return {"mode": self.mode, "up": self.up.to_json(), "down": self.down.to_json()}

    @classmethod
    def from_json(cls, entry: dict) -> MoETiles:
        if entry["mode"] == "grouped_mm":
            return cls("grouped_mm")
        return cls(entry["mode"], TileConfig(**entry["up"]), TileConfig(**entry["down"]))


@functools.lru_cache(maxsize=None)
def _table(device_name: str, key: str) -> dict[int, MoETiles]:
    path = config_file(device_name)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        entries = json.load(f).get(key, {})
    return {int(tokens): MoETiles.from_json(entry) for tokens, entry in entries.items()}


# Without a tuned table: the pairs layout up to this many (token, expert) pairs, then the scan
# layout while the experts average fewer than SORTED_MIN_ROWS_PER_EXPERT rows, then the sorted
# layout. The tuned tables switch from scan to sorted at 12-24 rows an expert (H100: 128 experts
# at 192 tokens x 8, 64 at 256 x 6; H200: 128 at 256 x 8, 64 at 96-128 tokens x 6-8); the
# scan kernels cost up to 1.6x the sorted ones past that (H200, 64 experts, 256 x 6: 623 against
# 403 us a layer).
PAIRS_MAX_PAIRS = 16
SORTED_MIN_ROWS_PER_EXPERT = 12


def default_tiles(num_experts: int, num_pairs: int) -> MoETiles:
    """Without a tuned table: GEMVs for a few pairs, the scan kernels with short tiles while
    experts get few rows, then sorted tiles that grow taller as experts get more rows."""
    if num_pairs <= PAIRS_MAX_PAIRS:
        tile = TileConfig(block_m=1, block_n=32, block_k=256, num_warps=4, num_stages=3)
        return MoETiles("pairs", tile, tile)
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert < SORTED_MIN_ROWS_PER_EXPERT:
        tile = TileConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
        return MoETiles("scan", tile, tile)
    if rows_per_expert >= 256:
        tile = TileConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    elif rows_per_expert >= 48:
        tile = TileConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=3)
    else:
        tile = TileConfig(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
    return MoETiles("sorted", tile, tile)


def tuned_tiles(num_experts: int, hidden: int, inter: int, num_tokens: int, dtype: torch.dtype | str,
                device: torch.device) -> MoETiles | None:
    """The tuned entry of the nearest batch size at or above num_tokens (the largest otherwise);
    None without a table for this GPU and shape."""
    if device.type != "cuda":
        return None
    table = _table(torch.cuda.get_device_name(device), shape_key(num_experts, hidden, inter, dtype))
    if not table:
        return None
    sizes = sorted(table)
    at_or_above = [size for size in sizes if size >= num_tokens]
    return table[at_or_above[0] if at_or_above else sizes[-1]]


@functools.lru_cache(maxsize=4096)
def tile_configs(num_experts: int, hidden: int, inter: int, num_tokens: int, top_k: int, dtype: torch.dtype | str,
                 device: torch.device) -> MoETiles:
    """The tiles of a step of num_tokens tokens: the tuned entry (`tuned_tiles`), or the default.
    Cached: every MoE layer of every eager step asks, with few distinct token counts."""
    tuned = tuned_tiles(num_experts, hidden, inter, num_tokens, dtype, device)
    return tuned if tuned is not None else default_tiles(num_experts, num_tokens * top_k)


# A gated (SiLU-and-mul fused) FP8 tile keeps two float32 accumulators and the two per-K-tile
# dot products it scales in registers. Compiled for sm_90 (Triton 3.9's ptxas; not timed), more
# than this many accumulator elements per thread spill: 64 x 128 on 4 warps and 128 x 128 on 8
# do, 64 x 128 and 128 x 64 on 8 warps do not (the bf16 tiles of the same sizes do not either).
FP8_GATED_ACC_PER_THREAD = 32


def _fp8_fit(tile: TileConfig, acc_per_thread: int) -> TileConfig:
    """More warps (up to 8), then narrower column tiles, until the accumulators fit."""
    num_warps, block_n = tile.num_warps, tile.block_n
    while tile.block_m * block_n > acc_per_thread * 32 * num_warps:
        if num_warps < 8:
            num_warps *= 2
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return replace(tile, num_warps=num_warps, block_n=block_n)


@functools.lru_cache(maxsize=4096)
def fp8_block_tiles(tiles: MoETiles, num_experts: int, num_pairs: int, block_k: int, block_n: int = 128) -> MoETiles:
    """The tiles of an FP8 step with block-scaled weights: every GEMM's K tile is one block of the
    scales (BLOCK_K = bk, so a K tile's partial dot takes one activation scale per row and one
    weight scale per column). At bk = 128 a default tile's stage holds as many bytes as its bf16
    counterpart at BLOCK_K = 64. Tiles made for bf16 (BLOCK_K other than bk: the defaults) also
    get a gated tile that fits its registers (_fp8_fit); a table tuned for FP8 (BLOCK_K
    already bk) is taken as it is. torch's grouped GEMM has no block-scaled FP8 form: a
    "grouped_mm" entry gets the default tiles. Scales finer than a column tile (block_n below
    BLOCK_N: channel scales run as 1 x 128 blocks) hold one scale per column in registers too:
    half the accumulators per thread, on both GEMMs (ptxas spilled 52-88 bytes otherwise)."""
    if tiles.mode == "grouped_mm":
        tiles = default_tiles(num_experts, num_pairs)
    up, down = tiles.up, tiles.down
    if block_n < min(up.block_n, down.block_n):
        up = _fp8_fit(up, FP8_GATED_ACC_PER_THREAD // (2 if up.fuse_act else 1))
        down = _fp8_fit(down, FP8_GATED_ACC_PER_THREAD)
    elif up.block_k != block_k and up.fuse_act:
        up = _fp8_fit(up, FP8_GATED_ACC_PER_THREAD)
    return MoETiles(tiles.mode, replace(up, block_k=block_k), replace(down, block_k=block_k))
