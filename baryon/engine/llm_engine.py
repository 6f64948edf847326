"""LLMEngine: the in-process frontend — prompt processing, the EngineCore, output processing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from baryon.config import EngineConfig
from baryon.engine.core import EngineCore
from baryon.engine.core_client import EngineProcess
from baryon.engine.core_processes import EngineCoreProcesses
from baryon.engine.output_processor import OutputProcessor
from baryon.multimodal.inputs import MultiModalInputs
from baryon.multimodal.processor import ImageProcessor
from baryon.outputs import RequestOutput
from baryon.sampling_params import SamplingParams
from baryon.structured_output.grammar import check_spec
from baryon.tokenizer import eos_token_ids, load_tokenizer, unpaired_surrogate

# A prompt: text, {"prompt": text}, or {"prompt_token_ids": [ids]}; a dict may add
# "multi_modal_data": {"image": image(s)} (image-and-text models).
PromptType = str | dict[str, Any]


def check_sampling_params(config: EngineConfig, has_tokenizer: bool, params: SamplingParams) -> None:
    """Refuse parameters that are valid in themselves but not for this engine."""
    limit = config.model.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise ValueError(f"SamplingParams.{name}={value} exceeds max_logprobs={limit} of this engine")
    vocab = config.model.vocab_size
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab})")
    if not has_tokenizer and params.stop_strings:
        raise ValueError("stop strings need a tokenizer; this engine has skip_tokenizer_init=True "
                         "(use stop_token_ids)")
    if params.structured_outputs is not None:
        if not has_tokenizer:
            raise ValueError("structured outputs need a tokenizer; this engine has skip_tokenizer_init=True")
        check_spec(params.structured_outputs)


class LLMEngine:
    def __init__(self, config: EngineConfig, engine_processes: Sequence[EngineProcess] = ()) -> None:
        """engine_processes: engine-core processes started for this engine (`EngineProcess`,
        configured here), as many as it runs (`baryon.config.planned_engine_processes`)."""
        self.config = config
        model = config.model
        # The engine core here, or in a process of its own (a GPU's default), or data_parallel_size
        # replicas in processes of their own; those load the model while this process loads the tokenizer.
        core = EngineCoreProcesses(config, engine_processes) if config.engine_process else None
        try:
            self.tokenizer = None
            if model.tokenizer_path is not None:
                self.tokenizer = load_tokenizer(model.tokenizer_path, model.trust_remote_code)
            self.eos_token_ids = eos_token_ids(model.model_path, model.hf_config, self.tokenizer)
            if core is None:
                core = EngineCore(config)
            else:
                core.wait_ready()
        except BaseException:
            if core is not None:
                core.shutdown()
            raise
        self.core = core
        self.output_processor = OutputProcessor(self.tokenizer)
        self.image_processor: ImageProcessor | None = None  # loaded at the first image prompt

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], MultiModalInputs | None]:
        """(prompt text or None, prompt token ids, its images or None), validated. A dict prompt
        may carry `multi_modal_data`: {"image": an image or a list of them}, one image
        placeholder token in the prompt for each."""
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
            text, ids, _ = self.process_prompt(rest)
            ids, multimodal = self.process_images(ids, prompt["multi_modal_data"])
            self.core.check_prompt(ids)
            return text, ids, multimodal
        return (*self._process_text_prompt(prompt), None)

    def process_images(self, prompt_token_ids: list[int], data: Any, allow_local_files: bool = True
                       ) -> tuple[list[int], MultiModalInputs]:
        """The prompt with its image placeholders expanded, and its images' inputs."""
        if not isinstance(data, dict) or set(data) != {"image"}:
            raise ValueError(f"multi_modal_data must be {{'image': an image or a list of images}}; got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        if self.image_processor is None:
            self.image_processor = ImageProcessor.for_model(self.config.model.model_path, self.config.model.hf_config)
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        return self.image_processor.prompt(prompt_token_ids, list(images), allow_local_files)

    def _process_text_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError(f"a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids' (and may have "
                                 f"'multi_modal_data'); got keys {sorted(prompt)}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integer token ids")
                self.core.check_prompt(list(ids))
                return None, list(ids)
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or a dict with 'prompt'/'prompt_token_ids'; got {type(prompt).__name__}")
        if prompt == "":
            raise ValueError("the prompt is empty; give some text or token ids")
        if (at := unpaired_surrogate(prompt)) is not None:
            raise ValueError(f"the prompt holds an unpaired UTF-16 surrogate (U+{ord(prompt[at]):04X}) at character "
                             f"{at}; give valid Unicode text")
        if self.tokenizer is None:
            raise ValueError("this engine was built with skip_tokenizer_init=True: give prompts as "
                             "{'prompt_token_ids': [...]} instead of text")
        ids = self.tokenizer.encode(prompt)
        self.core.check_prompt(ids)
        return prompt, ids

    def check_params(self, params: SamplingParams) -> None:
        check_sampling_params(self.config, self.tokenizer is not None, params)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, multimodal = self.process_prompt(prompt)
        self.check_params(params)
        core_ids = self.output_processor.add_request(request_id, text, ids, params)
        try:
            for i, core_id in enumerate(core_ids):
                self.core.add_request(core_id, ids, params.for_sample(i) if params.n > 1 else params,
                                      self.eos_token_ids, multimodal)
        except Exception:
            self.abort_request([request_id])  # all or nothing: no sample of a refused request stays
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.core.abort_requests(self.output_processor.abort_request(request_id))

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism)."""
        self.core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Advance every request by one scheduler step; returns the outputs of the requests that
        changed (final_only: of those that finished)."""
        outputs, stopped = self.output_processor.process(self.core.step(), final_only)
        self.core.abort_requests(stopped)
        return outputs
