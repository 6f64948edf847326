"""The quantization lifecycle.

A `QuantizationConfig` (parsed from the checkpoint's `quantization_config`, or built for online
quantization from the `quantization` engine argument) says, per layer, which `LinearMethod` (or
`MoEMethod`) holds its weights. A method:

    create_weights(layer)                 registers the parameters the checkpoint tensors load
                                          into (names as published: weight, weight_scale, qweight...)
    process_weights_after_loading(layer)  the one place layouts are repacked for the kernel
    apply(layer, x, bias)                 x [num_tokens, in] -> [num_tokens, out]
    dequantize(layer)                     the weight as held, float32 [out, in] (tests, CPU paths)

Layers start dense (`DenseLinearMethod`); the loader swaps methods in before any tensor loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from baryon.distributed.parallel_state import tp_push_target


def checkpoint_param(shape: tuple[int, ...], dtype: torch.dtype | None = None, *, output_dim: int | None = 0,
                     input_dim: int | None = 1, output_block: int = 1, per_shard: bool = False) -> nn.Parameter:
    """An empty parameter that a checkpoint tensor loads into, with how the layer's loader slices it:
    output_dim / input_dim are its dimensions along the layer's output and input features (None:
    not split along them), output_block the output features per entry along output_dim (128 for
    a 128 x 128 block scale, 8 for int4 codes packed along the outputs), per_shard a tensor with
    one entry per fused part (a per-tensor scale of q, k and v each)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    param.output_block, param.per_shard = output_block, per_shard
    return param


class LinearMethod:
    """Base of every weight layout a linear layer (or the LM head) can use."""

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack what loaded into the kernel's layout (default: nothing to do)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The weight as this method holds it, in float32 [out, in]."""
        raise NotImplementedError

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Selected rows of the stored weight as floats (an embedding lookup)."""
        raise NotImplementedError


class DenseLinearMethod(LinearMethod):
    """A float weight [out, in] multiplied with F.linear; on CPU by the `dense_linear` kernel
    that measured fastest on the layer's shape (F.linear unless zentorch is installed and wins);
    on a GPU a decode batch of one row takes the `dense_gemv` kernel (the weight streamed with
    programmatic dependent launch), batches of up to 64 rows the `dense_decode_linear` GEMM where
    its table has tiles for the layer's shape, other batches cuBLAS."""

    def create_weights(self, layer: nn.Module) -> None:
        layer.add_param("weight", (layer.output_size, layer.input_size))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        is_matrix = hasattr(layer, "output_size") or hasattr(layer, "compute_logits")  # not an embedding table
        if not is_matrix:
            return
        if weight.device.type == "cuda" and hasattr(layer, "output_size"):  # a projection, not the LM head
            from baryon.kernels.selector import select

            gemv = select("dense_gemv", weight.device, dtype=weight.dtype)
            layer.dense_gemv = gemv if gemv.name != "torch" else None
            decode = select("dense_decode_linear", weight.device, dtype=weight.dtype)
            layer.dense_decode = decode if decode.name != "torch" else None
        if weight.device.type != "cpu":
            return
        from baryon.kernels.selector import select_fastest

        def trial(kernel: type) -> Callable[[], None]:
            rows = [torch.randn(m, weight.shape[1], dtype=weight.dtype) for m in (1, 16)]  # decode batch sizes
            return lambda: [kernel.forward(x, weight, None) for x in rows]

        kernel = select_fastest("dense_linear", weight.device, trial, in_features=weight.shape[1],
                                out_features=weight.shape[0], dtype=weight.dtype)
        layer.dense_kernel = kernel if kernel.name != "torch" else None

    @staticmethod
    def gemv_for(layer: nn.Module, x: torch.Tensor) -> type | None:
        """The layer's `dense_gemv` kernel when x [rows, in] is a batch it serves, else None."""
        gemv = layer.__dict__.get("dense_gemv")
        return gemv if gemv is not None and x.dim() == 2 and x.shape[0] <= gemv.max_m else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        gemv = self.gemv_for(layer, x)
        if gemv is not None:
            # A row-parallel layer whose sum the next norm takes: the all-reduce may take the
            # output pushed to the peers by the GEMV itself (symm_mem_pushed).
            reducer = tp_push_target(x.shape[0], layer.weight.shape[0], x.dtype) \
                if layer.__dict__.get("pushes_partial") else None
            out = gemv.forward(x, layer.weight, bias, push=reducer and reducer.push_arguments())
            if reducer is not None:
                reducer.pushed(out)
            return out
        decode = layer.__dict__.get("dense_decode")
        if decode is not None and x.dim() == 2 and decode.serves(x.shape[0], *layer.weight.shape):
            return decode.forward(x, layer.weight, bias)
        kernel = layer.__dict__.get("dense_kernel")
        if kernel is not None:
            return kernel.forward(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float()

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


DENSE = DenseLinearMethod()


class ActivationQuantizedLinearMethod(LinearMethod):
    """FP8 / INT8 layers: after loading, `self.weights` holds what `self.kernel.prepare` made;
    a forward quantizes the activations (`quantize_input`) and runs the kernel. Decode batches
    (at most `gemv.max_m` rows) of methods that chose a GEMV skip the activation quantization:
    the weight-only GEMV (family `w8_gemv`) reads the 8-bit weight `gemv_weight` [N, K] with its
    rowwise scales `gemv_scale` [N] and multiplies the activations as they are. Somewhat larger
    batches (at most `decode_gemm.max_m` rows) of methods that chose a decode GEMM quantize the
    activations and run it over the same `gemv_weight` and `gemv_scale`. With the torch kernel (CPU)
    the weight is dequantized and multiplies the float activations instead."""

    kernel: type
    weights: object
    gemv: type | None = None
    decode_gemm: type | None = None
    gemv_weight: torch.Tensor
    gemv_scale: torch.Tensor

    def select_decode_kernels(self) -> None:
        """Picks the decode GEMV (family `w8_gemv`) and the decode GEMM (`fp8_decode_linear`) for
        this device, each None where only its torch reference runs (the layer's own path is as
        good there)."""
        from baryon.kernels.selector import select

        device = torch.get_default_device()
        gemv = select("w8_gemv", device, dtype=torch.get_default_dtype())
        decode_gemm = select("fp8_decode_linear", device)
        self.gemv = gemv if gemv.name != "torch" else None
        self.decode_gemm = decode_gemm if decode_gemm.name != "torch" else None

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (quantized [M, K], scales as the kernel reads them)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel.name == "torch":
            return F.linear(x, self.kernel.dequantize(self.weights).to(x.dtype), bias)
        x2 = x.reshape(-1, x.shape[-1])
        if getattr(self.kernel, "takes_float_input", False):  # quantizes the activations itself
            out = self.kernel.forward_float(x2, self.weights, bias)
        elif self.gemv is not None and x2.shape[0] <= self.gemv.max_m:
            out = self.gemv.forward(x2, self.gemv_weight, self.gemv_scale, None, bias)
        else:
            x_q, x_scale = self.quantize_input(x2)
            if self.decode_gemm is not None and x2.shape[0] <= self.decode_gemm.max_m:
                out = self.decode_gemm.forward(x_q, x_scale, self.gemv_weight, self.gemv_scale, x.dtype, bias)
            else:
                out = self.kernel.forward(x_q, x_scale, self.weights, x.dtype, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self.kernel.dequantize(self.weights)


class QuantizationConfig:
    """Which method holds each layer's weights. `prefix` is the layer's checkpoint module name
    (`model.layers.0.self_attn.q_proj`); a fused layer is asked once per checkpoint part."""

    name: str

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for a linear layer, None to leave it dense."""
        raise NotImplementedError

    def checkpoint_tensors(self, weights: Iterator[tuple[str, torch.Tensor, str]]
                           ) -> Iterator[tuple[str, torch.Tensor, str]]:
        """The checkpoint's (name, tensor, file) as the layers load them: as stored, unless the
        format is one no kernel here reads (bitsandbytes), whose weights are dequantized on the way."""
        return weights

    def lm_head_method(self) -> LinearMethod | None:
        """The method of the LM head (`lm_head`, untied) where the checkpoint quantized it; None
        (the default, as for online quantization) leaves it dense."""
        return None

    def moe_method(self, layer: nn.Module, prefix: str):
        """The MoEMethod for a FusedMoE layer (prefix `model.layers.0.mlp.experts`), None to leave
        it unquantized; a format that cannot hold experts says so."""
        raise ValueError(f"{self.name} quantization does not cover mixture-of-experts layers ({prefix}); for MoE "
                         f"models use quantization fp8 (online, or an FP8 checkpoint) or an MXFP4, compressed-tensors, "
                         f"GPTQ or AWQ checkpoint")


def is_ignored(prefix: str, patterns: list[str] | None) -> bool:
    """Whether `prefix` matches an ignore list: exact names, `re:` regular expressions
    (compressed-tensors), or plain substrings / module suffixes (`modules_to_not_convert`)."""
    import re

    for pattern in patterns or ():
        if pattern.startswith("re:"):
            if re.match(pattern[3:], prefix):
                return True
        elif prefix == pattern or prefix.endswith("." + pattern) or pattern in prefix.split(".") \
                or prefix.startswith(pattern + "."):
            return True
    return False
