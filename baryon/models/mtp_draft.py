"""What every multi-token-prediction draft model shares: the MTP layers of a checkpoint loaded as
a model of their own (DeepSeek's: models/deepseek_mtp.py; Qwen3-Next's and Qwen3.5's:
models/qwen3_next_mtp.py), built from and loaded like the layers of their main model."""

from __future__ import annotations

from typing import Any

from torch import nn


class MTPDraftModel(nn.Module):
    main_models: dict[str, type] = {}  # model_type -> the main model's class

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.main = self.main_models.get(getattr(config, "model_type", None))
        if self.main is None:
            raise ValueError(f"{type(self).__name__} does not serve the multi-token prediction layers of "
                             f"model_type {config.model_type!r}; supported: {sorted(self.main_models)}")
        self.config = config
        # the main model's checkpoint names (fused q / k / v, gate / up; per-expert tensors)
        self.packed_modules_mapping = self.main.packed_modules_mapping
        self.expert_projections = self.main.expert_projections
