"""The benchmark modules the GPU suite runs, on CPU with a tiny checkpoint: what they report."""

from __future__ import annotations

import pytest

from conftest import make_checkpoint


@pytest.mark.parametrize("decodes, budget", [(3, 128), (1, 300)])
def test_prefill_beside_decodes_reports_the_long_prompt_and_the_decoders(tmp_path, seed, decodes, budget):
    from baryon.bench import prefill_beside_decodes

    path = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=seed, hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                           max_position_embeddings=2048)
    args = prefill_beside_decodes.parse_args([
        "--model", str(path), "--skip-tokenizer-init", "--device", "cpu", "--input-len", "600",
        "--decodes", str(decodes), "--max-num-batched-tokens", str(budget), "--num-iters", "2",
        "--steady-steps", "3", "--max-model-len", "1024"])
    result = prefill_beside_decodes.run(args)
    assert (result["input_len"], result["decodes"], result["max_num_batched_tokens"]) == (600, decodes, budget)
    # Decodes go first in a step; the prompt fills the rest of the budget, chunk after chunk (the
    # engine may report the token one step after the last chunk).
    chunks = -(-600 // (budget - decodes))
    assert chunks <= result["prefill_steps"] <= chunks + 1
    assert 0 < result["itl_ms"] and 0 < result["itl_during_ms"] <= result["itl_max_ms"] < result["ttft_ms"]
