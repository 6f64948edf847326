"""Mixture-of-experts layers: the router (gate), the routed experts (FusedMoE) and the blocks
that combine them with shared experts, as the model families publish them."""
