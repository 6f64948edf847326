"""The command line: `baryon generate | chat | serve | bench`.

Engine flags are generated from `EngineArgs` (one flag per field, same defaults and help), so
the CLI and `LLM(**kwargs)` cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from baryon.engine_flags import add_engine_args, engine_kwargs
from baryon.logger import dump_stacks_on_sigusr1

# `baryon chat` samples like a chat UI by default (llama.cpp's temperature; nucleus 0.9); every
# value can be overridden with the sampling flags.
CHAT_MAX_TOKENS, CHAT_TEMPERATURE, CHAT_TOP_P = 1024, 0.7, 0.9


def add_sampling_args(parser: argparse.ArgumentParser, streamed: bool = False) -> None:
    """Sampling flags; `streamed` (chat: one reply streamed as text) leaves out --n and --logprobs."""
    group = parser.add_argument_group("sampling")
    if not streamed:
        group.add_argument("--n", type=int, default=1, help="Samples per prompt")
    group.add_argument("--max-tokens", type=int, default=16, help="Most new tokens per sample")
    group.add_argument("--min-tokens", type=int, default=0, help="Fewest new tokens before a stop may end a sample")
    group.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="Seed of each request's own sampling")
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--stop", action="append", default=None, help="Stop string (repeatable)")
    group.add_argument("--stop-token-ids", type=int, nargs="+", default=None)
    group.add_argument("--ignore-eos", action="store_true")
    if not streamed:
        group.add_argument("--logprobs", type=int, default=None, help="Top logprobs per generated token (--json)")


def sampling_params_from(args: argparse.Namespace):
    from baryon.sampling_params import SamplingParams

    return SamplingParams(
        n=getattr(args, "n", 1), max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, stop=args.stop, stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos, logprobs=getattr(args, "logprobs", None))


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise SystemExit("baryon generate: give --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def _as_json(output) -> dict[str, Any]:
    def logprobs(entries):
        if entries is None:
            return None
        return [{str(t): {"logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
                 for t, lp in entry.items()} for entry in entries]

    return {
        "prompt": output.prompt,
        "prompt_token_ids": output.prompt_token_ids,
        "outputs": [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                     "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                     "cumulative_logprob": o.cumulative_logprob, "logprobs": logprobs(o.logprobs)}
                    for o in output.outputs],
    }


def cmd_generate(args: argparse.Namespace) -> int:
    from baryon.llm import LLM

    prompts = _read_prompts(args)
    params = sampling_params_from(args)
    llm = LLM(**engine_kwargs(args))
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    for output in outputs:
        if args.json:
            print(json.dumps(_as_json(output), ensure_ascii=False))
            continue
        for sample in output.outputs:
            print(output.prompt + sample.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from baryon.chat import run_chat
    from baryon.llm import LLM

    params = sampling_params_from(args)
    llm = LLM(**engine_kwargs(args))
    return run_chat(llm, params, system=args.system)


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(f"baryon.bench.{args.benchmark}").main(args.bench_args)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from baryon.server.launch import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baryon", description="baryon: a fast LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="Generate text for prompts (offline, in this process)")
    gen.add_argument("--prompt", action="append", help="A prompt (repeatable)")
    gen.add_argument("--prompts-file", help="A file of prompts, one per line")
    gen.add_argument("--json", action="store_true", help="Print one JSON object per prompt")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="Chat with a model in the terminal (or through a pipe: one line per turn)",
                          description="Interactive chat: /reset forgets the conversation, /exit (or Ctrl-D) "
                                      "quits, Ctrl-C stops a reply. With piped stdin each line is a turn and "
                                      "each reply is printed on its own line(s). Sampling defaults here: "
                                      f"--temperature {CHAT_TEMPERATURE} --top-p {CHAT_TOP_P} "
                                      f"--max-tokens {CHAT_MAX_TOKENS}.")
    chat.add_argument("--system", default=None, help="System prompt (default: the chat template's own, if any)")
    # One conversation runs at a time: the KV cache is sized for one sequence, not the CPU default's 4 GiB.
    add_engine_args(chat, defaults={"max_num_seqs": 1})
    add_sampling_args(chat, streamed=True)
    chat.set_defaults(func=cmd_chat, max_tokens=CHAT_MAX_TOKENS, temperature=CHAT_TEMPERATURE, top_p=CHAT_TOP_P)
    from baryon.server.args import add_serve_args  # argparse only: no server imports here

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (engine in its own process)")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="Run a benchmark (prints one JSON line)",
                           description="baryon bench latency|throughput [flags]; see "
                                       "`baryon bench latency --help` for each benchmark's flags")
    bench.add_argument("benchmark", choices=["latency", "throughput", "serve"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dump_stacks_on_sigusr1()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"baryon {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
