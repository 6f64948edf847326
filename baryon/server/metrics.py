"""/metrics: Prometheus metrics (prometheus_client), named like vLLM's with a `baryon:` prefix.

The engine's load (running and waiting requests, KV blocks used) and the token totals are read
from the engine client when scraped: the engine sends its load with every step it reports. The
latency histograms are observed here, per engine request, as outputs arrive:
time to first token, time per output token after the first, end-to-end latency.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from baryon.engine.core_client import AsyncEngineClient
from baryon.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                          0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, client: AsyncEngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def collect(self) -> Iterator:
        stats, labels = self.client.stats, [self.model_name]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"baryon:{name}", documentation, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"baryon:{name}", documentation, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Engine requests (one per choice) being decoded", stats.num_running)
        yield gauge("num_requests_waiting", "Engine requests waiting to be scheduled", stats.num_waiting)
        yield gauge("kv_cache_used_blocks", "KV-cache blocks in use", stats.num_kv_blocks_used)
        yield gauge("kv_cache_total_blocks", "KV-cache blocks in all", stats.num_kv_blocks)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use",
                    stats.num_kv_blocks_used / stats.num_kv_blocks if stats.num_kv_blocks else 0.0)
        yield gauge("engine_alive", "1 while the engine process serves requests", float(self.client.dead_reason is None))
        if self.client.config.speculative is not None:
            yield counter("spec_decode_num_drafts", "Verifications of a request with draft tokens", stats.spec_num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed", stats.spec_num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted",
                          stats.spec_num_accepted_tokens)
            per_position = CounterMetricFamily("baryon:spec_decode_num_accepted_tokens_per_pos",
                                               "Draft tokens accepted at each draft position",
                                               labels=["model_name", "position"])
            for position, count in enumerate(stats.spec_accepted_per_position):
                per_position.add_metric(labels + [str(position)], count)
            yield per_position
        yield counter("prompt_tokens", "Prompt tokens of the requests sent to the engine", self.client.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated", self.client.num_generation_tokens)


class ServerMetrics:
    def __init__(self, client: AsyncEngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(client, model_name))
        label = {"model_name": model_name}
        self.time_to_first_token = Histogram(
            "baryon:time_to_first_token_seconds", "Time to the first generated token", ["model_name"],
            buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**label)
        self.time_per_output_token = Histogram(
            "baryon:time_per_output_token_seconds", "Time per generated token after the first", ["model_name"],
            buckets=_TOKEN_LATENCY_BUCKETS, registry=self.registry).labels(**label)
        self.e2e_request_latency = Histogram(
            "baryon:e2e_request_latency_seconds", "Time from arrival to the last token", ["model_name"],
            buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**label)
        self._request_success = Counter(
            "baryon:request_success", "Requests finished, by finish reason", ["model_name", "finished_reason"],
            registry=self.registry)
        self._model_name = model_name

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    def finished(self, output: RequestOutput, elapsed_s: float, first_token_s: float) -> None:
        self.e2e_request_latency.observe(elapsed_s)
        for sample in output.outputs:
            self._request_success.labels(self._model_name, sample.finish_reason or "unknown").inc()
            if len(sample.token_ids) > 1:
                self.time_per_output_token.observe((elapsed_s - first_token_s) / (len(sample.token_ids) - 1))


class RequestTimer:
    """Observes one engine request's latencies from its stream of outputs."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token_s: float | None = None

    def observe(self, output: RequestOutput) -> None:
        now = time.perf_counter() - self.start
        if self.first_token_s is None and any(sample.token_ids for sample in output.outputs):
            self.first_token_s = now
            self.metrics.time_to_first_token.observe(now)
        if output.finished:
            self.metrics.finished(output, now, self.first_token_s if self.first_token_s is not None else now)
