"""Speculative decoding: proposers that draft tokens (n-gram lookup, draft models, EAGLE-3 heads,
DeepSeek MTP) and the rejection sampler that keeps the ones the target model agrees with."""
