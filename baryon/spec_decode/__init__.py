"""Speculative decoding: the rejection sampler that verifies draft tokens against the target model."""
