"""Constrained decoding: a request's StructuredOutputsParams -> an xgrammar grammar, compiled off
the step loop (compiler.py), and per request a matcher that fills the allowed-token bitmask the
sampler applies to the logits (matcher.py)."""
