"""EAGLE-3 draft heads (`LlamaForCausalLMEagle3`): a tiny random checkpoint in the published layout
(safetensors: fc, midlayer.*, norm, lm_head, int64 d2t, bool t2d, optional embed_tokens) loads through
baryon's loader, and its prenorm output and logits equal the EAGLE-3 formula written out here in plain
torch; the target (Llama) exposes the hidden states entering the chosen layers, checked against
transformers' output_hidden_states."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from baryon.config import ModelConfig
from baryon.kernels.attention.metadata import AttentionMetadata
from baryon.layers.attention import PagedKVLayer
from baryon.layers.embedding import VocabParallelEmbedding
from baryon.layers.forward_context import forward_context
from baryon.loader.model_loader import load_model
from baryon.loader.weights import WeightLoadError
from baryon.models.eagle3 import Eagle3LlamaForCausalLM, default_aux_layer_ids
from baryon.models.registry import resolve_model_class
from conftest import hf_classes, make_checkpoint

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 128, 64, 4, 2, 16, 96
DRAFT_VOCAB, EPS, THETA = 48, 1e-6, 10000.0
BLOCK_SIZE, NUM_BLOCKS = 4, 8


def _model_config(path, hf_config) -> ModelConfig:
    return ModelConfig(model=str(path), model_path=str(path), tokenizer_path=None, hf_config=hf_config,
                       dtype=torch.float32, max_model_len=256, load_format="auto", trust_remote_code=False,
                       max_logprobs=20, quantization=None)


def _load(path) -> torch.nn.Module:
    from transformers import AutoConfig

    model = load_model(_model_config(path, AutoConfig.from_pretrained(path)), torch.device("cpu"))
    for layer in model.modules():
        if isinstance(layer, PagedKVLayer):
            layer.kv_cache = torch.zeros(layer.cache_shape(NUM_BLOCKS, BLOCK_SIZE))
    return model


def _prefill_metadata(num_tokens: int) -> AttentionMetadata:
    """One sequence, its first `num_tokens` tokens, in blocks 0, 1, ... of the cache."""
    starts = torch.tensor([0, num_tokens], dtype=torch.int32)
    lens = torch.tensor([num_tokens], dtype=torch.int32)
    return AttentionMetadata(num_tokens=num_tokens, query_start_loc=starts, seq_lens=lens,
                             block_tables=torch.arange(NUM_BLOCKS, dtype=torch.int32)[None],
                             slot_mapping=torch.arange(num_tokens), max_query_len=num_tokens,
                             max_seq_len=num_tokens, query_start_loc_cpu=starts, seq_lens_cpu=lens)


def _decode_metadata(position: int) -> AttentionMetadata:
    """The same sequence's token at `position`, after the cached ones."""
    starts = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([position + 1], dtype=torch.int32)
    return AttentionMetadata(num_tokens=1, query_start_loc=starts, seq_lens=lens,
                             block_tables=torch.arange(NUM_BLOCKS, dtype=torch.int32)[None],
                             slot_mapping=torch.tensor([position]), max_query_len=1, max_seq_len=position + 1,
                             query_start_loc_cpu=starts, seq_lens_cpu=lens)


def _eagle3_tensors(seed: int, target_hidden: int, with_embedding: bool, hidden: int = HIDDEN, heads: int = HEADS,
                    kv_heads: int = KV_HEADS, intermediate: int = INTERMEDIATE) -> dict[str, torch.Tensor]:
    """Random weights named and typed as the published EAGLE-3 checkpoints are (head_dim:
    hidden / heads)."""
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return 0.15 * torch.randn(rows, cols, generator=gen)

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=gen)

    target_ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values  # the draft vocabulary
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    tensors = {
        "fc.weight": matrix(hidden, 3 * target_hidden),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": matrix(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": matrix(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": matrix(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": matrix(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": matrix(hidden, intermediate),
        "norm.weight": norm(),
        "lm_head.weight": matrix(DRAFT_VOCAB, hidden),
        "d2t": target_ids - torch.arange(DRAFT_VOCAB),  # int64
        "t2d": t2d,
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = matrix(VOCAB, hidden)
    return tensors


def _write_eagle3(path, tensors: dict[str, torch.Tensor], **config_overrides):
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": EPS, "rope_theta": THETA,
              "rope_scaling": None, "max_position_embeddings": 256, "vocab_size": VOCAB,
              "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False, "torch_dtype": "float32",
              **config_overrides}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


# ---- the formula, in plain torch --------------------------------------------------------------

def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim], rotate-half (NeoX) RoPE."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = positions.float()[:, None] * inv_freq[None]  # [tokens, head_dim / 2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _reference_prenorm(t: dict[str, torch.Tensor], embedding: torch.Tensor, ids: torch.Tensor,
                       hidden: torch.Tensor) -> torch.Tensor:
    """The EAGLE-3 layer over one whole sequence (positions 0 .. T-1, causal)."""
    tokens = ids.shape[0]
    positions = torch.arange(tokens)
    embeds = _rms_norm(embedding[ids], t["midlayer.input_layernorm.weight"])
    x = torch.cat((embeds, _rms_norm(hidden, t["midlayer.hidden_norm.weight"])), dim=-1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(tokens, HEADS, HEAD_DIM)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(tokens, KV_HEADS, HEAD_DIM)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(tokens, KV_HEADS, HEAD_DIM)
    q, k = _rope(q, positions), _rope(k, positions)
    k, v = (z.repeat_interleave(HEADS // KV_HEADS, dim=1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
    scores = scores.masked_fill(torch.ones(tokens, tokens).triu(1).bool(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(tokens, HEADS * HEAD_DIM)
    residual = hidden + attended @ t["midlayer.self_attn.o_proj.weight"].T
    y = _rms_norm(residual, t["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(y @ t["midlayer.mlp.gate_proj.weight"].T) * (y @ t["midlayer.mlp.up_proj.weight"].T))
    return mlp @ t["midlayer.mlp.down_proj.weight"].T + residual


def _reference_logits(t: dict[str, torch.Tensor], prenorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft-vocabulary logits, target-vocabulary logits with -inf outside the draft vocabulary)."""
    draft = _rms_norm(prenorm, t["norm.weight"]) @ t["lm_head.weight"].T
    target = torch.full((prenorm.shape[0], VOCAB), float("-inf"))
    target[:, torch.arange(DRAFT_VOCAB) + t["d2t"]] = draft
    return draft, target


# ---- tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eagle3_checkpoint(tmp_path_factory):
    """Its own embedding, a target hidden size (80) other than the draft's (64)."""
    tensors = _eagle3_tensors(seed=31, target_hidden=80, with_embedding=True)
    path = _write_eagle3(tmp_path_factory.mktemp("eagle3") / "head", tensors, target_hidden_size=80)
    return path, tensors


def test_both_published_architecture_names_resolve():
    assert resolve_model_class("LlamaForCausalLMEagle3") is Eagle3LlamaForCausalLM
    assert resolve_model_class("Eagle3LlamaForCausalLM") is Eagle3LlamaForCausalLM


def test_checkpoint_layout_is_the_published_one(eagle3_checkpoint):
    path, _ = eagle3_checkpoint
    stored = load_file(path / "model.safetensors")
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert stored["fc.weight"].shape == (HIDDEN, 3 * 80)
    assert stored["midlayer.self_attn.q_proj.weight"].shape == (HEADS * HEAD_DIM, 2 * HIDDEN)
    assert stored["lm_head.weight"].shape == (DRAFT_VOCAB, HIDDEN)


def test_forward_and_logits_equal_the_formula(eagle3_checkpoint, seed):
    path, t = eagle3_checkpoint
    draft = _load(path)
    assert isinstance(draft, Eagle3LlamaForCausalLM) and draft.has_own_embedding
    gen = torch.Generator().manual_seed(seed)
    tokens = 7
    ids = torch.randint(0, VOCAB, (tokens,), generator=gen)
    aux = torch.randn(tokens, 3 * 80, generator=gen)  # the target's three hidden states per token
    with torch.no_grad(), forward_context(_prefill_metadata(tokens)):
        hidden = draft.combine_hidden_states(aux)
        prenorm = draft(ids, torch.arange(tokens), hidden)
        logits = draft.compute_logits(prenorm)
        draft_logits = draft.compute_draft_logits(prenorm)

    expected_hidden = aux @ t["fc.weight"].T
    torch.testing.assert_close(hidden, expected_hidden, atol=1e-5, rtol=1e-5)
    expected = _reference_prenorm(t, t["embed_tokens.weight"], ids, expected_hidden)
    torch.testing.assert_close(prenorm, expected, atol=1e-5, rtol=1e-5)
    expected_draft, expected_logits = _reference_logits(t, expected)
    assert logits.dtype == torch.float32 and logits.shape == (tokens, VOCAB)
    torch.testing.assert_close(draft_logits, expected_draft, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)


def test_a_decode_step_reads_the_draft_kv_cache(eagle3_checkpoint, seed):
    """Prefill all but the last token, then decode it from the paged cache: the same output."""
    path, t = eagle3_checkpoint
    draft = _load(path)
    gen = torch.Generator().manual_seed(seed)
    tokens = 6
    ids = torch.randint(0, VOCAB, (tokens,), generator=gen)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    with torch.no_grad():
        with forward_context(_prefill_metadata(tokens - 1)):
            draft(ids[:-1], torch.arange(tokens - 1), hidden[:-1])
        with forward_context(_decode_metadata(tokens - 1)):
            last = draft(ids[-1:], torch.tensor([tokens - 1]), hidden[-1:])
    expected = _reference_prenorm(t, t["embed_tokens.weight"], ids, hidden)[-1:]
    torch.testing.assert_close(last, expected, atol=1e-5, rtol=1e-5)


def test_d2t_places_draft_logits_at_their_target_ids(eagle3_checkpoint, seed):
    path, t = eagle3_checkpoint
    draft = _load(path)
    in_draft = torch.zeros(VOCAB, dtype=torch.bool)
    in_draft[torch.arange(DRAFT_VOCAB) + t["d2t"]] = True
    assert torch.equal(in_draft, t["t2d"])
    gen = torch.Generator().manual_seed(seed)
    prenorm = torch.randn(5, HIDDEN, generator=gen)
    with torch.no_grad():
        logits = draft.compute_logits(prenorm)
        draft_logits = draft.compute_draft_logits(prenorm)
    assert torch.isneginf(logits[:, ~in_draft]).all()
    assert torch.isfinite(logits[:, in_draft]).all()
    target_of_argmax = draft.draft_to_target_ids(draft_logits.argmax(-1))
    assert torch.equal(logits.argmax(-1), target_of_argmax)
    assert torch.equal(target_of_argmax, draft_logits.argmax(-1) + t["d2t"][draft_logits.argmax(-1)])


def test_without_embedding_it_shares_the_targets(tmp_path, seed):
    target_path = make_checkpoint(tmp_path / "target", "llama", seed=5)  # vocab 128, hidden 64
    tensors = _eagle3_tensors(seed=32, target_hidden=HIDDEN, with_embedding=False)
    draft = _load(_write_eagle3(tmp_path / "head", tensors))
    assert draft.embed_tokens is None and not draft.has_own_embedding
    tokens = 5
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (tokens,), generator=gen)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    with torch.no_grad(), forward_context(_prefill_metadata(tokens)):
        with pytest.raises(RuntimeError, match="share_embedding"):
            draft(ids, torch.arange(tokens), hidden)

    with pytest.raises(ValueError, match="does not fit the draft"):
        draft.share_embedding(VocabParallelEmbedding(VOCAB, HIDDEN + 8))
    target = _load(target_path)
    assert draft.share_embedding(target.model.embed_tokens)
    assert draft.embed_tokens.weight is target.model.embed_tokens.weight and not draft.has_own_embedding
    with torch.no_grad(), forward_context(_prefill_metadata(tokens)):
        prenorm = draft(ids, torch.arange(tokens), hidden)
    target_embedding = load_file(target_path / "model.safetensors")["model.embed_tokens.weight"]
    torch.testing.assert_close(prenorm, _reference_prenorm(tensors, target_embedding, ids, hidden),
                               atol=1e-5, rtol=1e-5)


def test_a_draft_with_its_own_embedding_keeps_it(eagle3_checkpoint):
    draft = _load(eagle3_checkpoint[0])
    own = draft.embed_tokens
    assert not draft.share_embedding(VocabParallelEmbedding(VOCAB, HIDDEN))
    assert draft.embed_tokens is own and draft.has_own_embedding


def test_bad_d2t_is_a_load_error(tmp_path):
    tensors = _eagle3_tensors(seed=33, target_hidden=HIDDEN, with_embedding=True)
    tensors["d2t"] = tensors["d2t"].clone()
    tensors["d2t"][-1] = VOCAB  # past the target vocabulary
    with pytest.raises(WeightLoadError, match="'d2t'.*outside the target vocabulary"):
        _load(_write_eagle3(tmp_path / "out_of_range", tensors))
    del tensors["d2t"]
    with pytest.raises(WeightLoadError, match="d2t"):
        _load(_write_eagle3(tmp_path / "missing", tensors))


def test_unsupported_configs_are_refused(tmp_path):
    tensors = _eagle3_tensors(seed=34, target_hidden=HIDDEN, with_embedding=True)
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        _load(_write_eagle3(tmp_path / "two_layers", tensors, num_hidden_layers=2))
    with pytest.raises(ValueError, match="use_aux_hidden_state"):
        _load(_write_eagle3(tmp_path / "no_aux", tensors, eagle_config={"use_aux_hidden_state": False}))


def test_aux_layer_ids_from_the_config(tmp_path):
    from transformers import AutoConfig

    def ids_for(name: str, **overrides) -> tuple[int, ...]:
        path = _write_eagle3(tmp_path / name, {}, **overrides)
        return Eagle3LlamaForCausalLM(AutoConfig.from_pretrained(path)).aux_hidden_state_layer_ids(36)

    assert ids_for("default") == (2, 18, 33)
    assert ids_for("inputs", eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}) == (2, 18, 33)
    # SpecForge counts layer outputs from 1: output of layer i = the state entering layer i + 1
    assert ids_for("outputs", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}) == (2, 18, 33)
    assert ids_for("top_level", eagle_aux_hidden_state_layer_ids=[3, 20, 36]) == (3, 20, 36)
    with pytest.raises(ValueError, match="not 3 increasing layer ids"):
        ids_for("past_the_end", eagle_aux_hidden_state_layer_ids=[2, 18, 37])


@pytest.mark.parametrize("layer_ids", ["default", (0, 3, 8)])
def test_llama_aux_hidden_states_are_those_entering_the_layers(tmp_path, seed, layer_ids):
    """Against transformers' output_hidden_states (entry i: the state entering layer i); id
    num_layers is the last layer's output before the final norm. (1e-4: eight layers of float32
    rounding at the large init scale the parity checkpoints use.)"""
    num_layers = 8
    path = make_checkpoint(tmp_path / "target", "llama", seed=seed % 1000, num_hidden_layers=num_layers)
    target = _load(path)
    ids = default_aux_layer_ids(num_layers) if layer_ids == "default" else layer_ids
    assert layer_ids != "default" or ids == (2, 4, 5)
    gen = torch.Generator().manual_seed(seed)
    tokens = 9
    input_ids = torch.randint(0, VOCAB, (tokens,), generator=gen)
    with torch.no_grad(), forward_context(_prefill_metadata(tokens)):
        plain = target(input_ids, torch.arange(tokens))
    assert not hasattr(target.model, "aux_hidden_states")  # nothing collected unless asked
    for layer in target.modules():
        if isinstance(layer, PagedKVLayer):
            layer.kv_cache.zero_()
    target.model.aux_hidden_state_layers = ids
    with torch.no_grad(), forward_context(_prefill_metadata(tokens)):
        hidden = target(input_ids, torch.arange(tokens))
    torch.testing.assert_close(hidden, plain, atol=0, rtol=0)
    aux = target.model.aux_hidden_states
    assert aux.shape == (tokens, 3 * HIDDEN)

    _, model_cls = hf_classes("llama")
    reference = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = reference.model(input_ids[None], output_hidden_states=True)
    for k, layer in enumerate(ids):
        got = aux[:, k * HIDDEN:(k + 1) * HIDDEN]
        if layer < num_layers:
            torch.testing.assert_close(got, out.hidden_states[layer][0], atol=1e-4, rtol=1e-4)
        else:  # the final norm of the last layer's output is the model's output
            normed = _rms_norm(got, reference.model.norm.weight)
            torch.testing.assert_close(normed, out.last_hidden_state[0], atol=1e-4, rtol=1e-4)
