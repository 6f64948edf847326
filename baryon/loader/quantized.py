"""Put a quantization scheme's methods into a built model (before its weights load) and repack
them once everything has loaded."""

from __future__ import annotations

import torch
from torch import nn

from baryon.layers.embedding import ParallelLMHead
from baryon.layers.fused_moe.layer import FusedMoE
from baryon.layers.linear import LinearBase
from baryon.layers.quantized_lm_head import QuantizedLMHead
from baryon.loader.names import CheckpointNames
from baryon.logger import get_logger
from baryon.quantization.base import QuantizationConfig

logger = get_logger(__name__)


def use_quantized_methods(model: nn.Module, quant_config: QuantizationConfig, names: CheckpointNames,
                          stored: set[str] | None = None) -> None:
    """Ask `quant_config` for each linear and MoE layer's method, by the layer's checkpoint names;
    the parts of a fused layer must agree (all quantized alike, or all left in float). stored: the
    checkpoint's tensor names, where known (whether it holds the LM head quantized)."""
    counts = {"quantized": 0, "float": 0}
    if _quantize_lm_head(model, quant_config, stored):
        counts["quantized"] += 1
    for module_name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            method = quant_config.moe_method(module, names.checkpoint_prefixes(module_name)[0])
            if method is not None:
                module.use_method(method)
        elif isinstance(module, LinearBase) and module.quantizable and not isinstance(module, QuantizedLMHead):
            prefixes = names.checkpoint_prefixes(module_name)
            methods = [quant_config.linear_method(module, prefix) for prefix in prefixes]
            if any(m is None for m in methods) and not all(m is None for m in methods):
                raise ValueError(f"{quant_config.name}: the parts {prefixes} of {module_name} are fused into one "
                                 f"layer but only some are quantized; they must be quantized alike")
            if methods[0] is None:
                counts["float"] += 1
                continue
            module.checkpoint_prefix = module_name
            module.use_method(methods[0])
        else:
            continue
        counts["quantized"] += 1
    logger.info("%s: %d layers quantized, %d left in float", quant_config.name, counts["quantized"], counts["float"])


def _quantize_lm_head(model: nn.Module, quant_config: QuantizationConfig, stored: set[str] | None) -> bool:
    """Swap the model's (untied) dense LM head for a QuantizedLMHead where the checkpoint quantized
    it: its scheme covers lm_head (GPTQ `lm_head: true`; a compressed-tensors group whose targets
    reach it, not ignored) and, where the tensor names are known, it stores lm_head tensors besides
    a weight and a bias (codes' and scales' names): a config that does not list a float head in
    `ignore` keeps it dense."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not isinstance(head, ParallelLMHead) or (embed is not None and head.weight is embed.weight):
        return False
    method = quant_config.lm_head_method()
    if method is None:
        return False
    if stored is not None and not any(name.startswith("lm_head.") and name not in ("lm_head.weight", "lm_head.bias")
                                      for name in stored):
        logger.info("%s: lm_head is stored in float (its config does not leave it out): kept dense",
                    quant_config.name)
        return False
    model.lm_head = QuantizedLMHead(head.vocab_size, head.weight.shape[1], method)
    for finishing in ("final_logit_multiplier", "final_logit_divisor", "final_logit_softcap"):
        setattr(model.lm_head, finishing, getattr(head, finishing))
    return True


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    """Each layer's weight method repacks what loaded; then modules that derive tensors from their
    layers' weights (`after_weights_loaded`: MLA's absorbed kv_b_proj) compute them."""
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    for module in model.modules():
        if hasattr(module, "after_weights_loaded"):
            module.after_weights_loaded()
