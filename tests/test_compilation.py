"""Compilation levels on CPU: level 1 (dynamo, eager backend) traces the whole model with no
graph break (attention is the opaque custom op) and gives level 0's tokens. Levels 2 and 3
(inductor) are tested on GPU in test_gpu.py: inductor's C++ build takes minutes on a 2-core CPU."""

from __future__ import annotations

import pytest
import torch

from baryon import LLM, SamplingParams
from conftest import make_checkpoint, random_prompts


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_dynamo_level_matches_eager(tmp_path, seed, arch):
    path = make_checkpoint(tmp_path / arch, arch, seed=seed, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
    prompts = random_prompts(3, 128, 3, 24, seed)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    results = []
    for level in (0, 1):
        torch._dynamo.reset()
        llm = LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, compilation_level=level,
                  max_num_batched_tokens=16)  # chunked prefill: mixed steps of several shapes
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, [next(iter(e.values())).logprob for e in o.outputs[0].logprobs])
                        for o in outs])
    for (tokens0, lp0), (tokens1, lp1) in zip(*results):
        assert tokens1 == tokens0
        assert max(abs(a - b) for a, b in zip(lp0, lp1)) < 1e-5


def test_attention_custom_op_is_registered_and_opaque():
    """dynamo sees `baryon::attention` as one op: its fake implementation gives the output shape
    without running kernels or reading a forward context."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from baryon.layers.attention import Attention

    layer = Attention(num_heads=4, head_dim=32, num_kv_heads=2, scale=32 ** -0.5)
    with FakeTensorMode():
        qkv = torch.empty(7, (4 + 2 * 2) * 32)
        out = torch.ops.baryon.attention(qkv, torch.zeros(7, dtype=torch.int64), torch.empty(64, 32),
                                         None, None, 0.0, layer.layer_id)
    assert tuple(out.shape) == (7, 128)


@pytest.mark.parametrize("level", [-1, 4, "2"])
def test_bad_compilation_level_is_a_clear_error(stories_path, level):
    with pytest.raises(ValueError, match="compilation_level"):
        LLM(str(stories_path), compilation_level=level)
