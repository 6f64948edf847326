"""DeepSeek-V3's multi-token-prediction layer as a draft model (`DeepseekMTP`): it loads only the
layers past num_hidden_layers from the main checkpoint, and its logits equal the MTP recipe
computed with transformers' own DeepSeek-V3 decoder layer: a one-layer transformers model whose
layer, final norm and LM head are the MTP layer's block, shared_head.norm and shared_head.head,
fed eh_proj([enorm(embedding of token t + 1) ; hnorm(previous hidden state)]) as inputs_embeds."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from baryon.config import ModelConfig, mtp_draft_config
from baryon.layers.attention import PagedKVLayer
from baryon.layers.forward_context import forward_context
from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.loader.model_loader import load_model
from conftest import hf_classes, make_checkpoint


def _model_config(path, hf_config) -> ModelConfig:
    return ModelConfig(model=str(path), model_path=str(path), tokenizer_path=None, hf_config=hf_config,
                       dtype=torch.float32, max_model_len=256, load_format="auto", trust_remote_code=False,
                       max_logprobs=20, quantization=None)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    return build_with_mtp(tmp_path_factory.mktemp("deepseek_mtp"))


def build_with_mtp(root):
    """(a 2-layer DeepSeek-V3 checkpoint with one MTP layer, the 1-layer transformers checkpoint
    holding that layer's block and head, the MTP input tensors)."""
    block = make_checkpoint(root / "block", "deepseek_v3", seed=21, num_hidden_layers=1, first_k_dense_replace=0)
    main = make_checkpoint(root / "main", "deepseek_v3", seed=22)
    config = json.loads((main / "config.json").read_text())
    index, hidden = config["num_hidden_layers"], config["hidden_size"]
    assert config["num_nextn_predict_layers"] == 1 and config["first_k_dense_replace"] <= index
    tensors, block_tensors = load_file(main / "model.safetensors"), load_file(block / "model.safetensors")
    prefix = f"model.layers.{index}."
    for name, tensor in block_tensors.items():
        if name.startswith("model.layers.0."):
            tensors[name.replace("model.layers.0.", prefix)] = tensor
    gen = torch.Generator().manual_seed(23)
    mtp = {"embed_tokens.weight": block_tensors["model.embed_tokens.weight"],
           "shared_head.norm.weight": block_tensors["model.norm.weight"],
           "shared_head.head.weight": block_tensors["lm_head.weight"],
           "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
           "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
           "eh_proj.weight": 0.15 * torch.randn(hidden, 2 * hidden, generator=gen)}
    tensors.update({prefix + name: tensor for name, tensor in mtp.items()})
    path = root / "with_mtp"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, block, mtp


def test_mtp_draft_equals_the_recipe_on_transformers_layer(with_mtp, seed):
    from transformers import AutoConfig

    path, block, mtp = with_mtp
    hf_config = AutoConfig.from_pretrained(path)
    draft = load_model(mtp_draft_config(_model_config(path, hf_config)), torch.device("cpu"))
    assert list(draft.model.layers) == [str(hf_config.num_hidden_layers)]  # the MTP layer alone
    block_size, num_blocks = 16, 4
    for layer in draft.modules():
        if isinstance(layer, PagedKVLayer):
            layer.kv_cache = torch.zeros(layer.cache_shape(num_blocks, block_size))
    gen = torch.Generator().manual_seed(seed)
    tokens = 19
    ids = torch.randint(0, hf_config.vocab_size, (tokens,), generator=gen)
    positions = torch.arange(tokens)
    previous = torch.randn(tokens, hf_config.hidden_size, generator=gen)
    starts, lens = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    metadata = AttentionMetadata(num_tokens=tokens, query_start_loc=starts, seq_lens=lens,
                                 block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
                                 slot_mapping=positions.clone(), max_query_len=tokens, max_seq_len=tokens,
                                 query_start_loc_cpu=starts, seq_lens_cpu=lens)
    with torch.no_grad(), forward_context(metadata):
        logits = draft.compute_logits(draft(ids, positions, previous))

    eps = hf_config.rms_norm_eps
    embeds = mtp["embed_tokens.weight"][ids].masked_fill((positions == 0)[:, None], 0.0)
    x = torch.cat((_rms_norm(embeds, mtp["enorm.weight"], eps), _rms_norm(previous, mtp["hnorm.weight"], eps)), -1)
    x = x @ mtp["eh_proj.weight"].T
    _, model_cls = hf_classes("deepseek_v3")
    reference = model_cls.from_pretrained(block, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(inputs_embeds=x[None]).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_checkpoint_without_mtp_layers_has_no_draft(tmp_path):
    from transformers import AutoConfig

    path = make_checkpoint(tmp_path / "v2", "deepseek_v2", num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="no multi-token prediction layers"):
        mtp_draft_config(_model_config(path, AutoConfig.from_pretrained(path)))
    # GLM-4.5 stores MTP layers, which no draft model here serves: refused by name
    glm = make_checkpoint(tmp_path / "glm", "glm4_moe", num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="not supported for model_type 'glm4_moe'"):
        mtp_draft_config(_model_config(glm, AutoConfig.from_pretrained(glm)))
