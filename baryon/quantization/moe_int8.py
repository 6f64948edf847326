"""INT8 W8A8 experts (compressed-tensors `int-quantized` MoE checkpoints: int8 weights with
per-channel scales, dynamic per-token int8 activations), held as stored.

The checkpoint's per-expert tensors stack as FP8 channel-scaled experts do (`moe_fp8.py`):
    w13_weight int8 [E, 2I, H], w13_weight_scale [E, 2I, 1]; w2_weight int8 [E, H, I], w2_weight_scale [E, H, 1]
and run the FP8 experts' kernels on int8 codes (family `fused_moe_int8`): the channel scales
spread into (1 x 128) blocks, the activations quantized to int8 per token in groups of 128 (finer
than the checkpoint's per-token scale). On CPU the torch kernel dequantizes the weights per call.
"""

from __future__ import annotations

import torch

from baryon.quantization.moe_fp8 import Fp8MoEMethod


class Int8MoEMethod(Fp8MoEMethod):
    code_dtype = torch.int8
    family = "fused_moe_int8"

    def __init__(self) -> None:
        super().__init__(None, strategy="channel")
