"""Shared test helpers: tiny random Hugging Face checkpoints and the shared stories260K model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("BARYON_LOG_LEVEL", "WARNING")
if not torch.cuda.is_available():
    # Triton kernels are tested on CPU through the interpreter (set before triton is imported;
    # the selector still picks the torch references on CPU unless a test forces a kernel).
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines on the CPU that force a Triton kernel (BARYON_KERNEL_<FAMILY>=triton) run it in the
# interpreter; on a GPU host (no interpreter) such tests skip: the GPU runs the kernel in its own tests.
from baryon.kernels import triton_utils  # noqa: E402 (after TRITON_INTERPRET is set)

cpu_engine_with_triton = pytest.mark.skipif(
    triton_utils.triton is None or not triton_utils.INTERPRETED,
    reason="forcing Triton on a CPU engine needs the interpreter (TRITON_INTERPRET=1 before import)")
# Each run draws fresh random inputs from this seed; a failure names it so it can be replayed
# with BARYON_TEST_SEED=<seed>.
TEST_SEED = int(os.environ.get("BARYON_TEST_SEED", int.from_bytes(os.urandom(3), "little")))
# pytest-xdist's workers (and the tests' own rank processes) inherit it: one seed for the whole run.
os.environ["BARYON_TEST_SEED"] = str(TEST_SEED)


def pytest_xdist_auto_num_workers(config) -> int:
    """How many processes `-n auto` (pyproject's addopts) runs the tests in: one per core up to 4
    on a CPU host (most tests are single-threaded Python: the 2-core CI machine runs the suite in
    half the time), none on a GPU host, whose tests share one device and measure its free memory."""
    if torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cores) if cores > 1 else 0


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The seed again after a failed run (`-q` prints no header), so that it can be replayed."""
    if exitstatus not in (0, 5):
        terminalreporter.write_line(f"baryon test seed: {TEST_SEED} (replay with BARYON_TEST_SEED={TEST_SEED})")


def pytest_report_header(config) -> str:
    return f"baryon test seed: {TEST_SEED} (replay with BARYON_TEST_SEED={TEST_SEED})"


@pytest.fixture(scope="session", autouse=True)
def engine_core_in_process():
    """Tests look inside the engine (its runner, scheduler, caches), which only an engine core in
    the test's own process allows: on a GPU too, an LLM keeps its engine core here unless the test
    asks for a process of its own (engine_process=True, as tests/test_engine_process.py does)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("baryon.config.default_engine_process", lambda device: False)
        yield


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (derived from the session seed and the test's name)."""
    import zlib

    return (TEST_SEED + zlib.crc32(request.node.nodeid.encode())) % (2**31)

STORIES_PATH = Path(os.environ.get(
    "BARYON_STORIES_PATH", Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"))

# Small but complete architectures: every feature the engine supports can be switched on.
BASE_CONFIG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
    # A large init scale makes the logits decisive: greedy choices are separated by clear
    # margins, so a numerical bug cannot hide behind a near-tie.
    initializer_range=0.15,
)


def hf_classes(arch: str):
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
        "cohere": (tf.CohereConfig, tf.CohereForCausalLM),
        "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "gemma3_vlm": (tf.Gemma3Config, tf.Gemma3ForConditionalGeneration),
        "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "deepseek_v32": (tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
        "qwen3_5_vlm": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
    }[arch]


ARCH_OF_CLASS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3", "GemmaForCausalLM": "gemma",
                 "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite",
                 "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3", "CohereForCausalLM": "cohere",
                 "Gemma2ForCausalLM": "gemma2",
                 "Gemma3ForCausalLM": "gemma3",
                 "Gemma3ForConditionalGeneration": "gemma3_vlm",
                 "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Qwen3VLForConditionalGeneration": "qwen3_vl", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral",
                 "Glm4MoeForCausalLM": "glm4_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
                 "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV32ForCausalLM": "deepseek_v32",
                 "GptOssForCausalLM": "gpt_oss", "Qwen3NextForCausalLM": "qwen3_next",
                 "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
                 "Qwen3_5ForConditionalGeneration": "qwen3_5_vlm"}
# Tiny mixtures of experts: few experts of a small intermediate size.
MOE_BASE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    # DeepSeek: 4 heads of latent attention (rank 32, nope 16 + rope 8 query/key dims, values 16).
    "deepseek_v2": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4, first_k_dense_replace=1),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4, first_k_dense_replace=1, n_group=2, topk_group=1),
    # DeepSeek-V3.2: V3's attention plus an indexer (8 heads of 32) choosing 6 keys per token.
    # 32 index heads: a key scores exactly 0 only when every head's relu is 0 (2^-32), so the
    # top-k never meets a tie at 0, which the reference's torch.topk breaks in no defined order.
    "deepseek_v32": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         num_key_value_heads=4, first_k_dense_replace=1, n_group=2, topk_group=1,
                         index_n_heads=32, index_head_dim=32, index_topk=6),
    # GPT-OSS: 8 experts of 32 (top-2), sinks, sliding window 8 on even layers, YaRN as published.
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
    # Hybrid linear attention: Gated DeltaNet (2 key heads of 16, 4 value heads of 8, kernel 4) and
    # gated full attention (head size 16, RoPE on a quarter of it) per layer_types.
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, head_dim=16, **(LINEAR_ATTENTION := dict(
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=8, linear_conv_kernel_dim=4,
                           layer_types=["linear_attention", "full_attention", "linear_attention"],
                           num_hidden_layers=3))),
    "qwen3_5": dict(head_dim=16, **LINEAR_ATTENTION),
    "qwen3_5_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, head_dim=16, **LINEAR_ATTENTION),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
                     first_k_dense_replace=1),
}


# Configs whose defaults name token ids past the tiny vocabulary (Phi-3: 32000).
TOKEN_IDS = {"phi3": dict(bos_token_id=1, eos_token_id=2, pad_token_id=0),
             "smollm3": dict(bos_token_id=1, eos_token_id=2, pad_token_id=0),
             "olmo2": dict(bos_token_id=1, eos_token_id=2, pad_token_id=0),
             "olmo3": dict(bos_token_id=1, eos_token_id=2, pad_token_id=0),
             "cohere": dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)}


def spread_hybrid_norms(model) -> None:
    """Qwen3-Next / Qwen3.5: their norms of (1 + weight) start at zero, the Gated DeltaNet's gated
    norm and dt_bias at one: give them values (the vision tower's, if any, left as they are)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.normal_(1.0, 0.1)
            elif name.endswith(("norm.weight", "dt_bias")) and "visual" not in name:
                param.normal_(0.0, 0.1)


def make_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised transformers model of `arch` to `path` (float32 safetensors)."""
    config_cls, model_cls = hf_classes(arch)
    config = config_cls(**{**BASE_CONFIG, **MOE_BASE.get(arch, {}), **TOKEN_IDS.get(arch, {}), **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # DeepSeek-V3 / GLM correction biases start at zero: give them values
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
        if arch.startswith(("qwen3_next", "qwen3_5")):
            spread_hybrid_norms(model)
        if arch.startswith("gemma"):  # Gemma's norm weights start at zero (each norm x 1): give them values
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.1)
        if arch.startswith("olmo") or arch == "cohere":  # ... and OLMo's and Cohere's at one
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(1.0, 0.1)
        if arch == "gpt_oss":  # its expert and attention biases start at zero: give them values
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.1)
                elif name.endswith("experts.gate_up_proj"):  # past the SwiGLU limit (7) now and then
                    param.mul_(4.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


# Architectures whose reference runs in float64: transformers' chunked delta rule (linear attention)
# in float32 strays up to ~2e-4 in logprob from its own float64 result on these random models
# (the engine's token-by-token rule stays within ~7e-5), more than the tests' tolerance of 1e-4.
FLOAT64_REFERENCE = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                     "Qwen3_5ForConditionalGeneration")


def hf_greedy(path: Path, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Reference: greedy decoding with full recomputation every step in transformers (eager
    attention, float32; FLOAT64_REFERENCE's in float64). Returns the new tokens and each one's logprob."""
    import json

    _, model_cls = hf_classes_from_path(path)
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    if architecture in FLOAT64_REFERENCE:  # (torch's grouped matmul of the experts takes no float64)
        model = model_cls.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                          experts_implementation="eager").eval()
    else:
        model = model_cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(num_new):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = logits.log_softmax(-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids.append(token)
    return tokens, logprobs


def hf_classes_from_path(path: Path):
    import json

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return hf_classes(ARCH_OF_CLASS[arch])


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not STORIES_PATH.is_dir():
        pytest.skip(f"stories260K checkpoint not found at {STORIES_PATH} (it lives in ../shared/models)")
    return STORIES_PATH


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (GQA 4/2, untied), shared by tests that only read it."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1)


def random_prompts(count: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def random_dense_layer(gen: torch.Generator, in_features: int, out_features: int, dtype: torch.dtype,
                       device: str) -> torch.nn.Module:
    """A ReplicatedLinear with a bias and random weights (scale 0.05), in dtype on device, loaded
    (process_weights_after_loading run: the kernels a dense layer picks there are set)."""
    from baryon.layers.linear import ReplicatedLinear

    with torch.device(device), torch.no_grad():
        layer = ReplicatedLinear(in_features, out_features, bias=True)
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, device="cpu").to(param.dtype) * 0.05)
        layer.to(dtype)
        layer.method.process_weights_after_loading(layer)
    return layer


def _rank_entry(target, rank: int, world: int, init_method: str, args: tuple, results) -> None:
    import traceback

    try:
        results.put((rank, True, target(rank, world, init_method, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_in_ranks(target, world: int, *args, timeout_s: float = 120) -> dict:
    """Run `target(rank, world, init_method, *args)` in `world` spawned processes (a module-level
    function; init_method: where they meet, tcp://...). Returns {rank: what it returned} (sent
    by value: numpy arrays rather than tensors, which would travel by a descriptor the exiting
    child owns); fails the test with a rank's traceback or when a rank does not report in time."""
    import queue as queue_module

    import torch.multiprocessing as mp

    from baryon.config import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(target, rank, world, init_method, args, results))
             for rank in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout_s)
            assert ok, f"rank {rank} failed:\n{value}"
            got[rank] = value
    except queue_module.Empty:
        pytest.fail(f"the ranks did not report in {timeout_s} s (exit codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return got




@pytest.fixture(scope="module")
def exact_packed_kernels():
    """On CPU, GGUF matrices and int8 / W4A16 layers run on the packed block kernels, by default
    with integer dots that round the activations; a module comparing token for token with float
    weights takes the exact float32 kernel (`pytestmark = pytest.mark.usefixtures(...)`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BARYON_KERNEL_BLOCK_QUANT_LINEAR", "cpu_float32")
        yield


@pytest.fixture(scope="session")
def smol_path() -> str:
    """The built-in default model's GGUF file (SmolLM2-135M-Instruct; CI installs it)."""
    from baryon.default_model import INSTALL_COMMAND, default_model_path

    try:
        return default_model_path()
    except ValueError:
        pytest.skip(f"the default model is not installed ({INSTALL_COMMAND})")
