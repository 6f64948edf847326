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


def test_gpu_suite_variants_set_environment_variables_before_engine_flags():
    """A gpu_suite variant's leading VAR=VALUE words go to its processes' environment (a forced
    kernel for an A/B run), the rest to the engine as flags; a flag's own '=' stays a flag."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"
    spec = importlib.util.spec_from_file_location("gpu_suite", path)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    variables, flags = suite.variant_settings(
        "BARYON_KERNEL_ALL_REDUCE=symm_mem_pushed X_2= --tensor-parallel-size 2 --hf-overrides={\"a\":1}")
    assert variables == {"BARYON_KERNEL_ALL_REDUCE": "symm_mem_pushed", "X_2": ""}
    assert flags == ["--tensor-parallel-size", "2", "--hf-overrides={\"a\":1}"]
    assert suite.variant_settings("--quantization fp8") == ({}, ["--quantization", "fp8"])
    process = suite.tree_process("", variables)
    assert process["env"]["BARYON_KERNEL_ALL_REDUCE"] == "symm_mem_pushed" and "cwd" not in process
    assert suite.tree_process("") == {}
