"""zentorch behind the kernel selector (kernels/cpu/zentorch_support.py, kernels/dense_linear.py,
kernels/quant/int8_zentorch.py) and the selector's timed choice (`select_fastest`).

The zentorch cases run where the extra is installed (`pip install -e ".[zen]"`, a CI step does it)
and the CPU has the instructions each op needs; elsewhere they skip with the reason the selector
gives. The timed choice and the fallback without zentorch run everywhere."""

from __future__ import annotations

import time

import pytest
import torch

from baryon import LLM, SamplingParams
from baryon.kernels import selector
from baryon.kernels.cpu import zentorch_support
from baryon.kernels.dense_linear import TorchDenseLinear, ZentorchDenseLinear
from baryon.kernels.quant.int8_gemm import int8_linear_reference, prepare_int8_weights
from baryon.kernels.quant.int8_zentorch import ZentorchInt8Linear
from baryon.quantization.int8 import quantize_int8_per_channel
from conftest import make_checkpoint, random_prompts

CPU = torch.device("cpu")


def need(kernel: type, **config) -> None:
    reason = kernel.unsupported_reason(CPU) or kernel.cannot_implement_reason(**config)
    if reason:
        pytest.skip(f"{kernel.__name__}: {reason}")


@pytest.mark.parametrize("kernel", [TorchDenseLinear, ZentorchDenseLinear], ids=["torch", "zentorch"])
def test_dense_linear_matches_f_linear(kernel, seed):
    need(kernel, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for m, k, n, bias in [(1, 64, 96, False), (5, 33, 17, True), (16, 576, 960, False), (37, 100, 3, True)]:
        x = torch.randn(m, 2 * k, generator=gen)[:, ::2]  # not contiguous
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        expected = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        got = kernel.forward(x, w, b)
        assert got.shape == (m, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4 * k ** 0.5)
        batched = kernel.forward(x.reshape(1, m, k), w, b)  # leading dimensions kept
        assert batched.shape == (1, m, n)


def test_zentorch_bf16_linear_needs_the_instructions():
    """zentorch's bf16 GEMM returns NaN on CPUs without avx512_bf16: never offered there."""
    reason = ZentorchDenseLinear.cannot_implement_reason(dtype=torch.bfloat16)
    if "avx512_bf16" not in zentorch_support.cpu_flags():
        assert reason is not None and "avx512_bf16" in reason
    assert "float16" in ZentorchDenseLinear.cannot_implement_reason(dtype=torch.float16)


def test_zentorch_int8_linear_matches_the_reference(seed):
    need(ZentorchInt8Linear, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for m, k, n, bias in [(1, 64, 96, False), (7, 128, 40, True), (32, 576, 960, False)]:
        x = torch.randn(m, k, generator=gen)
        w_q, w_scale = quantize_int8_per_channel(torch.randn(n, k, generator=gen))
        b = torch.randn(n, generator=gen) if bias else None
        weights = prepare_int8_weights(w_q, w_scale)
        x_scale = x.abs().amax(dim=1, keepdim=True) / 127  # per token, symmetric
        x_q = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
        expected = int8_linear_reference(x_q, x_scale, weights.w_q, weights.w_scale, torch.float32, b)
        got = ZentorchInt8Linear.forward_float(x, weights, b)
        exact = torch.nn.functional.linear(x, w_q.float() * w_scale[:, None], b)
        # Both round the activations to int8 per token; rounding ties may differ by one step.
        assert (got - expected).abs().max() <= 0.02 * exact.abs().max()


def test_without_zentorch_the_cpu_choices_are_ours(monkeypatch):
    """No zentorch: the candidates say how to install it, and the choice is the torch kernel."""
    monkeypatch.setattr(zentorch_support.importlib.util, "find_spec", lambda name: None)
    zentorch_support._import_error.cache_clear()
    try:
        reason = ZentorchDenseLinear.unsupported_reason(CPU)
        if "avx2" in zentorch_support.cpu_flags():
            assert reason is not None and ".[zen]" in reason
        assert selector.select("dense_linear", CPU, dtype=torch.float32).name == "torch"
        assert selector.select("int8_linear", CPU, dtype=torch.float32).name in ("cpu", "torch")  # ours
    finally:
        zentorch_support._import_error.cache_clear()


class _Slow(selector.Kernel):
    name = "slow"
    calls = 0

    @classmethod
    def run(cls):
        cls.calls += 1
        time.sleep(0.004)


class _Fast(_Slow):
    name = "fast"
    calls = 0

    @classmethod
    def run(cls):
        cls.calls += 1


class _Refuses(_Slow):
    name = "refuses"

    @classmethod
    def cannot_implement_reason(cls, **config):
        return "not this shape"


def test_select_fastest_times_the_able_candidates_once(monkeypatch):
    family = f"timed_{time.monotonic_ns()}"
    monkeypatch.setitem(selector._REGISTRY, family, [f"{__name__}:_Refuses", f"{__name__}:_Slow", f"{__name__}:_Fast"])
    _Slow.calls = _Fast.calls = 0
    trial = lambda cls: cls.run  # noqa: E731
    assert selector.select_fastest(family, CPU, trial, n=1) is _Fast  # the slow one listed first loses
    assert _Slow.calls == 6 and _Fast.calls == 6  # a warm-up and five timed runs each
    assert selector.select_fastest(family, CPU, trial, n=1) is _Fast and _Fast.calls == 6  # remembered
    monkeypatch.setenv(f"BARYON_KERNEL_{family.upper()}", "slow")
    assert selector.select_fastest(family, CPU, trial, n=1) is _Slow  # forced: no timing
    monkeypatch.setenv(f"BARYON_KERNEL_{family.upper()}", "refuses")
    with pytest.raises(ValueError, match="not this shape"):
        selector.select_fastest(family, CPU, trial, n=1)


def test_select_fastest_with_one_able_candidate_does_not_time(monkeypatch):
    family = f"timed_{time.monotonic_ns()}"
    monkeypatch.setitem(selector._REGISTRY, family, [f"{__name__}:_Refuses", f"{__name__}:_Fast"])
    _Fast.calls = 0
    assert selector.select_fastest(family, CPU, lambda cls: cls.run) is _Fast and _Fast.calls == 0


def _greedy(path, prompts, monkeypatch, dense: str, **engine):
    with monkeypatch.context() as patch:
        patch.setenv("BARYON_KERNEL_DENSE_LINEAR", dense)
        llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.05,
                  **engine)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = llm.engine.core.runner.model
    kernels = {getattr(m.__dict__.get("dense_kernel"), "name", "torch") for m in model.modules() if hasattr(m, "output_size")}
    return kernels, [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                     for o in outputs]


def test_engine_on_zentorch_linears_follows_torch(tmp_path, monkeypatch, seed):
    """A dense float32 model with every linear on zentorch: the same greedy tokens as F.linear,
    logprobs within float32 summation-order noise."""
    need(ZentorchDenseLinear, dtype=torch.float32)
    ckpt = make_checkpoint(tmp_path / "llama", "llama", seed=seed, initializer_range=0.2)
    prompts = random_prompts(4, 128, 3, 40, seed)
    zen_kernels, got = _greedy(ckpt, prompts, monkeypatch, "zentorch")
    torch_kernels, expected = _greedy(ckpt, prompts, monkeypatch, "torch")
    assert zen_kernels == {"zentorch"} and torch_kernels == {"torch"}
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-3, rtol=1e-3)


def _prompt_logprobs(path, prompts, monkeypatch, int8_kernel: str) -> torch.Tensor:
    """Teacher-forced logprobs of every prompt token after the first, online W8A8."""
    with monkeypatch.context() as patch:
        patch.setenv("BARYON_KERNEL_INT8_LINEAR", int8_kernel)
        llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.05,
                  quantization="w8a8")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor([entry[token].logprob for out, prompt in zip(outputs, prompts)
                         for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])])


def test_engine_on_zentorch_int8_follows_the_reference(tmp_path, monkeypatch, seed):
    """Online W8A8 on zentorch's dynamic int8 linear (activations rounded to int8 per token)
    against the torch kernel (float activations): the prompts' teacher-forced logprobs differ only
    by the activation rounding."""
    need(ZentorchInt8Linear, dtype=torch.float32)
    ckpt = make_checkpoint(tmp_path / "llama", "llama", seed=seed)
    prompts = random_prompts(4, 128, 8, 40, seed)
    got = _prompt_logprobs(ckpt, prompts, monkeypatch, "zentorch")
    expected = _prompt_logprobs(ckpt, prompts, monkeypatch, "torch")
    difference = (got - expected).abs()
    # Measured on a Xeon (AVX-512 VNNI): mean 0.025, max 0.14 nats. Wrong kernels (zentorch on an
    # AVX2-only CPU) are off by whole nats.
    assert difference.mean() < 0.06 and difference.max() < 0.5, (difference.mean(), difference.max())


def test_decoder_layer_op_keeps_layers_whose_linears_timed_faster_elsewhere(tiny_llama, monkeypatch):
    """A timed choice of another dense kernel leaves the layer in the C++ decoder-layer op (the
    timing does not count the calls the op saves); forcing that kernel takes the layer out."""
    from baryon.layers.fused_decoder_layer import why_not_fused

    llm = LLM(str(tiny_llama), skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.05)
    layer = llm.engine.core.runner.model.model.layers[0]
    if why_not_fused(layer) is not None:
        pytest.skip(f"the decoder-layer op does not cover this layer here: {why_not_fused(layer)}")
    layer.self_attn.qkv_proj.dense_kernel = ZentorchDenseLinear
    assert why_not_fused(layer) is None
    monkeypatch.setenv("BARYON_KERNEL_DENSE_LINEAR", "zentorch")
    assert "forced onto zentorch" in why_not_fused(layer)


def test_zentorch_leaves_the_weight_it_multiplies_as_it_was(seed):
    """ZenDNN's default weight cache reorders a weight in place; the selector times zentorch on a
    layer's own weight and F.linear (or a tied embedding) may read it afterwards, so baryon turns
    the cache off before importing zentorch."""
    need(ZentorchDenseLinear, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(96, 64, generator=gen), torch.randn(16, 64, generator=gen)
    original = weight.clone()
    for _ in range(3):
        out = ZentorchDenseLinear.forward(x, weight, None)
    assert torch.equal(weight, original)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, original), atol=1e-4, rtol=1e-4)


def test_zentorch_multiplies_new_values_at_an_address_it_has_seen(seed):
    """ZenDNN's copy-beside cache finds a weight by its address: new values where an earlier
    weight lived (a freed weight's memory reused by a second engine in one process, here the same
    tensor overwritten, which is that case made certain) were multiplied as the old ones."""
    need(ZentorchDenseLinear, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(16, 64, generator=gen), torch.randn(96, 64, generator=gen)
    for _ in range(3):
        ZentorchDenseLinear.forward(x, weight, None)
        weight.copy_(torch.randn(96, 64, generator=gen))
        torch.testing.assert_close(ZentorchDenseLinear.forward(x, weight, None),
                                   torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-4)
