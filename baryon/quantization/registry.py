"""Which `QuantizationConfig` a model loads with: the checkpoint's `quantization_config`
(`quant_method`), or the `quantization` engine argument (online quantization of a float
checkpoint, or a check that the checkpoint is in the format asked for)."""

from __future__ import annotations

from typing import Any

from baryon.quantization.base import QuantizationConfig

CHECKPOINT_FORMATS = ("fp8", "compressed-tensors", "gptq", "awq", "mxfp4", "bitsandbytes")
ONLINE = ("fp8", "w8a8", "w4a16")
ACCEPTED = tuple(dict.fromkeys(ONLINE + CHECKPOINT_FORMATS))


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    return config if isinstance(config, dict) else config.to_dict()


def _from_checkpoint(config: dict[str, Any]) -> QuantizationConfig:
    method = config.get("quant_method")
    if method == "fp8":
        from baryon.quantization.fp8 import Fp8Config

        return Fp8Config.from_config(config)
    if method == "compressed-tensors":
        from baryon.quantization.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig(config)
    if method == "gptq":
        from baryon.quantization.gptq_awq import GPTQConfig

        return GPTQConfig(config)
    if method == "awq":
        from baryon.quantization.gptq_awq import AWQConfig

        return AWQConfig(config)
    if method == "mxfp4":
        from baryon.quantization.mxfp4 import Mxfp4Config

        return Mxfp4Config(config)
    if method == "bitsandbytes":
        from baryon.quantization.bitsandbytes import BitsAndBytesConfig

        return BitsAndBytesConfig(config)
    raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, which is not "
                     f"supported; supported: {list(CHECKPOINT_FORMATS)}")


def _online(name: str) -> QuantizationConfig:
    if name == "fp8":
        from baryon.quantization.fp8 import Fp8Config

        return Fp8Config.online_config()
    if name == "w8a8":
        from baryon.quantization.int8 import OnlineInt8Config

        return OnlineInt8Config()
    from baryon.quantization.online_w4a16 import OnlineW4A16Config

    return OnlineW4A16Config()


def resolve_quantization(hf_config: Any, requested: str | None) -> QuantizationConfig | None:
    """The config to load with, None for a float model. A checkpoint in another format than the
    one `requested` is an error naming both."""
    if requested is not None and requested not in ACCEPTED:
        raise ValueError(f"quantization={requested!r} is not supported; accepted: {list(ACCEPTED)}")
    checkpoint = checkpoint_quantization(hf_config)
    if checkpoint is not None:
        method = checkpoint.get("quant_method")
        if requested is not None and requested != method:
            raise ValueError(f"quantization={requested!r} was asked for, but the checkpoint is quantized "
                             f"with {method!r}; leave quantization unset to load it as published")
        return _from_checkpoint(checkpoint)
    if requested is None:
        return None
    if requested not in ONLINE:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized in that format, but this "
                         f"checkpoint has no quantization_config; online quantization: {list(ONLINE)}")
    return _online(requested)
