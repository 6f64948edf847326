"""Checkpoint loading: single-file, sharded and .bin checkpoints, broken checkpoints, dummy
weights, tied embeddings and Hub repo ids that cannot be reached.

Every good layout must load exactly the same parameters (and so give the same greedy tokens) as
the single-file safetensors checkpoint it was derived from; every broken one must be refused
with an error that names what is wrong (the tensor and/or the file).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baryon import LLM, SamplingParams
from baryon.hub import resolve_model_path
from baryon.loader.weights import WeightLoadError
from conftest import TEST_SEED, make_checkpoint, random_prompts

VOCAB = 128
NUM_LAYERS = 2
# Checkpoint name of a packed tensor part -> (fused parameter name, shard id in messages).
PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "0"), "up_proj": ("gate_up_proj", "1")}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# -- helpers ----------------------------------------------------------------------------------

def build(path, **kwargs) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, device="cpu", **kwargs)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def params_of(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.core.runner.model.named_parameters()}


def assert_same_params(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"parameter {name} differs"


def copy_config(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def variant(src: Path, dst: Path, mutate) -> tuple[Path, Path]:
    """A copy of the single-file checkpoint `src` whose tensors went through `mutate(dict)`."""
    copy_config(src, dst)
    tensors = load_file(src / "model.safetensors")
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst, dst / "model.safetensors"


def expected_names(name: str) -> list[str]:
    """Ways an error may name checkpoint tensor `name`: itself, or (for a part of a packed
    parameter) the fused parameter and the shard id."""
    for part, (fused, shard) in PACKED.items():
        if f".{part}." in name:
            return [name, name.replace(f".{part}.", f".{fused}.") + f"|{shard}"]
    return [name]


def assert_names_tensor(message: str, name: str) -> None:
    for option in expected_names(name):
        if "|" in option:
            fused, shard = option.split("|")
            if fused in message and shard in message:
                return
        elif option in message:
            return
    pytest.fail(f"the error does not name tensor {name!r}: {message}")


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A single-file checkpoint with biases (more tensors kinds: packed q/k/v and gate/up biases)
    whose weights change from run to run."""
    seed = (TEST_SEED + zlib.crc32(b"test_loader")) % 2**31
    return make_checkpoint(tmp_path_factory.mktemp("loader_ckpt"), "llama", seed=seed,
                           attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def ref_llm(ckpt) -> LLM:
    return build(ckpt)


@pytest.fixture(scope="module")
def ref_params(ref_llm) -> dict[str, torch.Tensor]:
    return params_of(ref_llm)


@pytest.fixture(scope="module")
def sharded(ckpt, tmp_path_factory) -> Path:
    """The same checkpoint re-saved by transformers as several shards with an index."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    path = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(path, max_shard_size="50KB")
    return path


@pytest.fixture
def prompts(seed) -> list[list[int]]:
    return random_prompts(3, VOCAB, 3, 24, seed)


# -- good layouts -----------------------------------------------------------------------------

def test_sharded_checkpoint_matches_single_file(sharded, ref_llm, ref_params, prompts):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    assert {os.path.basename(f) for f in index["weight_map"].values()} == {s.name for s in shards}

    llm = build(sharded)
    assert_same_params(params_of(llm), ref_params)
    assert greedy(llm, prompts) == greedy(ref_llm, prompts)


def test_index_decides_which_shard_owns_a_tensor(sharded, tmp_path, ref_params, seed):
    """A tensor that also appears (with other values) in a shard the index does not assign it to
    is read from its own shard only, not loaded twice."""
    path = tmp_path / "dup"
    shutil.copytree(sharded, path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    rng = random.Random(seed)
    name = rng.choice(sorted(weight_map))
    other = rng.choice(sorted({f for f in weight_map.values() if f != weight_map[name]}))
    tensors = load_file(path / other)
    tensors[name] = torch.full_like(load_file(path / weight_map[name])[name], 7.0)
    save_file(tensors, path / other, metadata={"format": "pt"})

    assert_same_params(params_of(build(path)), ref_params)


def _save_bin(src: Path, dst: Path) -> Path:
    """The checkpoint as a PyTorch .bin checkpoint (transformers >= 5 ignores
    safe_serialization=False and writes safetensors anyway; then torch.save writes the same
    pickle a .bin checkpoint holds)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(dst, safe_serialization=False)
    if not list(dst.glob("*.bin")):
        for f in dst.glob("*.safetensors*"):
            f.unlink()
        torch.save(load_file(src / "model.safetensors"), dst / "pytorch_model.bin")
    assert not list(dst.glob("*.safetensors")) and list(dst.glob("*.bin"))
    return dst


def test_bin_checkpoint_matches_safetensors(ckpt, tmp_path, ref_llm, ref_params, prompts):
    path = _save_bin(ckpt, tmp_path / "bin")
    (path / "training_args.bin").write_bytes(b"not weights")  # must be ignored
    for load_format in ("auto", "pt"):
        llm = build(path, load_format=load_format)
        assert_same_params(params_of(llm), ref_params)
    assert greedy(llm, prompts) == greedy(ref_llm, prompts)
    with pytest.raises(FileNotFoundError, match=r"safetensors") as e:
        build(path, load_format="safetensors")
    assert str(path) in str(e.value)


def test_sharded_bin_checkpoint_with_index(ckpt, tmp_path, ref_params, seed):
    path = copy_config(ckpt, tmp_path / "binshards")
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    random.Random(seed).shuffle(names)
    cut = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:cut], names[cut:])):
        file = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({n: tensors[n] for n in part}, path / file)
        weight_map.update({n: file for n in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_same_params(params_of(build(path)), ref_params)


def test_load_format_chooses_between_safetensors_and_bin(ckpt, tmp_path, ref_params):
    """With both formats present, auto/safetensors read the safetensors and pt the .bin."""
    path = tmp_path / "both"
    shutil.copytree(ckpt, path)
    perturbed = {n: t + 1.0 for n, t in load_file(ckpt / "model.safetensors").items()}
    torch.save(perturbed, path / "pytorch_model.bin")
    assert_same_params(params_of(build(path)), ref_params)
    assert_same_params(params_of(build(path, load_format="safetensors")), ref_params)
    from_bin = params_of(build(path, load_format="pt"))
    # (the KV-cache scales are not in these checkpoints: they keep their 1.0)
    assert_same_params(from_bin, {n: t if n.endswith(("k_scale", "v_scale")) else t + 1.0
                                  for n, t in ref_params.items()})


# -- broken checkpoints -----------------------------------------------------------------------

def test_index_listing_a_missing_shard(sharded, tmp_path, seed):
    path = tmp_path / "gone"
    shutil.copytree(sharded, path)
    victim = random.Random(seed).choice(sorted(path.glob("model-*.safetensors")))
    victim.unlink()
    with pytest.raises(FileNotFoundError) as e:
        build(path)
    assert victim.name in str(e.value) and "model.safetensors.index.json" in str(e.value)


MISSING_CASES = ["random", "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 f"model.layers.{NUM_LAYERS - 1}.self_attn.v_proj.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.mlp.up_proj.bias", "model.layers.1.mlp.down_proj.weight"]


@pytest.mark.parametrize("name", MISSING_CASES)
def test_missing_tensor(ckpt, tmp_path, seed, name):
    if name == "random":
        name = random.Random(seed).choice(sorted(load_file(ckpt / "model.safetensors")))
    path, _ = variant(ckpt, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(WeightLoadError) as e:
        build(path)
    assert "no tensor" in str(e.value) or "missing" in str(e.value)
    assert_names_tensor(str(e.value), name)


def test_missing_tensors_in_a_sharded_checkpoint(sharded, tmp_path, seed):
    """A tensor the index lists but whose shard does not hold it."""
    path = tmp_path / "holes"
    shutil.copytree(sharded, path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = random.Random(seed).choice(sorted(weight_map))
    tensors = load_file(path / weight_map[name])
    del tensors[name]
    save_file(tensors, path / weight_map[name], metadata={"format": "pt"})
    with pytest.raises(WeightLoadError) as e:
        build(path)
    assert_names_tensor(str(e.value), name)


@pytest.mark.parametrize("kind", ["unknown-module", "extra-layer", "extra-suffix"])
def test_unexpected_tensor(ckpt, tmp_path, seed, kind):
    rng = random.Random(seed)
    name = {
        "unknown-module": f"model.layers.{rng.randrange(NUM_LAYERS)}.mlp.extra_proj_{rng.randrange(1000)}.weight",
        "extra-layer": f"model.layers.{NUM_LAYERS + rng.randrange(3)}.input_layernorm.weight",
        "extra-suffix": f"model.layers.{rng.randrange(NUM_LAYERS)}.self_attn.q_proj.scale",
    }[kind]

    def add(tensors):
        tensors[name] = torch.randn(64, generator=torch.Generator().manual_seed(seed))

    path, file = variant(ckpt, tmp_path / "extra", add)
    with pytest.raises(WeightLoadError) as e:
        build(path)
    assert name in str(e.value) and str(file) in str(e.value)


def test_derived_rotary_buffers_in_a_checkpoint_are_ignored(ckpt, tmp_path, ref_params):
    """Old checkpoints carry rotary_emb.inv_freq buffers: not weights, not an error."""
    def add(tensors):
        for i in range(NUM_LAYERS):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)

    path, _ = variant(ckpt, tmp_path / "inv_freq", add)
    assert_same_params(params_of(build(path)), ref_params)


MISSHAPE_NAMES = ["random", "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                  "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                  "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight",
                  "model.layers.0.self_attn.q_proj.bias"]


def _misshape(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "one-more-row":
        return torch.randn(t.shape[0] + 1, *t.shape[1:])
    if how == "one-less-column" and t.dim() == 2:
        return torch.randn(t.shape[0], t.shape[1] - 1)
    if how == "transposed" and t.dim() == 2 and t.shape[0] != t.shape[1]:
        return torch.randn(t.shape[1], t.shape[0])
    if how == "broadcastable":  # a shape copy_ would silently broadcast
        return torch.randn(1, *t.shape[1:]) if t.dim() == 2 else torch.randn(1)
    return torch.randn(*t.shape, 2)  # an extra dimension


@pytest.mark.parametrize("name", MISSHAPE_NAMES)
def test_misshaped_tensor(ckpt, tmp_path, seed, name):
    rng = random.Random(seed)
    original = load_file(ckpt / "model.safetensors")
    if name == "random":
        name = rng.choice(sorted(original))
    how = rng.choice(["one-more-row", "one-less-column", "transposed", "broadcastable", "extra-dim"])
    bad = _misshape(original[name], how)
    assert bad.shape != original[name].shape

    def replace(tensors):
        tensors[name] = bad

    path, file = variant(ckpt, tmp_path / "misshaped", replace)
    with pytest.raises(WeightLoadError) as e:
        build(path)
    message = str(e.value)
    assert name in message and str(file) in message, message
    assert str(tuple(bad.shape)) in message, f"the error does not give the wrong shape ({how}): {message}"


@pytest.mark.parametrize("where", ["header", "data", "tiny"])
def test_truncated_safetensors(ckpt, tmp_path, seed, where):
    path = tmp_path / "truncated"
    shutil.copytree(ckpt, path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    rng = random.Random(seed)
    cut = {"header": rng.randrange(9, header), "data": rng.randrange(header + 1, len(data)),
           "tiny": rng.randrange(0, 8)}[where]
    file.write_bytes(data[:cut])
    with pytest.raises((WeightLoadError, FileNotFoundError)) as e:
        build(path)
    assert str(file) in str(e.value)


def test_corrupt_bin_file(ckpt, tmp_path, seed):
    path = _save_bin(ckpt, tmp_path / "bin")
    file = next(path.glob("*.bin"))
    data = file.read_bytes()
    file.write_bytes(data[: random.Random(seed).randrange(1, len(data) // 2)])
    with pytest.raises(WeightLoadError) as e:
        build(path)
    assert str(file) in str(e.value)


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "pt"])
def test_folder_without_weights(ckpt, tmp_path, load_format):
    path = copy_config(ckpt, tmp_path / "empty")
    (path / "training_args.bin").write_bytes(b"not weights")
    with pytest.raises(FileNotFoundError) as e:
        build(path, load_format=load_format)
    assert str(path) in str(e.value) and "weights" in str(e.value)


# -- dummy weights ----------------------------------------------------------------------------

def test_dummy_weights_need_no_weight_files(ckpt, tmp_path, seed, prompts, monkeypatch):
    path = copy_config(ckpt, tmp_path / "config_only")
    import baryon.loader.model_loader as model_loader

    def no_reading(*args, **kwargs):
        raise AssertionError("load_format='dummy' must not look for or read weight files")

    monkeypatch.setattr(model_loader, "weight_files", no_reading)
    monkeypatch.setattr(model_loader, "iterate_weights", no_reading)
    llm = build(path, load_format="dummy", seed=seed)
    outputs = greedy(llm, prompts)
    assert all(len(o) == GREEDY.max_tokens and all(0 <= t < VOCAB for t in o) for o in outputs)

    params = llm.engine.core.runner.model.named_parameters()
    for name, p in params:
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), f"{name} is not all ones"
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), f"{name} is not all zeros"
        elif name.endswith(("k_scale", "v_scale")):
            assert torch.equal(p, torch.ones_like(p)), f"{name} (a KV-cache scale) is not 1"
        else:
            assert p.numel() >= 512 and 0.01 < float(p.std()) < 0.04, f"{name}: std {float(p.std())}"

    # The same seed gives the same weights; garbage weight files are not even opened.
    (path / "model.safetensors").write_bytes(b"garbage")
    monkeypatch.undo()
    again = build(path, load_format="dummy", seed=seed)
    assert_same_params(params_of(again), params_of(llm))
    other = params_of(build(path, load_format="dummy", seed=seed + 1))
    assert not torch.equal(other["model.embed_tokens.weight"], params_of(llm)["model.embed_tokens.weight"])


# -- tied embeddings --------------------------------------------------------------------------

def test_tied_checkpoint_shares_embedding_and_lm_head(tmp_path, seed, prompts):
    from conftest import hf_greedy

    path = make_checkpoint(tmp_path / "tied", "llama", seed=seed, tie_word_embeddings=True)
    saved = load_file(path / "model.safetensors")
    llm = build(path)
    model = llm.engine.core.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, saved["model.embed_tokens.weight"])
    expected, _ = hf_greedy(path, prompts[0], GREEDY.max_tokens)
    assert greedy(llm, prompts[:1]) == [expected]

    # A tied checkpoint that also stores lm_head.weight (some exporters do) loads the same way.
    def add_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    with_head, _ = variant(path, tmp_path / "tied_with_head", add_head)
    again = build(with_head).engine.core.runner.model
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.lm_head.weight, saved["model.embed_tokens.weight"])


def test_untied_checkpoint_keeps_its_own_lm_head(ref_llm, ckpt):
    model = ref_llm.engine.core.runner.model
    saved = load_file(ckpt / "model.safetensors")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])


# -- Hub repo ids -----------------------------------------------------------------------------

@pytest.fixture
def hub_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import time.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_unreachable_hub_repo_id(hub_offline, tmp_path, seed):
    repo_id = f"baryon-test-org/no-such-model-{seed}"
    with pytest.raises(ValueError) as e:
        build(repo_id, download_dir=str(tmp_path / "hf_cache"))
    assert repo_id in str(e.value)
    # Also without a download_dir (the default cache holds no such repo).
    with pytest.raises(ValueError, match=repo_id):
        resolve_model_path(repo_id)


def test_offline_hub_repo_id_uses_a_cached_snapshot(hub_offline, ckpt, tmp_path, ref_params, prompts, ref_llm):
    repo_id = "baryon-test-org/cached-model"
    cache = tmp_path / "hf_cache"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / "models--baryon-test-org--cached-model"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(ckpt, repo_dir / "snapshots" / commit)

    llm = build(repo_id, download_dir=str(cache))
    assert Path(llm.config.model.model_path) == repo_dir / "snapshots" / commit
    assert_same_params(params_of(llm), ref_params)
    assert greedy(llm, prompts) == greedy(ref_llm, prompts)


def test_hub_connection_error_raises_value_error(monkeypatch, tmp_path, seed):
    """A Hub that cannot be reached without offline mode: connections are refused (a closed
    local port stands in for the Hub), and retries do not wait."""
    import time

    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(time, "sleep", lambda s: None)
    repo_id = f"baryon-test-org/no-such-model-{seed}"
    with pytest.raises(ValueError, match=repo_id):
        resolve_model_path(repo_id, None, str(tmp_path / "hf_cache"))
