"""The proposer a speculative config asks for."""

from __future__ import annotations

from torch import nn

from baryon.config import EngineConfig
from baryon.spec_decode.proposer import PromptLookupProposer, Proposer


def build_proposer(config: EngineConfig, max_blocks_per_seq: int, target: nn.Module) -> Proposer:
    """target: the loaded target model (EAGLE-3 and MTP read its hidden states)."""
    spec = config.speculative
    if spec.method == "ngram":
        return PromptLookupProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from baryon.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, max_blocks_per_seq)
    from baryon.spec_decode.hidden_state_draft import HiddenStateProposer

    return HiddenStateProposer(config, max_blocks_per_seq, target)
