"""Images in prompts: the processor that turns them into patches and placeholder tokens, and what a
request carries of them into the engine (patches, grids, M-RoPE positions)."""
