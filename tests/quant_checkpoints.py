"""Tiny quantized checkpoints in the published layouts, written from a float checkpoint.

Every builder takes a folder written by `conftest.make_checkpoint` (one float32 model.safetensors)
and writes a new folder: config.json with a `quantization_config`, the other files copied, and
model.safetensors holding what the quantizer of that format writes. Every nn.Linear weight of the
decoder layers (q/k/v/o, gate/up/down and every expert's gate/up/down) is quantized with
round-to-nearest; embed_tokens, lm_head, the norms and MoE routers (`mlp.gate`) stay float and are
listed the way the format lists modules it leaves alone.

Each builder returns a `QuantizedCheckpoint` whose `reference` is the float32 state dict the
quantized one stands for: the dequantized weight of every quantized linear (computed from the
tensors as written, in float32) and every other tensor as written, upcast. `write_reference`
saves it as a float checkpoint with the same config minus `quantization_config`, so an engine
loading both must produce the same greedy tokens.

Layouts (names per linear module `<m>`, N = out_features, K = in_features):

- `fp8_per_tensor` (AutoFP8 / vLLM): <m>.weight float8_e4m3fn [N, K], <m>.weight_scale float32 [],
  static activations add <m>.input_scale float32 []; {"quant_method": "fp8", "activation_scheme",
  "ignored_layers"}. w = q * weight_scale.
- `fp8_block` (DeepSeek-V3 / Qwen3-FP8): <m>.weight fp8 [N, K], <m>.weight_scale_inv float32 (or
  bf16) [ceil(N/bn), ceil(K/bk)]; {"quant_method": "fp8", "activation_scheme": "dynamic",
  "fmt": "e4m3", "weight_block_size": [bn, bk], "modules_to_not_convert"}. w = q * s[i//bn, j//bk].
- `compressed_tensors` (llm-compressor's save path through the compressed_tensors package:
  apply_quantization_config, min-max qparams by calculate_qparams, ModelCompressor.compress_model,
  update_config): tensor names, dtypes, packing and the JSON are the package's own.
- `gptq` (AutoGPTQ / GPTQModel checkpoint_format "gptq", v1 zeros): <m>.qweight int32
  [K*bits/32, N] (packed along K), <m>.qzeros int32 [G, N*bits/32] (zero - 1, packed along N),
  <m>.scales float16 [G, N], <m>.g_idx int32 [K]. w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
- `awq` (AutoAWQ GEMM): <m>.qweight int32 [K, N/8], <m>.qzeros int32 [G, N/8] (both packed along N
  in AWQ's order: nibble i of word j holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]), <m>.scales
  float16 [G, N]. w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n].
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The linear layers of the decoder that every format quantizes (experts included).
QUANTIZED_LINEAR = re.compile(  # (DeepSeek: the latent-attention projections and shared experts too;
    # V3.2's indexer: its query and key projections, not weights_proj, as the published FP8 checkpoint)
    r"^model\.layers\.\d+\.(self_attn\.([qkvo]_proj|qkv_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj"
    r"|indexer\.(wq_b|wk))|linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)"  # (Qwen3-Next's Gated DeltaNet)
    r"|mlp\.((experts\.\d+|shared_experts?)\.)?(gate|up|down|gate_up)_proj)\.weight$")
# (Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: each quantized as one module.)
# Linear modules that stay float: the LM head, MoE routers and shared-expert gates.
FLOAT_LINEAR = re.compile(r"^(lm_head|model\.layers\.\d+\.mlp\.(gate|shared_expert_gate))\.weight$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class QuantizedCheckpoint:
    path: Path
    reference: dict[str, torch.Tensor]  # float32 state dict the checkpoint stands for
    quantized: list[str]  # checkpoint module names whose weights were quantized
    float_linears: list[str]  # linear modules kept float (lm_head, routers, modules_to_not_convert)
    quantization_config: dict
    # Per quantized module, the tensors that hold its weight and scales (for breaking them).
    tensors: dict[str, list[str]] = field(default_factory=dict)


# -- files -----------------------------------------------------------------------------------

def load_float(src: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(src) / "model.safetensors")


def linear_names(state: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> list[str]:
    """Module names (no `.weight`) of the decoder linears a format quantizes, less `skip`."""
    return [k[: -len(".weight")] for k in sorted(state) if QUANTIZED_LINEAR.match(k)
            and k[: -len(".weight")] not in skip]


def write_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None) -> Path:
    """dst: src's files but model.safetensors = `tensors` and config.json with (or without)
    `quantization_config`."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name != "config.json" and not item.name.endswith(
                (".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    return dst


def write_reference(qc: QuantizedCheckpoint, dst: Path) -> Path:
    """A float32 checkpoint holding `qc.reference`, config without quantization_config."""
    return write_checkpoint(qc.path, dst, qc.reference, None)


def float_linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The LM head (a module even when tied to the embeddings) and the MoE routers."""
    return sorted({"lm_head", *(k[: -len(".weight")] for k in state if FLOAT_LINEAR.match(k))})


def _float_reference(tensors: dict[str, torch.Tensor], dequantized: dict[str, torch.Tensor]) -> dict:
    """Reference state dict: the dequantized weights, and every other stored float tensor upcast
    (a quantized module's scales etc. left out; its bias kept)."""
    ref = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if t.is_floating_point() and t.dtype != FP8 and (module not in dequantized or leaf == "bias"):
            ref[name] = t.float()
    for module, w in dequantized.items():
        ref[f"{module}.weight"] = w
    return ref


def _cast_dense(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}


# -- FP8 --------------------------------------------------------------------------------------

def fp8_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest e4m3 of w / scale (scale broadcastable)."""
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_per_tensor(src: Path, dst: Path, activation_scheme: str = "dynamic", seed: int = 0) -> QuantizedCheckpoint:
    """AutoFP8 / vLLM per-tensor FP8: weight fp8, weight_scale float32 [], input_scale float32 []
    (static activations only)."""
    assert activation_scheme in ("static", "dynamic")
    state = load_float(src)
    gen = torch.Generator().manual_seed(seed)
    out, deq, tensors = {}, {}, {}
    modules = linear_names(state)
    for name, t in state.items():
        module = name[: -len(".weight")]
        if module not in modules:
            out[name] = t
            continue
        scale = (t.abs().amax().float() / FP8_MAX).clamp(min=1e-12).reshape(())
        q = fp8_quantize(t, scale)
        out[f"{module}.weight"], out[f"{module}.weight_scale"] = q, scale
        tensors[module] = [f"{module}.weight", f"{module}.weight_scale"]
        if activation_scheme == "static":  # a calibrated activation max / 448
            out[f"{module}.input_scale"] = (2.0 + 6.0 * torch.rand((), generator=gen)) / FP8_MAX
            tensors[module].append(f"{module}.input_scale")
        deq[module] = q.float() * scale
    ignored = float_linear_names(state)
    config = {"quant_method": "fp8", "activation_scheme": activation_scheme, "ignored_layers": ignored}
    path = write_checkpoint(src, dst, out, config)
    return QuantizedCheckpoint(path, _float_reference(out, deq), modules, ignored, config, tensors)


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-[bn, bk]-block amax / 448 as float32 [ceil(N/bn), ceil(K/bk)] (partial edge blocks)."""
    bn, bk = block
    n, k = w.shape
    padded = torch.zeros(math.ceil(n / bn) * bn, math.ceil(k / bk) * bk)
    padded[:n, :k] = w.float().abs()
    amax = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).amax(dim=(1, 3))
    return (amax / FP8_MAX).clamp(min=1e-12)


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    return scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def fp8_block(src: Path, dst: Path, block: tuple[int, int] = (16, 16), scale_dtype: torch.dtype = torch.float32,
              dense_dtype: torch.dtype = torch.float32, not_convert: tuple[str, ...] = ()) -> QuantizedCheckpoint:
    """DeepSeek-V3 / Qwen3-FP8 block FP8: weight fp8, weight_scale_inv [ceil(N/bn), ceil(K/bk)]
    (w = q * scale_inv). `not_convert`: decoder modules also left unquantized (listed, with
    lm_head, in modules_to_not_convert); every unquantized tensor is stored as `dense_dtype`."""
    state = _cast_dense(load_float(src), dense_dtype)
    out, deq, tensors = {}, {}, {}
    modules = linear_names(state, skip=not_convert)
    for name, t in state.items():
        module = name[: -len(".weight")]
        if module not in modules:
            out[name] = t
            continue
        scale = block_scales(t, block).to(scale_dtype)
        full = expand_blocks(scale, tuple(t.shape), block)
        q = fp8_quantize(t, full)
        out[f"{module}.weight"], out[f"{module}.weight_scale_inv"] = q, scale
        tensors[module] = [f"{module}.weight", f"{module}.weight_scale_inv"]
        deq[module] = q.float() * full
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": list(block)}
    if not_convert:
        config["modules_to_not_convert"] = ["lm_head", *not_convert]
    path = write_checkpoint(src, dst, out, config)
    return QuantizedCheckpoint(path, _float_reference(out, deq), modules,
                               [*float_linear_names(state), *not_convert], config, tensors)


# -- compressed-tensors ------------------------------------------------------------------------

class _ExpertMLP(nn.Module):
    """One expert as three nn.Linear (what llm-compressor calibrates MoE experts as)."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = state[f"{prefix}.{proj}.weight"]
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            linear.weight.data.copy_(w)
            setattr(self, proj, linear)


def _hf_model_for_compression(src: Path, state: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    """The transformers model of `src` in `dtype`, its MoE experts as per-expert nn.Linear; its
    state dict names are the checkpoint's."""
    from conftest import hf_classes_from_path

    _, model_cls = hf_classes_from_path(Path(src))
    model = model_cls.from_pretrained(src, dtype=dtype).eval()
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not isinstance(experts, nn.ModuleList):
            count = len({k.split(".")[5] for k in state if k.startswith(f"model.layers.{i}.mlp.experts.")})
            layer.mlp.experts = nn.ModuleList(
                _ExpertMLP({k: v.to(dtype) for k, v in state.items()}, f"model.layers.{i}.mlp.experts.{e}")
                for e in range(count))
    names = set(model.state_dict()) - ({"lm_head.weight"} - set(state))  # (tied: not in the checkpoint)
    assert names == set(state), f"model names differ from the checkpoint's: {sorted(names ^ set(state))[:6]}"
    return model


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min / max of a weight over the reduction of its quantization strategy (a min-max observer)."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    w = w.float()
    if strategy == "tensor":
        return w.amin(), w.amax()
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if strategy in ("group", "tensor_group"):  # (tensor_group: NVFP4's groups under a global scale)
        v = w.unflatten(-1, (-1, args.group_size))
        return v.amin(-1), v.amax(-1)
    if strategy == "block":
        bn, bk = args.block_structure
        v = w.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
        return v.amin(dim=(1, 3)), v.amax(dim=(1, 3))
    raise ValueError(f"no min-max observer for strategy {strategy}")


def ct_scheme(preset: str | None = None, **weights) -> "QuantizationScheme":  # noqa: F821
    """A compressed-tensors QuantizationScheme targeting Linear: a preset name ("FP8",
    "FP8_DYNAMIC", "W8A8", "W4A16", ...), its weight args overridden by `weights`."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weights:
        args = {**scheme.weights.model_dump(), **weights}
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args),
                                    input_activations=scheme.input_activations)
    return scheme


def compressed_tensors(src: Path, dst: Path, scheme, ignore: list[str] | None = None, kv_cache: bool = False,
                       dtype: torch.dtype = torch.float32, seed: int = 0) -> QuantizedCheckpoint:
    """Quantize `src` with the compressed_tensors package the way llm-compressor saves a model:
    apply_quantization_config, weight qparams from calculate_qparams over min-max observations,
    static activation / KV scales set as a calibration would, ModelCompressor.compress_model,
    then the model's state dict saved and ModelCompressor.update_config writing config.json.

    `ignore`: None writes the ignore list the package derives from the model (every linear left
    unquantized, by name: what llm-compressor saves); a list (e.g. ["lm_head", "re:.*mlp.gate$"])
    is applied and written as given. `kv_cache`: also an FP8 per-tensor kv_cache_scheme
    (self_attn.k_scale / v_scale). `dtype`: the model's dtype when quantized (scales take it)."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam, is_module_quantized

    state = load_float(src)
    model = _hf_model_for_compression(src, state, dtype)
    kv_scheme = (QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
                 if kv_cache else None)
    config = QuantizationConfig(config_groups={"group_0": scheme},
                                ignore=list(ignore) if ignore is not None else ["lm_head", "re:.*mlp\\.gate$"],
                                kv_cache_scheme=kv_scheme)
    apply_quantization_config(model, config, show_progress=False)
    gen = torch.Generator().manual_seed(seed)
    quantized = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not is_module_quantized(module):
                continue
            if isinstance(module, nn.Linear):
                quantized[name] = module
                args = module.quantization_scheme.weights
                global_scale = None
                if hasattr(module, "weight_global_scale"):  # NVFP4: the whole tensor's, before the groups'
                    global_scale = generate_gparam(module.weight.float().amin(), module.weight.float().amax())
                    module.weight_global_scale.data.copy_(global_scale.reshape(module.weight_global_scale.shape))
                if hasattr(module, "input_global_scale"):  # a calibrated activation global scale
                    module.input_global_scale.data.fill_(float(100.0 + 400.0 * torch.rand((), generator=gen)))
                scale, zero = calculate_qparams(*_minmax(module.weight, args), args, global_scale=global_scale)
                module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
                if hasattr(module, "input_scale"):  # static activations: a calibrated max / 448
                    module.input_scale.data.fill_(float(2.0 + 6.0 * torch.rand((), generator=gen)) / FP8_MAX)
            for kv in ("k_scale", "v_scale"):
                if hasattr(module, kv):
                    getattr(module, kv).data.fill_(float(1.0 + 4.0 * torch.rand((), generator=gen)) / FP8_MAX)
    compressor = ModelCompressor.from_pretrained_model(model)
    if ignore is not None:
        compressor.quantization_config.ignore = list(ignore)
    compressor.compress_model(model)
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
    out = {k: v.detach().clone() for k, v in model.state_dict().items()
           if k != "lm_head.weight" or k in state}  # a tied LM head is not saved
    if kv_cache and not any(k.endswith(".self_attn.k_scale") for k in out):
        # With transformers >= 5.24 the package attaches no KV scales to the attention modules
        # (nor infers the scheme back): write what it writes otherwise, a [1] scale per layer
        # and projection (calibrated max / 448), and the scheme in the config.
        for key in [k for k in out if k.endswith(".self_attn.k_proj.weight")]:
            prefix = key[:-len("k_proj.weight")]
            for kv in ("k_scale", "v_scale"):
                scale = float(1.0 + 4.0 * torch.rand((), generator=gen)) / FP8_MAX
                out[prefix + kv] = torch.full((1,), scale, dtype=dtype)
        compressor.quantization_config.kv_cache_scheme = kv_scheme
    dst = Path(dst)
    write_checkpoint(src, dst, out, None)
    compressor.update_config(str(dst))
    qconfig = json.loads((dst / "config.json").read_text())["quantization_config"]

    deq, tensors = {}, {}
    for name, module in quantized.items():
        local = {k[len(name) + 1:]: v for k, v in out.items()
                 if k.startswith(f"{name}.") and "." not in k[len(name) + 1:]}
        tensors[name] = sorted(f"{name}.{k}" for k in local)
        scheme_ = module.quantization_scheme
        mine = ct_dequantize(local, scheme_.weights)
        # The package's own decompressor (in float32, so that the products round once as ours do).
        compressor_cls = BaseCompressor.get_value_from_registry(getattr(scheme_.format, "value", scheme_.format))
        theirs = compressor_cls.decompress({k: (v.float() if v.is_floating_point() and v.dtype != FP8 else v)
                                            for k, v in local.items()}, scheme_)["weight"]
        # (The package returns NVFP4 weights in bf16: ours, in float32, rounds to them.)
        assert torch.equal(mine.to(theirs.dtype), theirs), f"{name}: our unpacking differs from compressed_tensors'"
        deq[name] = mine
    float_linears = float_linear_names(out)
    ref = _float_reference({k: v for k, v in out.items() if not k.endswith((".k_scale", ".v_scale"))}, deq)
    return QuantizedCheckpoint(dst, ref, sorted(deq), float_linears, qconfig, tensors)


def unpack_int32(packed: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """compressed-tensors' dense packing, read independently: element i of a row sits at global
    bit i * bits (little-endian words, elements straddle words when 32 % bits != 0), stored with
    an offset of 2**(bits-1). Returns int32 values, `count` along `dim`."""
    words = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    bit = torch.arange(count) * bits
    lo = (words[..., bit // 32] >> (bit % 32))
    hi_index = torch.clamp(bit // 32 + 1, max=words.shape[-1] - 1)
    hi = words[..., hi_index] << (32 - bit % 32)
    value = ((lo | torch.where(bit % 32 + bits > 32, hi, torch.zeros_like(hi))) & ((1 << bits) - 1))
    return (value - (1 << (bits - 1))).to(torch.int32).movedim(-1, dim)


def ct_dequantize(local: dict[str, torch.Tensor], args) -> torch.Tensor:
    """float32 weight of one compressed-tensors module from its tensors (weight / weight_packed,
    weight_scale, weight_zero_point, weight_shape): (q - z) * s, scales broadcast per strategy."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    scale = local["weight_scale"].float()
    if strategy == "tensor_group":  # NVFP4: e2m1 codes, two a byte (low nibble first), e4m3 scales per 16
        packed = local["weight_packed"]
        codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
        e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        values = e2m1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        group_scale = scale / local["weight_global_scale"].float().reshape(())
        return values * group_scale.repeat_interleave(args.group_size, 1)
    if "weight_packed" in local:
        n, k = (int(x) for x in local["weight_shape"])
        q = unpack_int32(local["weight_packed"], args.num_bits, k, dim=1).float()
    else:
        q = local["weight"].float()
        n, k = q.shape
    zero = local.get("weight_zero_point")
    if zero is not None:
        if zero.dtype == torch.int32 and "weight_packed" in local:  # packed along the output dim
            zero = unpack_int32(zero, args.num_bits, n, dim=0)
        zero = zero.float()
    if strategy == "block":
        bn, bk = args.block_structure
        expand = lambda t: t.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # noqa: E731
    elif strategy == "group":
        expand = lambda t: t.repeat_interleave(args.group_size, 1)[:, :k]  # noqa: E731
    else:  # tensor [1] or channel [N, 1]: broadcasts
        expand = lambda t: t  # noqa: E731
    value = q - expand(zero) if zero is not None else q
    return value * expand(scale)


# -- GPTQ -------------------------------------------------------------------------------------

def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] ints in [0, 2**bits) -> int32 [R * bits / 32, C]: element r of word i at bits
    (r % (32 / bits)) * bits (GPTQ's qweight packing along K)."""
    per = 32 // bits
    v = values.to(torch.int64).unflatten(0, (-1, per))
    shifts = (torch.arange(per) * bits).view(1, per, 1)
    return _to_int32((v << shifts).sum(1))


def pack_cols(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] ints -> int32 [R, C * bits / 32]: nibble i of word j holds column j*per + order[i]
    (order = identity for GPTQ's qzeros, AWQ_ORDER for AWQ)."""
    per = 32 // bits
    order = order or list(range(per))
    v = values.to(torch.int64).unflatten(1, (-1, per))[:, :, order]
    shifts = (torch.arange(per) * bits).view(1, 1, per)
    return _to_int32((v << shifts).sum(2))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per) * bits).view(1, per, 1)
    return ((words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).flatten(0, 1)


def unpack_cols(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    per = 32 // bits
    order = order or list(range(per))
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per) * bits).view(1, 1, per)
    nibbles = (words.unsqueeze(2) >> shifts) & ((1 << bits) - 1)  # [R, W, i]: column j*per + order[i]
    out = torch.empty_like(nibbles)
    out[:, :, order] = nibbles
    return out.flatten(1, 2)


def gptq_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, perm: torch.Tensor | None):
    """Round-to-nearest in GPTQ's grid (Quantizer.find_params): returns q [N, K] in [0, maxq],
    zeros [G, N] (>= 1: v1 stores zero - 1), scales float16 [G, N], g_idx int32 [K]."""
    n, k = w.shape
    maxq = 2**bits - 1
    gs = k if group_size == -1 else group_size
    position = torch.arange(k) if perm is None else torch.argsort(perm)  # position of column k in the order
    g_idx = (position // gs).to(torch.int32)
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(groups, n, dtype=torch.float16), torch.empty(groups, n, dtype=torch.int64)
    w = w.float()
    for g in range(groups):
        cols = w[:, g_idx == g]
        xmin = cols.amin(1).clamp(max=0)
        xmax = cols.amax(1).clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        both_zero = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(both_zero, -1.0, xmin), torch.where(both_zero, 1.0, xmax)
        scale = (xmax - xmin) / maxq
        zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
        scales[g] = scale.half()
        zeros[g] = zero.clamp(1, maxq).to(torch.int64)  # zero 0 would be stored as -1: not in v1
    s = scales.float()[g_idx.long()].T  # [N, K]
    z = zeros[g_idx.long()].T
    q = torch.clamp(torch.round(w / s) + z, 0, maxq).to(torch.int64)
    return q, zeros, scales, g_idx


def input_key(module: str) -> str:
    """One name for the modules that read one input (q/k/v; gate/up, also an expert's)."""
    return re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gate_up", module))


def gptq(src: Path, dst: Path, bits: int = 4, group_size: int = 32, desc_act: bool = False, sym: bool = True,
         seed: int = 0, shared_order: bool = True, static_groups: bool = False, v2: bool = False,
         lm_head: bool = False, not_convert: tuple[str, ...] = ()) -> QuantizedCheckpoint:
    """AutoGPTQ / GPTQModel checkpoint_format "gptq" (v1): qweight, qzeros (zero - 1), scales fp16,
    g_idx; desc_act: columns grouped in a random order (g_idx[k] = position(k) // group_size), one
    order per input (GPTQ's order sorts the diagonal of the input's Hessian, so q/k/v share one,
    gate/up another; an expert's gate/up share theirs). shared_order=False gives every module its
    own order (not what GPTQ writes: for testing that an engine refuses or handles it).
    static_groups (with desc_act): the groups are fixed before the columns are reordered, so g_idx
    stays k // group_size (GPTQModel's static_groups=True). v2: checkpoint_format "gptq_v2"
    (GPTQModel's), whose qzeros hold the zeros themselves. lm_head: the LM head quantized too
    (GPTQModel's lm_head=True, written in the config). not_convert: decoder modules left float
    (modules_to_not_convert)."""
    assert bits in (4, 8)
    state = load_float(src)
    gen = torch.Generator().manual_seed(seed)
    out, deq, tensors, perms = {}, {}, {}, {}
    modules = linear_names(state, skip=not_convert) + (["lm_head"] if lm_head else [])
    for name, t in state.items():
        module = name[: -len(".weight")]
        if module not in modules:
            out[name] = t
            continue
        perm = None
        if desc_act and not static_groups:  # modules reading one input share its Hessian, so its column order
            key = input_key(module) if shared_order else module
            if key not in perms:
                perms[key] = torch.randperm(t.shape[1], generator=gen)
            perm = perms[key]
        q, zeros, scales, g_idx = gptq_quantize(t, bits, group_size, sym, perm)
        out[f"{module}.qweight"] = pack_rows(q.T, bits)
        v1_zeros = pack_cols(zeros - 1, bits)
        out[f"{module}.qzeros"] = pack_cols(zeros, bits) if v2 else v1_zeros
        out[f"{module}.scales"] = scales
        out[f"{module}.g_idx"] = g_idx
        tensors[module] = [f"{module}.{p}" for p in ("qweight", "qzeros", "scales", "g_idx")]
        deq[module] = gptq_dequantize(out[f"{module}.qweight"], v1_zeros, scales, g_idx, bits)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq_v2" if v2 else "gptq", "damp_percent": 0.01, "true_sequential": True,
              "static_groups": static_groups, "lm_head": lm_head, "model_name_or_path": None,
              "model_file_base_name": "model"}
    if not_convert:
        config["modules_to_not_convert"] = list(not_convert)
    path = write_checkpoint(src, dst, out, config)
    (path / "quantize_config.json").write_text(json.dumps(config, indent=2))
    float_linears = [*(m for m in float_linear_names(state) if m not in modules), *not_convert]
    return QuantizedCheckpoint(path, _float_reference(out, deq), modules, float_linears, config, tensors)


def ct_group_act_order(src: Path, dst: Path, bits: int = 4, group_size: int = 32, sym: bool = True,
                       seed: int = 0) -> QuantizedCheckpoint:
    """compressed-tensors pack-quantized with `actorder: "group"` (llm-compressor's GPTQ with
    activation ordering before compressed-tensors 0.20 removed the mode; published checkpoints
    keep it): GPTQ's grid and random column order per input (`gptq_quantize`), stored as
    weight_packed int32 [N, K*bits/32] (codes along K, low bits first), weight_scale [N, G],
    weight_zero_point int32 [N*bits/32, G] (asymmetric only, packed along N), weight_shape and
    weight_g_idx int32 [K]. Written independently of the package (it no longer reads the mode)."""
    assert bits in (4, 8)
    state = load_float(src)
    gen = torch.Generator().manual_seed(seed)
    out, deq, tensors, perms = {}, {}, {}, {}
    modules = linear_names(state)
    for name, t in state.items():
        module = name[: -len(".weight")]
        if module not in modules:
            out[name] = t
            continue
        key = input_key(module)
        if key not in perms:  # modules reading one input share its order (as GPTQ's g_idx)
            perms[key] = torch.randperm(t.shape[1], generator=gen)
        q, zeros, scales, g_idx = gptq_quantize(t, bits, group_size, sym, perms[key])  # q [N, K] unsigned
        if sym:  # compressed-tensors' symmetric grid: absmax / (2**bits - 1) * 2, zero 2**(bits-1)
            # (GPTQ's leaves a group of one sign a scale of xmax / maxq with the zero mid-range)
            g, w = g_idx.long(), t.float()
            absmax = torch.stack([w[:, g == i].abs().amax(1) for i in range(scales.shape[0])])  # [G, N]
            scales = (absmax / ((2**bits - 1) / 2)).clamp(min=1e-8).half()
            q = torch.clamp(torch.round(w / scales.float()[g].T) + zeros[g].T, 0, 2**bits - 1).to(torch.int64)
        out[f"{module}.weight_packed"] = pack_cols(q, bits)  # unsigned code = signed code + 2**(bits-1)
        out[f"{module}.weight_scale"] = scales.T.contiguous()  # [N, G]
        if not sym:
            out[f"{module}.weight_zero_point"] = pack_rows(zeros.T, bits)  # [N*bits/32, G]
        out[f"{module}.weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        out[f"{module}.weight_g_idx"] = g_idx
        tensors[module] = sorted(k for k in out if k.startswith(f"{module}.weight_"))
        g = g_idx.long()
        deq[module] = ((q - zeros[g].T).float() * scales.float()[g].T).contiguous()  # [N, K]
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group_size,
               "actorder": "group", "dynamic": False, "observer": "minmax", "block_structure": None}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                            "output_activations": None, "format": "pack-quantized"}},
              "ignore": ["lm_head"], "kv_cache_scheme": None}
    path = write_checkpoint(src, dst, out, config)
    return QuantizedCheckpoint(path, _float_reference(out, deq), modules, float_linear_names(state), config, tensors)


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits) -> torch.Tensor:
    """w[n, k] = (q[k, n] - (stored_zero[g_idx[k], n] + 1)) * scales[g_idx[k], n], float32 [N, K]."""
    q = unpack_rows(qweight, bits)  # [K, N]
    z = unpack_cols(qzeros, bits) + 1  # [G, N]
    g = g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).T.contiguous()


# -- AWQ --------------------------------------------------------------------------------------

def awq(src: Path, dst: Path, group_size: int = 32, not_convert: tuple[str, ...] = ()) -> QuantizedCheckpoint:
    """AutoAWQ GEMM (version "gemm", 4 bits, zero points): qweight [K, N/8], qzeros [G, N/8]
    packed in AWQ's order, scales float16 [G, N]. not_convert: decoder modules left float."""
    state = load_float(src)
    out, deq, tensors = {}, {}, {}
    modules = linear_names(state, skip=not_convert)
    for name, t in state.items():
        module = name[: -len(".weight")]
        if module not in modules:
            out[name] = t
            continue
        w = t.float()
        n, k = w.shape
        v = w.unflatten(1, (-1, group_size))  # [N, G, g] (AutoAWQ's pseudo_quantize_tensor)
        max_val, min_val = v.amax(-1), v.amin(-1)
        scales = ((max_val - min_val).clamp(min=1e-5) / 15).half()  # [N, G]
        zeros = (-torch.round(min_val / scales.float())).clamp(0, 15)
        s = scales.float().repeat_interleave(group_size, 1)
        z = zeros.repeat_interleave(group_size, 1)
        q = torch.clamp(torch.round(w / s) + z, 0, 15).to(torch.int64)  # [N, K]
        out[f"{module}.qweight"] = pack_cols(q.T, 4, AWQ_ORDER)
        out[f"{module}.qzeros"] = pack_cols(zeros.T.to(torch.int64), 4, AWQ_ORDER)
        out[f"{module}.scales"] = scales.T.contiguous()
        tensors[module] = [f"{module}.{p}" for p in ("qweight", "qzeros", "scales")]
        deq[module] = awq_dequantize(out[f"{module}.qweight"], out[f"{module}.qzeros"], out[f"{module}.scales"],
                                     group_size)
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": list(not_convert) or None}
    path = write_checkpoint(src, dst, out, config)
    float_linears = [*float_linear_names(state), *not_convert]
    return QuantizedCheckpoint(path, _float_reference(out, deq), modules, float_linears, config, tensors)


def awq_dequantize(qweight, qzeros, scales, group_size) -> torch.Tensor:
    """w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n], float32 [N, K]."""
    q = unpack_cols(qweight, 4, AWQ_ORDER)  # [K, N]
    z = unpack_cols(qzeros, 4, AWQ_ORDER).repeat_interleave(group_size, 0)
    s = scales.float().repeat_interleave(group_size, 0)
    return ((q - z).float() * s).T.contiguous()


# -- what the engine holds -------------------------------------------------------------------

def engine_layout(reference: dict[str, torch.Tensor], converters: dict | None = None) -> dict[str, torch.Tensor | tuple]:
    """The reference weights fused the way the engine holds them: module name -> weight
    (qkv_proj = cat(q, k, v), gate_up_proj = cat(gate, up), o_proj, down_proj; DeepSeek's latent
    projections and shared experts as they are, gate/up fused; Qwen3-Next's linear attention under
    self_attn, its rows reordered by the model's `converters` (checkpoint_converters)) and, for
    `...mlp.experts`, (w13 [E, 2I, H] = gate rows then up rows, w2 [E, H, I])."""
    layout: dict = {}
    converters = converters or {}
    layers = sorted({int(m.group(1)) for k in reference if (m := re.match(r"model\.layers\.(\d+)\.", k))})
    for i in layers:
        p = f"model.layers.{i}"
        attn = [reference.get(f"{p}.self_attn.{x}_proj.weight") for x in "qkv"]
        if all(a is not None for a in attn):
            layout[f"{p}.self_attn.qkv_proj"] = torch.cat(attn)
        for name in ("qkv_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # unfused
                     "indexer.wq_b", "indexer.wk", "indexer.weights_proj"):  # (V3.2's indexer)
            if f"{p}.self_attn.{name}.weight" in reference:
                layout[f"{p}.self_attn.{name}"] = reference[f"{p}.self_attn.{name}.weight"]
        if f"{p}.self_attn.q_proj.weight" in reference and f"{p}.self_attn.k_proj.weight" not in reference:
            layout[f"{p}.self_attn.q_proj"] = reference[f"{p}.self_attn.q_proj.weight"]  # DeepSeek-V2-Lite
        if f"{p}.mlp.gate_up_proj.weight" in reference:  # (Phi-3: fused in the checkpoint)
            layout[f"{p}.mlp.gate_up_proj"] = reference[f"{p}.mlp.gate_up_proj.weight"]
            layout[f"{p}.mlp.down_proj"] = reference[f"{p}.mlp.down_proj.weight"]
        for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            if f"{p}.linear_attn.{name}.weight" in reference:
                weight = reference[f"{p}.linear_attn.{name}.weight"]
                layout[f"{p}.self_attn.{name}"] = converters[name](weight) if name in converters else weight
        if f"{p}.mlp.shared_expert_gate.weight" in reference:
            layout[f"{p}.mlp.shared_expert_gate"] = reference[f"{p}.mlp.shared_expert_gate.weight"]
        for mlp in ("mlp", "mlp.shared_experts", "mlp.shared_expert"):
            if f"{p}.{mlp}.gate_proj.weight" in reference:
                layout[f"{p}.{mlp}.gate_up_proj"] = torch.cat([reference[f"{p}.{mlp}.gate_proj.weight"],
                                                               reference[f"{p}.{mlp}.up_proj.weight"]])
                layout[f"{p}.{mlp}.down_proj"] = reference[f"{p}.{mlp}.down_proj.weight"]
        experts = sorted({int(m.group(1)) for k in reference if (m := re.match(rf"{p}\.mlp\.experts\.(\d+)\.", k))})
        if experts:
            e = f"{p}.mlp.experts"
            w13 = torch.stack([torch.cat([reference[f"{e}.{j}.gate_proj.weight"], reference[f"{e}.{j}.up_proj.weight"]])
                               for j in experts])
            w2 = torch.stack([reference[f"{e}.{j}.down_proj.weight"] for j in experts])
            layout[e] = (w13, w2)
    return layout
