"""Serving benchmark: an async client that streams completions from an OpenAI-compatible server.

    baryon bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --random-input-len 1024 --random-output-len 128 --request-rate inf --max-concurrency 64

The workload follows `vllm bench serve --dataset-name random`, so the same command can point at
either server: `--num-prompts` requests whose prompts are random token ids (`--random-input-len`
of them, uniform in [0, vocabulary) with `--seed`; baryon's /v1/models reports its vocabulary
size, other servers are assumed to have at least 10000 tokens unless --random-vocab-size says)
and which generate exactly `--random-output-len` tokens (greedy, `ignore_eos`).
`--random-range-ratio r` draws each length uniformly from [len * (1 - r), len * (1 + r)].
Requests arrive as a Poisson process at `--request-rate` per second (inf: all at once), at most
`--max-concurrency` in flight.

Prints one JSON line: request / output / total token throughput, and TTFT (time to first
token), TPOT (time per output token after the first), ITL (time between streamed chunks) and
E2EL (end-to-end latency), each as mean, median and p99 in milliseconds (vLLM's names).
Only httpx is needed (no tokenizer, no model files), so it runs wherever the server runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field

# Token ids drawn for servers that do not report their vocabulary size.
_DEFAULT_VOCAB_RANGE = 10000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baryon bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="Server URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"],
                        help="API route (token-id prompts need the completions API)")
    parser.add_argument("--model", default=None, help="Model name to request (default: the server's first model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="Bearer key (default: $OPENAI_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--random-vocab-size", type=int, default=None,
                        help="Draw prompt token ids from [0, N) (default: the server's vocabulary, capped at 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Requests per second (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight (default: no limit)")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        parser.error("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if not 0 <= args.random_range_ratio < 1:
        parser.error("--random-range-ratio must be in [0, 1)")
    if not args.request_rate > 0:
        parser.error("--request-rate must be > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks


def build_workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        low, high = int(mean * (1 - args.random_range_ratio)), int(mean * (1 + args.random_range_ratio))
        return max(1, rng.randint(low, high))

    input_lens = [length(args.random_input_len) for _ in range(args.num_prompts)]
    output_lens = [length(args.random_output_len) for _ in range(args.num_prompts)]
    return [([rng.randrange(vocab) for _ in range(n)], m) for n, m in zip(input_lens, output_lens)]


async def stream_completion(client, url: str, headers: dict, payload: dict, result: RequestResult) -> RequestResult:
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency_s = last - start
        result.success = result.ttft_s > 0
        if not result.success:
            result.error = "the stream carried no tokens"
    except Exception as e:  # a benchmark records failures instead of stopping
        result.error = f"{type(e).__name__}: {e}"
    return result


async def server_model(client, base_url: str, headers: dict) -> tuple[str, int | None]:
    """(the first model's name, its vocabulary size if the server reports it)."""
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    card = response.json()["data"][0]
    return card["id"], card.get("vocab_size")


async def run(args: argparse.Namespace) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        served, served_vocab = await server_model(client, args.base_url, headers)
        model = args.model or served
        vocab = args.random_vocab_size or min(served_vocab or _DEFAULT_VOCAB_RANGE, _DEFAULT_VOCAB_RANGE)
        workload = build_workload(args, vocab)
        url = f"{args.base_url}{args.endpoint}"

        def payload(prompt: list[int], max_tokens: int) -> dict:
            return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        probe = await stream_completion(client, url, headers, payload(workload[0][0], 4), RequestResult(0))
        if not probe.success:
            raise SystemExit(f"baryon bench serve: the test request failed: {probe.error}")

        limit = asyncio.Semaphore(args.max_concurrency or len(workload))
        rng = random.Random(args.seed)

        async def one(prompt: list[int], max_tokens: int) -> RequestResult:
            async with limit:
                return await stream_completion(client, url, headers, payload(prompt, max_tokens), RequestResult(len(prompt)))

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in workload:
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    values = sorted(v * 1000 for v in values_s)
    if not values:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    p99 = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
    return {f"mean_{name}_ms": round(statistics.fmean(values), 3),
            f"median_{name}_ms": round(statistics.median(values), 3), f"p99_{name}_ms": round(p99, 3)}


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary = {
        "benchmark": "serve", "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "num_prompts": args.num_prompts, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
        "seed": args.seed, "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency, "completed": len(done), "failed": len(results) - len(done),
        "duration_s": round(duration, 3), "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 2),
    }
    summary.update(_stats("ttft", [r.ttft_s for r in done]))
    summary.update(_stats("tpot", tpots))
    summary.update(_stats("itl", [gap for r in done for gap in r.itl_s]))
    summary.update(_stats("e2el", [r.latency_s for r in done]))
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(asyncio.run(run(parse_args(argv)))), flush=True)


if __name__ == "__main__":
    main()
