"""Benchmarks of the engine (latency, throughput); `benchmarks/*.py` and `baryon bench` run them."""
