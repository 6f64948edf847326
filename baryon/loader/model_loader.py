"""Build a model on its device and fill its parameters from the checkpoint (or randomly)."""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from baryon.config import ModelConfig
from baryon.hub import is_gguf
from baryon.loader.names import CheckpointNames
from baryon.loader.quantized import process_weights_after_loading, use_quantized_methods
from baryon.loader.weights import WeightLoadError, iterate_weights, stored_tensor_names, weight_files
from baryon.logger import get_logger
from baryon.models.registry import resolve_model_class
from baryon.quantization.base import QuantizationConfig
from baryon.quantization.registry import ONLINE, resolve_quantization

logger = get_logger(__name__)

# Checkpoint tensors that are buffers recomputed at build time, not weights.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(config: ModelConfig, device: torch.device, quant_config: QuantizationConfig | None = None
                ) -> nn.Module:
    """The model in the quantization scheme's weight layouts (quant_config: the one `config`
    resolves to, when the caller has it), its weights not filled (on the meta device nothing is
    allocated: benchmarks/memory_plan.py counts a rank's bytes that way)."""
    model_class = resolve_model_class(config.architecture)
    quant_config = quant_config or _quantization(config)
    with torch.device(device), _default_dtype(config.dtype):
        model = model_class(config.hf_config)
        if quant_config is not None:
            # (only read where it decides something: a scheme that would quantize the LM head)
            stored = None if config.load_format == "dummy" or quant_config.lm_head_method() is None else \
                stored_tensor_names(config.model_path, config.load_format)
            use_quantized_methods(model, quant_config, CheckpointNames(model, config.hf_config), stored)
    return model


def load_model(config: ModelConfig, device: torch.device, seed: int = 0) -> nn.Module:
    """Build the model, put in the quantization scheme's weight layouts, fill the weights
    (checkpoint or random), then let each layout repack what loaded."""
    quant_config = _quantization(config)
    model = build_model(config, device, quant_config)
    if config.load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        packed = keep_gguf_packed(model, config, device) if is_gguf(config.model_path) else frozenset()
        weights = checkpoint_weights(config, packed)
        load_weights(model, quant_config.checkpoint_tensors(weights) if quant_config else weights, config.hf_config)
    with torch.device(device), _default_dtype(config.dtype):
        process_weights_after_loading(model)
    return model.eval()


def _quantization(config: ModelConfig):
    """The checkpoint's quantization scheme or the one asked for; with dummy weights, a scheme
    named by the engine argument builds its layout from random float weights (as online
    quantization does), so benchmarks run the quantized kernels without a checkpoint."""
    if is_gguf(config.model_path):
        if config.quantization is not None:
            raise ValueError(f"quantization={config.quantization!r} does not apply to a GGUF file: its "
                             f"tensors carry their own quantization types")
        return None
    hf_config = config.hf_config
    if config.load_format == "dummy" and config.quantization in ONLINE:
        hf_config = copy.copy(hf_config)
        hf_config.quantization_config = None
    return resolve_quantization(hf_config, config.quantization)


def checkpoint_weights(config: ModelConfig,
                       packed: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor, str]]:
    """The checkpoint's tensors under their Hugging Face names, one at a time: from a GGUF file
    (dequantized, or packed for the names in `packed`) or from a folder's safetensors / .bin files."""
    if is_gguf(config.model_path):
        from baryon.loader.gguf import iterate_gguf_weights

        return iterate_gguf_weights(config.model_path, config.hf_config, packed)
    files, index = weight_files(config.model_path, config.load_format)
    return iterate_weights(files, index)


def keep_gguf_packed(model: nn.Module, config: ModelConfig, device: torch.device) -> frozenset[str]:
    """Switch the layers whose GGUF matrices are Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 to packed weights
    (BlockQuantLinearMethod) and return the checkpoint names to load packed. Only where a packed
    kernel runs: on CPU in float32 with the C++ kernels built (or the torch reference forced with
    BARYON_KERNEL_BLOCK_QUANT_LINEAR=torch); elsewhere everything is dequantized at load."""
    from baryon.kernels.selector import select
    from baryon.layers.embedding import VocabParallelEmbedding
    from baryon.layers.linear import LinearBase
    from baryon.loader.gguf import packable_formats
    from baryon.quantization.block_quant import BlockQuantLinearMethod

    from baryon.distributed.parallel_state import tp_world_size

    if device.type != "cpu" or config.dtype != torch.float32 or tp_world_size() > 1:
        return frozenset()  # (packed rows are not split over tensor-parallel ranks: dequantized)
    kernel = select("block_quant_linear", device, in_features=32, bits=4, dtype=config.dtype)
    if kernel.name == "torch" and "BARYON_KERNEL_BLOCK_QUANT_LINEAR" not in os.environ:
        logger.info("GGUF weights are dequantized at load: no packed CPU kernel here")
        return frozenset()
    # parameter -> {checkpoint name: (code bits, pair bytes)}
    sources: dict[str, dict[str, tuple[int, int] | None]] = defaultdict(dict)
    names = CheckpointNames(model, config.hf_config)
    for name, packed_format in packable_formats(config.model_path).items():
        target = names.target(name)
        if target is not None and target.expert_id is None and not target.all_experts:
            sources[target.param][name] = packed_format
    modules, packed = dict(model.named_modules()), set()
    head = getattr(model, "lm_head", None)
    for param_name, format_by_name in sources.items():
        module_name, _, leaf = param_name.rpartition(".")
        module, formats = modules.get(module_name), set(format_by_name.values())
        if leaf != "weight" or len(formats) != 1 or None in formats:
            continue  # not a matrix, or parts stored in different layouts: dequantized
        if isinstance(module, LinearBase):
            in_features = module.input_size
        elif isinstance(module, VocabParallelEmbedding) and module.tp_size == 1:
            in_features = module.weight.shape[1]
        else:
            continue
        tied_head = head is not None and head is not module and head.weight is module.weight
        bits, pair_bytes = formats.pop()
        method = BlockQuantLinearMethod(bits, in_features, device, config.dtype, pair_bytes)
        module.use_method(method)
        if tied_head:
            head.use_method(method, shared_weight=module.weight)
        packed.update(format_by_name)
    logger.info("GGUF: %d matrices kept packed (%s kernel)", len(packed), kernel.name)
    return frozenset(packed)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor, str]], hf_config) -> None:
    """Stream `weights` into the model's parameters through their weight_loaders; any missing,
    unexpected or mis-shaped tensor is a WeightLoadError naming the tensor and file."""
    params = dict(model.named_parameters())
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    names = CheckpointNames(model, hf_config)
    loaded: dict[str, set] = defaultdict(set)
    skipped = 0
    for name, tensor, file in weights:
        if name.endswith(_DERIVED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target = names.target(name)
        if target is None:
            skipped += 1
            continue
        param = params.get(target.param)
        if param is None and target.param.startswith("lm_head.") and name.startswith("lm_head."):
            raise WeightLoadError(f"the checkpoint stores the LM head quantized ({name!r} in {file}) but the model "
                                  f"holds it in float: its quantization_config leaves lm_head in float (GPTQ "
                                  f"`lm_head: false`, or compressed-tensors `ignore` listing lm_head), or "
                                  f"tie_word_embeddings ties it to the embeddings; give a config that matches the "
                                  f"tensors (GPTQ `lm_head: true`; no lm_head in `ignore`; untied)")
        if param is None:
            raise WeightLoadError(f"unexpected tensor {name!r} in {file}: {type(model).__name__} "
                                  f"has no parameter {target.param!r}")
        keys = param.expected_shards if target.all_experts else target.loaded_keys
        if keys & loaded[target.param]:
            raise WeightLoadError(f"tensor {name!r} in {file} is loaded twice")
        try:
            with torch.no_grad():
                if target.convert is not None:
                    tensor = target.convert(tensor)
                if target.row_order is not None:
                    tensor = reordered_rows(param, tensor, target.row_order, target.parts)
                if target.parts:
                    for shard_id, part in fused_parts(param, tensor, target.parts):
                        param.weight_loader(param, part, shard_id)
                elif target.expert_id is None and not target.all_experts:
                    param.weight_loader(param, tensor, target.shard_id)
                else:
                    param.weight_loader(param, tensor, target.shard_id, target.expert_id)
        except ValueError as e:
            raise WeightLoadError(f"tensor {name!r} in {file}: {e}") from e
        loaded[target.param] |= keys
    if skipped:
        logger.info("skipped %d tensors of parts this model does not hold (multi-token prediction layers: the "
                    "main model's or the draft's; a vision tower)", skipped)
    missing = [_missing_description(name, p, loaded[name], names) for name, p in params.items()
               if not p.expected_shards <= loaded[name]]
    if missing:
        raise WeightLoadError(f"the checkpoint has no tensor for {len(missing)} parameter(s) of "
                              f"{type(model).__name__}: {', '.join(missing[:10])}"
                              + (" ..." if len(missing) > 10 else ""))


def reordered_rows(param: nn.Parameter, tensor: torch.Tensor, convert, parts: tuple[tuple[Any, int], ...] | None
                   ) -> torch.Tensor:
    """A checkpoint tensor in the model's row order. `convert` (checkpoint_converters) reorders the
    rows of a [rows, ...] tensor; it is applied to the row indices, and the order they take is
    applied to the tensor at its own granularity along the parameter's output dimension: a row
    each for weights and per-channel scales, an entry of `output_block` rows for block scales and
    packed codes (each entry's rows must then come from one entry of the checkpoint's)."""
    dim = param.output_dim
    if dim is None or param.per_shard or tensor.dim() <= dim:
        return tensor  # no output rows (a per-tensor scale): nothing to reorder
    block = param.output_block
    rows = sum(count for _, count in parts) if parts else tensor.shape[dim] * block
    if tensor.shape[dim] != -(-rows // block):
        raise ValueError(f"shape {tuple(tensor.shape)} does not hold the module's {rows} output rows along dim {dim}")
    try:
        order = convert(torch.arange(rows).unsqueeze(1)).squeeze(1)  # [rows]: each model row's checkpoint row
    except RuntimeError as e:  # (the converter's reshape into heads)
        raise ValueError(f"shape {tuple(tensor.shape)} does not hold the module's rows in the layout the model "
                         f"reorders: {e}") from e
    if block > 1:
        source = order // block
        entries = source[::block]  # [ceil(rows / block)]: each entry's checkpoint entry
        if not torch.equal(source, entries.repeat_interleave(block)[:rows]):
            raise ValueError(f"the model reorders this module's rows as it loads them, which would split the "
                             f"{block}-row entries of this tensor (shape {tuple(tensor.shape)}); a checkpoint "
                             f"quantized with entries of whole heads (or this module left unquantized) loads")
        order = entries
    if tensor.dtype.itemsize == 1:  # (float8 codes: index_select through their bytes)
        return tensor.view(torch.uint8).index_select(dim, order).view(tensor.dtype)
    return tensor.index_select(dim, order)


def fused_parts(param: nn.Parameter, tensor: torch.Tensor, parts: tuple[tuple[Any, int], ...]
                ) -> Iterator[tuple[Any, torch.Tensor]]:
    """(shard id, its rows of `tensor`) for each part of a checkpoint tensor that stores several
    along the parameter's output dimension, in the checkpoint's layout (`output_block` output
    rows an entry: packed int4 codes, block scales). A tensor with no output dimension (a
    per-tensor scale, act order's g_idx) is every part's whole."""
    dim = param.output_dim
    if dim is None or param.per_shard or tensor.dim() <= dim:
        yield from ((shard_id, tensor) for shard_id, _ in parts)
        return
    total = sum(rows for _, rows in parts)
    block = param.output_block
    if tensor.shape[dim] != -(-total // block):
        raise ValueError(f"shape {tuple(tensor.shape)} does not hold the fused parts' {total} output rows "
                         f"({', '.join(f'{shard_id}: {rows}' for shard_id, rows in parts)}) along dim {dim}")
    offset = 0
    for shard_id, rows in parts:
        if offset % block or (rows % block and offset + rows != total):
            raise ValueError(f"fused part {shard_id!r} (rows {offset}..{offset + rows}) does not align with "
                             f"{block}-row entries of this tensor")
        yield shard_id, tensor.narrow(dim, offset // block, -(-rows // block))
        offset += rows


def _missing_description(name: str, param: nn.Parameter, loaded: set, names: CheckpointNames) -> str:
    absent = param.expected_shards - loaded
    if all(isinstance(shard, tuple) for shard in absent):  # stacked experts: name the checkpoint tensors
        tensors = sorted(names.expert_tensor_name(name, shard, expert) for shard, expert in absent)
        return f"{name} ({', '.join(tensors[:4])}{' ...' if len(tensors) > 4 else ''})"
    if len(param.expected_shards) > 1 and loaded:
        return f"{name} (missing shards {sorted(map(str, absent))})"
    module, _, tensor = name.rpartition(".")
    published = [f"{prefix}.{tensor}" for prefix in names.checkpoint_prefixes(module)]
    return name if published == [name] else f"{name} (from {' + '.join(published)})"


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of a realistic scale (normal, std 0.02); norms and KV-cache scales at 1,
    biases at 0. A checkpoint's quantized layout (load_format=dummy on a quantized checkpoint)
    gets random codes and small scales."""
    generators: dict[torch.device, torch.Generator] = {}
    params = dict(model.named_parameters())
    for name, param in params.items():
        gen = generators.setdefault(param.device, torch.Generator(param.device).manual_seed(seed))
        if name.endswith(("norm.weight", "k_scale", "v_scale")):
            param.fill_(1.0)
        elif name.endswith("g_idx"):  # GPTQ act order: a valid column -> group map (groups in order)
            groups, columns = params[name[:-len("g_idx")] + "scales"].shape[-2], param.shape[-1]
            param.copy_(torch.arange(columns, device=param.device) * groups // columns)
        elif name.endswith(".bias"):
            param.zero_()
        elif "scale" in name.rpartition(".")[2] and param.dtype == torch.uint8:
            param.fill_(120)  # e8m0 scales (MXFP4): 2^-7, random codes then spread like std-0.02 weights
        elif "scale" in name.rpartition(".")[2]:
            param.fill_(0.005)
        elif param.dtype in (torch.int32, torch.int8, torch.uint8, torch.int64):
            info = torch.iinfo(param.dtype)
            param.copy_(torch.randint(info.min, info.max, param.shape, generator=gen, device=param.device,
                                      dtype=torch.int64 if param.dtype == torch.int64 else torch.int32))
        elif not param.dtype.is_floating_point or param.element_size() == 1:  # fp8 codes
            param.copy_(torch.randn(param.shape, generator=gen, device=param.device))
        else:
            param.normal_(0.0, 0.02, generator=gen)
    logger.info("initialised %s with dummy weights", type(model).__name__)
