"""Checkpoint tensor names -> the model's parameters.

A model class may declare:

- `packed_modules_mapping`: checkpoint modules fused into one parameter (q/k/v -> qkv_proj with
  shard ids "q", "k", "v"; gate/up -> gate_up_proj with shard ids 0, 1);
- `fused_checkpoint_parts(hf_config)`: modules the checkpoint already stores fused (Phi-3's
  `qkv_proj`, `gate_up_proj`): module name -> its parts in order, (shard id, output rows); each
  tensor of such a module is cut along its output rows into the parts, which load as the
  separate tensors of a packed module would (so tensor parallelism takes each part's slice);
- `weights_mapping`: substrings renamed before anything else (Mixtral's `.block_sparse_moe.`
  -> `.mlp.`);
- `expert_projections`: the per-expert module names of its MoE layers and the FusedMoE shard
  each fills (`{"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}`): a tensor
  `<prefix>.experts.<e>.<projection>.<suffix>` loads into `<prefix>.experts.w13_<suffix>`
  (w1, w3) or `<prefix>.experts.w2_<suffix>` as expert e;
- `stacked_expert_tensors`: checkpoints that publish each MoE layer's experts in one tensor
  (GPT-OSS: `<prefix>.experts.gate_up_proj`, `..._bias`, `..._blocks`, `..._scales`): tensor
  name -> (the FusedMoE parameter, a function from the published layout to the stacked one
  [experts, gate rows then up rows, ...], or None when they agree);
- `extra_layers_config_key`: a config field counting layers stored past `num_hidden_layers`
  (GLM's multi-token-prediction layers, `num_nextn_predict_layers`) that are skipped at load;
- `only_layers`: the layer indices a model loads, every other tensor skipped (DeepSeek's MTP
  layers loaded as a draft model of their own);
- `skipped_checkpoint_prefixes`: tensors of parts the model does not hold (an image-and-text
  checkpoint's vision tower), skipped;
- `checkpoint_converters(hf_config)`: checkpoint modules whose weight and bias the model takes in
  another row order (Cohere's q / k rows, for its interleaved rotary; Qwen3-Next's projections
  interleaved per key head): module name (`self_attn.q_proj`) -> a function reordering the rows of
  a [rows, ...] tensor from the published order to the model's, applied before loading (before a
  fused module is cut into its parts) to every tensor of the module at its granularity along the
  output rows (model_loader.reordered_rows: a quantized layout's scales and codes too).

FP8 KV-cache scales load into the attention layer (`<prefix>.self_attn.attn.k_scale` / `v_scale`)
under both published names: `self_attn.k_scale` (compressed-tensors' kv_cache_scheme, ModelOpt)
and `self_attn.k_proj.output_scale` (older FP8 exports).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<projection>[^.]+)\.(?P<suffix>.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<tensor>[^.]+)$")
_KV_SCALE = re.compile(r"^(?P<prefix>.*\.self_attn)\.(?:(?P<kv>[kv])_scale|(?P<proj>[kv])_proj\.output_scale)$")


@dataclass(frozen=True)
class Target:
    param: str  # parameter name in the model
    shard_id: Any = None  # which part of a fused parameter (None: all of it)
    expert_id: int | None = None  # expert parameters: the global expert id
    all_experts: bool = False  # a tensor of every expert of a layer (shard_id "w13" or "w2")
    convert: Callable | None = None  # a stacked experts tensor: published layout -> the parameter's
    row_order: Callable | None = None  # checkpoint_converters: reorders a [rows, ...] tensor's rows
    parts: tuple[tuple[Any, int], ...] = ()  # a fused checkpoint tensor: (shard id, output rows) in order

    @property
    def loaded_keys(self) -> set:
        """What `expected_shards` of the parameter lists for this tensor (each part's, for a fused one)."""
        if self.parts:
            return {shard_id for shard_id, _ in self.parts}
        return {self.shard_id if self.expert_id is None else (self.shard_id, self.expert_id)}


class CheckpointNames:
    def __init__(self, model: nn.Module, hf_config: Any) -> None:
        self.packed = getattr(model, "packed_modules_mapping", {})
        self.renames = getattr(model, "weights_mapping", {})
        self.projections = getattr(model, "expert_projections", {})
        self.stacked = getattr(model, "stacked_expert_tensors", {})
        key = getattr(model, "extra_layers_config_key", None)
        first = getattr(hf_config, "num_hidden_layers", 0)
        self.skipped_layers = range(first, first + (int(getattr(hf_config, key, 0) or 0) if key else 0))
        self.only_layers = getattr(model, "only_layers", None)
        self.skipped_prefixes = tuple(getattr(model, "skipped_checkpoint_prefixes", ()))
        fused = getattr(model, "fused_checkpoint_parts", None)
        self.fused = fused(hf_config) if fused is not None else {}
        converters = getattr(model, "checkpoint_converters", None)
        self.converters = converters(hf_config) if converters is not None else {}

    def target(self, name: str) -> Target | None:
        """Where checkpoint tensor `name` loads; None for a tensor that is skipped."""
        if self.skipped_prefixes and name.startswith(self.skipped_prefixes):
            return None
        for old, new in self.renames.items():
            name = name.replace(old, new)
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) in self.skipped_layers:
            return None
        if self.only_layers is not None and not (layer and int(layer.group(1)) in self.only_layers):
            return None
        kv_scale = _KV_SCALE.match(name)
        if kv_scale:
            return Target(f"{kv_scale['prefix']}.attn.{kv_scale['kv'] or kv_scale['proj']}_scale")
        stacked = _STACKED.match(name)
        if stacked and stacked["tensor"] in self.stacked:
            param, convert = self.stacked[stacked["tensor"]]
            return Target(f"{stacked['prefix']}.{param}", param.split("_")[0], None, True, convert)
        expert = _EXPERT.match(name)
        if expert and expert["projection"] in self.projections:
            shard = self.projections[expert["projection"]]
            stacked = "w2" if shard == "w2" else "w13"
            return Target(f"{expert['prefix']}.{stacked}_{expert['suffix']}", shard, int(expert["expert"]))
        row_order = self._converter(name)
        for packed, parts in self.packed.items():
            for part, shard_id in parts:
                if f".{part}." in name:
                    return Target(name.replace(f".{part}.", f".{packed}."), shard_id, row_order=row_order)
        for module, parts in self.fused.items():
            if f".{module}." in name:
                return Target(name, row_order=row_order, parts=tuple(parts))
        return Target(name, row_order=row_order)

    def _converter(self, name: str) -> Callable | None:
        """The model's converter of tensor `name` (checkpoint_converters), if its module has one."""
        for module, convert in self.converters.items():
            if f".{module}." in name:
                return convert
        return None

    def checkpoint_prefixes(self, module: str) -> list[str]:
        """The checkpoint module names a model module loads from (q/k/v for a fused qkv_proj)."""
        parent, _, leaf = module.rpartition(".")
        parts = [f"{parent}.{part}" for part, _ in self.packed[leaf]] if leaf in self.packed else [module]
        for old, new in self.renames.items():
            parts = [part.replace(new, old) for part in parts]
        return parts

    def expert_tensor_name(self, param: str, shard_id: str, expert_id: int) -> str:
        """The checkpoint name of one expert's tensor of a stacked parameter (for errors)."""
        prefix, _, leaf = param.rpartition(".")
        suffix = leaf.split("_", 1)[1]
        projection = next(p for p, s in self.projections.items() if s == shard_id)
        name = f"{prefix}.{expert_id}.{projection}.{suffix}"
        for old, new in self.renames.items():
            name = name.replace(new, old)
        return name
