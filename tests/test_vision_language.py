"""Qwen3-VL with images: the vision tower, the multimodal RoPE positions and the engine's image
prompts against transformers (float32, tiny random checkpoints with the image processor saved
beside them), batched with text prompts, over chunked prefills and the prefix cache; bad image
inputs refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from baryon import LLM, SamplingParams
from baryon.multimodal.inputs import mrope_positions
from baryon.multimodal.processor import ImageError, load_image

IMAGE_TOKEN, VISION_START, VISION_END = 150, 152, 153
NUM_NEW = 6
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.15,
            bos_token_id=1, eos_token_id=2,
            # (the t / h / w split of 16-wide heads' 8 frequencies; the published [24, 20, 20] is for 128)
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})


def _checkpoint(path, seed: int):
    config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_TOKEN,
                                        video_token_id=151, vision_start_token_id=VISION_START,
                                        vision_end_token_id=VISION_END)
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms and position grid, so that a mixed-up tensor cannot pass
        for name, param in model.named_parameters():
            if "norm" in name or "pos_embed" in name:
                param.copy_(torch.randn_like(param) * 0.5 + (1.0 if "norm" in name and "bias" not in name else 0.0))
    model.save_pretrained(path)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 32 * 32, "longest_edge": 160 * 160}).save_pretrained(path)
    return model


def _image(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(rng: np.random.Generator, num_images: int) -> list[int]:
    """Text tokens with num_images `<vision_start><image><vision_end>` placeholders among them."""
    ids = [int(t) for t in rng.integers(3, 140, int(rng.integers(2, 6)))]
    for _ in range(num_images):
        ids += [VISION_START, IMAGE_TOKEN, VISION_END] + [int(t) for t in rng.integers(3, 140, int(rng.integers(1, 5)))]
    return ids


def _hf_greedy(model, path, prompt_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[float]]:
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    extra, ids = {}, list(prompt_ids)
    if images:
        out = processor(images=images, return_tensors="pt")
        counts = (out["image_grid_thw"].prod(-1) // 4).tolist()
        expanded, it = [], iter(counts)
        for t in ids:
            expanded += [IMAGE_TOKEN] * next(it) if t == IMAGE_TOKEN else [t]
        ids = expanded
        extra = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    input_ids = torch.tensor([ids])
    extra["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN).int()
    with torch.no_grad():
        result = model.generate(input_ids, max_new_tokens=NUM_NEW, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, **extra)
    tokens = result.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(result.logits, tokens)]
    return tokens, logprobs


def test_mrope_positions_match_transformers(seed):
    rng = np.random.default_rng(seed)
    config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_TOKEN)
    hf = transformers.Qwen3VLModel(config)
    for _ in range(5):
        grids = [(1, 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5))) for _ in range(int(rng.integers(1, 4)))]
        ids, offsets = [], []
        for t, h, w in grids:
            ids += [int(x) for x in rng.integers(3, 140, int(rng.integers(1, 4)))]  # (HF joins adjacent images)
            offsets.append(len(ids))
            ids += [IMAGE_TOKEN] * (t * h * w // 4)
        ids += [int(x) for x in rng.integers(3, 140, int(rng.integers(1, 4)))]
        input_ids = torch.tensor([ids])
        expected, delta = hf.get_rope_index(input_ids, (input_ids == IMAGE_TOKEN).int(), torch.tensor(grids))
        got, got_delta = mrope_positions(len(ids), offsets, grids, 2)
        np.testing.assert_array_equal(got, expected[:, 0].numpy())
        assert got_delta == int(delta)


def test_qwen3_vl_image_prompts_follow_transformers(tmp_path, seed):
    """Image prompts (one image, two of other sizes) beside a text prompt: greedy tokens and
    logprobs as transformers' whole model gives them, over prefills chunked through the images."""
    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    hf = _checkpoint(path, seed)
    cases = [(_prompt(rng, 1), [_image(rng, 90, 150)]),
             (_prompt(rng, 2), [_image(rng, 64, 40), _image(rng, 33, 70)]),
             (_prompt(rng, 0), [])]
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=16, kv_cache_memory_gib=0.02, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": imgs}} if imgs else {})}
               for ids, imgs in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for (ids, images), output in zip(cases, outputs):
        tokens, logprobs = _hf_greedy(hf, path, ids, images)
        sample = output.outputs[0]
        assert sample.token_ids == tokens
        got = [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4
    assert not llm.engine.core.runner.images.outputs  # nothing kept after the prefills


def test_image_prompts_and_the_prefix_cache(tmp_path, seed):
    """The same image prompt again hits the prefix cache and gives the same tokens; another image
    of the same size (the same placeholder tokens) does not hit it, and a text request batched
    beside an image request gives what it gives alone."""
    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    _checkpoint(path, seed)
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=32, kv_cache_memory_gib=0.02, max_model_len=512, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    ids, image, other = _prompt(rng, 1), _image(rng, 64, 64), _image(rng, 64, 64)
    text = {"prompt_token_ids": _prompt(rng, 0)}
    alone = llm.generate([text], params, use_tqdm=False)[0].outputs[0].token_ids
    first, beside = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, text], params,
                                 use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}], params, use_tqdm=False)[0]
    swapped = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": other}}], params,
                           use_tqdm=False)[0]
    assert beside.outputs[0].token_ids == alone
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert swapped.num_cached_tokens == 0
    expected, _ = _hf_greedy(transformers.Qwen3VLForConditionalGeneration.from_pretrained(path).eval(), path, ids,
                             [other])
    assert swapped.outputs[0].token_ids == expected


def test_bad_image_inputs_are_refused_by_name(tmp_path, seed):
    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    _checkpoint(path, seed)
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4,
              kv_cache_memory_gib=0.02, max_model_len=512)
    params = SamplingParams(max_tokens=2)
    ids = _prompt(rng, 1)
    with pytest.raises(ValueError, match="1 image placeholder"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [_image(rng, 32, 32)] * 2}}], params)
    with pytest.raises(ValueError, match="multi_modal_data must be"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"video": _image(rng, 32, 32)}}], params)
    with pytest.raises(ImageError, match="not an image"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": b"not a picture"}}], params)
    with pytest.raises(ImageError, match="data:image"):
        load_image("data:text/plain;base64,aGVsbG8=")
    with pytest.raises(ImageError, match="file paths"):
        load_image(str(tmp_path / "x.png"), allow_local_files=False)
    assert not llm.engine.has_unfinished_requests()
    # the engine still serves after the refusals
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": _image(rng, 32, 48)}}], params)
    assert len(out[0].outputs[0].token_ids) == 2


def test_vision_tower_matches_transformers(tmp_path, seed):
    """The tower alone: embeddings and DeepStack features of two images of other grids (a position
    grid resampled at fractional taps) as transformers' vision model computes them."""
    from baryon.models.qwen3_vl_vision import Qwen3VLVisionModel

    rng = np.random.default_rng(seed)
    hf = _checkpoint(tmp_path / "qwen3-vl", seed)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "qwen3-vl")
    out = processor(images=[_image(rng, 90, 150), _image(rng, 70, 33)], return_tensors="pt")
    ours = Qwen3VLVisionModel(hf.config.vision_config)
    prefix = "model.visual."
    ours.load_state_dict({k[len(prefix):]: v for k, v in hf.state_dict().items() if k.startswith(prefix)})
    with torch.no_grad():
        expected = hf.model.visual(out["pixel_values"], grid_thw=out["image_grid_thw"], return_dict=True)
        embeddings, deepstack = ours(out["pixel_values"], [tuple(g) for g in out["image_grid_thw"].tolist()])
    torch.testing.assert_close(embeddings, expected.pooler_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(deepstack, torch.stack(expected.deepstack_features), atol=1e-5, rtol=1e-5)
