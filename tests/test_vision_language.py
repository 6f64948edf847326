"""Qwen3-VL with images: the vision tower, the multimodal RoPE positions and the engine's image
prompts against transformers (float32, tiny random checkpoints with the image processor saved
beside them), batched with text prompts, over chunked prefills and the prefix cache; bad image
inputs refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from baryon import LLM, SamplingParams
from conftest import MOE_BASE, make_checkpoint, spread_hybrid_norms
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


# A word-level tokenizer over the checkpoint's ids: words w0 .. w149, the image tokens at their
# config ids, chat markers after them; a template that renders image parts as Qwen3-VL's does.
CHAT_TEMPLATE = ("{%- for m in messages %}<|im_start|> {{ m.role }} {% if m.content is string %}{{ m.content }} "
                 "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|> <|image_pad|> "
                 "<|vision_end|> {% else %}{{ p.text }} {% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def _tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(150)}
    vocab.update({"<|image_pad|>": IMAGE_TOKEN, "<|video_pad|>": 151, "<|vision_start|>": VISION_START,
                  "<|vision_end|>": VISION_END, "<|im_start|>": 154, "<|im_end|>": 155, "user": 156,
                  "assistant": 157, "system": 158, "<unk>": 159})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Sequence([decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                                                              "<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


# Qwen3.5: its hybrid decoder (conftest's Gated DeltaNet layers, gated attention rotating a quarter
# of 32-wide heads: 4 frequencies) under the same vision tower without DeepStack.
QWEN3_5_TEXT = dict(TEXT, **{**MOE_BASE["qwen3_5"], "head_dim": 32},
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.25})
# Qwen2-VL / Qwen2.5-VL: Qwen2's decoder, multimodal RoPE in sections (t, h, w of 8 frequencies),
# 14 x 14 patches; Qwen2.5-VL's windows of 2 x 2 merged tokens (56 pixels), block 1 over whole images.
QWEN2_TEXT = dict({k: v for k, v in TEXT.items() if k != "head_dim"},
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
ARCHS = {"qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration, TEXT, VISION),
         "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration, QWEN3_5_TEXT,
                     {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}),
         "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration, QWEN2_TEXT,
                      dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2)),
         "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration, QWEN2_TEXT,
                        dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                             patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                             fullatt_block_indexes=[1]))}


def _our_tower(arch: str, vision_config):
    from baryon.models.qwen2_vl_vision import Qwen2VLVisionModel
    from baryon.models.qwen3_vl_vision import Qwen3VLVisionModel

    if arch.startswith("qwen2"):
        return Qwen2VLVisionModel(vision_config, windowed=arch == "qwen2_5_vl")
    return Qwen3VLVisionModel(vision_config, deepstack=arch == "qwen3_vl")


def _checkpoint(path, seed: int, arch: str = "qwen3_vl"):
    config_cls, model_cls, text, vision = ARCHS[arch]
    config = config_cls(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=151,
                        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch == "qwen3_5":
        spread_hybrid_norms(model)
    with torch.no_grad():  # random vision norms and position grid, so that a mixed-up tensor cannot pass
        for name, param in model.named_parameters():
            if "visual" in name and ("norm" in name or "ln_q" in name or "pos_embed" in name):
                param.copy_(torch.randn_like(param) * 0.5 + (0.0 if "bias" in name or "pos_embed" in name else 1.0))
            elif arch != "qwen3_5" and "norm" in name:
                param.copy_(torch.randn_like(param) * 0.5 + 1.0)
    model.save_pretrained(path)
    # (written by hand: AutoImageProcessor then takes whichever backend is installed, PIL or torchvision)
    (path / "preprocessor_config.json").write_text(json.dumps(dict(
        image_processor_type="Qwen2VLImageProcessor", patch_size=vision["patch_size"], merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
        size={"shortest_edge": 32 * 32, "longest_edge": 160 * 160})))
    _tokenizer(path)
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
    """transformers' greedy generation (its KV cache and M-RoPE deltas; a reply may hold the image
    token id, which a recomputed prompt would take for a placeholder); the hybrid Qwen3.5 in
    float64 (transformers' float32 chunked rule strays ~2e-4)."""
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    dtype = torch.float64 if isinstance(model, transformers.Qwen3_5ForConditionalGeneration) else torch.float32
    model = model.to(dtype)
    model.generation_config.eos_token_id = None  # (ignore EOS, as the engine's requests do)
    model.generation_config.pad_token_id = 0
    extra, ids = {}, list(prompt_ids)
    if images:
        out = processor(images=images, return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for token in ids for t in ([IMAGE_TOKEN] * next(counts) if token == IMAGE_TOKEN else [token])]
        extra = dict(pixel_values=out["pixel_values"].to(dtype), image_grid_thw=out["image_grid_thw"])
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        result = model.generate(input_ids, mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(), max_new_tokens=NUM_NEW,
                                do_sample=False, output_logits=True, return_dict_in_generate=True, **extra)
    model.to(torch.float32)
    tokens = result.sequences[0, len(ids):].tolist()
    return tokens, [float(step[0].double().log_softmax(-1)[t]) for step, t in zip(result.logits, tokens)]


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


@pytest.mark.parametrize("arch,device", [*[(arch, "cpu") for arch in ARCHS], *[
    pytest.param(arch, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
    for arch in ARCHS]])
def test_image_prompts_follow_transformers(tmp_path, seed, arch, device):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (hybrid): image prompts (one image, two of other
    sizes) beside a text prompt: greedy tokens and logprobs as transformers' whole model gives them, over prefills
    chunked through the images (on a GPU the decodes replay CUDA graphs)."""
    rng = np.random.default_rng(seed)
    path = tmp_path / arch
    hf = _checkpoint(path, seed, arch)
    cases = [(_prompt(rng, 1), [_image(rng, 90, 150)]),
             (_prompt(rng, 2), [_image(rng, 64, 40), _image(rng, 33, 70)]),
             (_prompt(rng, 0), [])]
    llm = LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", block_size=4 if device == "cpu"
              else 16, max_num_batched_tokens=16, kv_cache_memory_gib=0.02, max_model_len=512)
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
    text_only = LLM(str(make_checkpoint(tmp_path / "qwen3", "qwen3", seed)), skip_tokenizer_init=True, device="cpu",
                    kv_cache_memory_gib=0.01)
    with pytest.raises(ValueError, match="does not read images"):
        text_only.generate([{"prompt_token_ids": [5, 6], "multi_modal_data": {"image": _image(rng, 32, 32)}}], params)
    # the engine still serves after the refusals
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": _image(rng, 32, 48)}}], params)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("arch", list(ARCHS))
def test_vision_tower_matches_transformers(tmp_path, seed, arch):
    """The tower alone: embeddings and DeepStack features of two images of other grids (Qwen3's
    position grid resampled at fractional taps; Qwen2.5-VL's windows cut short at the edges) as
    transformers' vision model computes them."""
    rng = np.random.default_rng(seed)
    hf = _checkpoint(tmp_path / arch, seed, arch)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / arch)
    out = processor(images=[_image(rng, 90, 150), _image(rng, 70, 33)], return_tensors="pt")
    ours = _our_tower(arch, hf.config.vision_config)
    prefix = "model.visual."
    weights = {k[len(prefix):]: v for k, v in hf.state_dict().items() if k.startswith(prefix)}
    for name in [k for k in weights if ".mlp.gate_proj." in k]:  # (fused as the engine's loader fuses them)
        up = weights.pop(name.replace("gate_proj", "up_proj"))
        weights[name.replace("gate_proj", "gate_up_proj")] = torch.cat((weights.pop(name), up))
    ours.load_state_dict(weights)
    with torch.no_grad():
        expected = hf.model.visual(out["pixel_values"], grid_thw=out["image_grid_thw"], return_dict=True)
        embeddings, deepstack = ours(out["pixel_values"], [tuple(g) for g in out["image_grid_thw"].tolist()])
    torch.testing.assert_close(embeddings, expected.pooler_output, atol=1e-5, rtol=1e-5)
    features = getattr(expected, "deepstack_features", None) or []
    assert len(deepstack) == len(features)
    if features:
        torch.testing.assert_close(deepstack, torch.stack(features), atol=1e-5, rtol=1e-5)


def _data_url(image: Image.Image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _words(rng: np.random.Generator, count: int) -> str:
    return " ".join(f"w{int(i)}" for i in rng.integers(3, 140, count))


def test_chat_with_images_follows_transformers(tmp_path, seed):
    """LLM.chat with image parts (a data: URL and a PIL image): the template renders their
    placeholders, and the reply is transformers' greedy continuation of the rendered prompt."""
    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    hf = _checkpoint(path, seed)
    first, second = _image(rng, 90, 150), _image(rng, 40, 64)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": _words(rng, 3)}, {"type": "image_url", "image_url": {"url": _data_url(first)}},
        {"type": "text", "text": _words(rng, 2)}, {"type": "image", "image": second}]}]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, kv_cache_memory_gib=0.02, max_model_len=512)
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False)[0]
    rendered = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": messages[0]["content"][0]["text"]}, {"type": "image"},
                                      {"type": "text", "text": messages[0]["content"][2]["text"]}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(rendered).count(IMAGE_TOKEN) == 2
    expected, _ = _hf_greedy(hf, path, list(rendered), [first, second])
    assert output.outputs[0].token_ids == expected


def test_server_chat_with_images(tmp_path, seed):
    """`baryon serve`: a chat completion with an image_url (data: URL) replies as LLM.chat does;
    an unreadable image, a file path and a payload that is not base64 are 400s naming the problem,
    and the server goes on serving."""
    import httpx
    import openai
    from test_server import ServerProcess

    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    _checkpoint(path, seed)
    image = _image(rng, 64, 96)
    content = [{"type": "text", "text": _words(rng, 3)}, {"type": "image_url", "image_url": {"url": _data_url(image)}}]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, kv_cache_memory_gib=0.02, max_model_len=512)
    expected = llm.chat([{"role": "user", "content": content}],
                        SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False)[0]
    server = ServerProcess(path, "--dtype", "float32", "--max-model-len", "512", "--block-size", "4",
                           "--kv-cache-memory-gib", "0.02")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": content}],
                                               temperature=0, max_tokens=NUM_NEW, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == expected.outputs[0].text
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
        bad = [("data:image/png;base64,bm90IGFuIGltYWdl", "not an image"), (str(tmp_path / "x.png"), "file paths"),
               ("data:image/png;base64,@@", "does not decode")]
        for url, reason in bad:
            response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": str(path), "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
            assert response.status_code == 400 and reason in response.json()["error"]["message"], response.text
        again = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": content}],
                                               temperature=0, max_tokens=NUM_NEW, extra_body={"ignore_eos": True})
        assert again.choices[0].message.content == expected.outputs[0].text
        counted = httpx.post(f"{server.url}/tokenize", timeout=60,
                             json={"model": str(path), "messages": [{"role": "user", "content": content}]}).json()
        assert counted["count"] == len(expected.prompt_token_ids)  # the image's tokens, not its placeholder
    finally:
        server.stop()


def test_a_slow_image_url_holds_only_its_own_request(tmp_path, seed):
    """Images are fetched off the preparing thread: while one request's http image takes seconds
    to arrive, text requests and one with a data: URL image are answered; the slow one then replies
    as LLM.chat does on the same image, and a URL that fails is a 400 naming it."""
    import http.server
    import io
    import threading
    import time

    import httpx
    from test_server import ServerProcess

    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    _checkpoint(path, seed)
    image, other = _image(rng, 64, 96), _image(rng, 48, 64)
    png = io.BytesIO()
    image.save(png, format="PNG")
    release = threading.Event()

    class SlowImages(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/slow.png":
                self.send_error(404)
                return
            release.wait(30)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png.getvalue())

        def log_message(self, *args):
            pass

    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowImages)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{images.server_address[1]}"
    text = _words(rng, 3)

    def message(url):
        return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]

    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, kv_cache_memory_gib=0.02, max_model_len=512)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    expected = llm.chat(message(_data_url(image)), greedy, use_tqdm=False)[0].outputs[0].text
    server = ServerProcess(path, "--dtype", "float32", "--max-model-len", "512", "--block-size", "4",
                           "--kv-cache-memory-gib", "0.02")
    body = {"model": str(path), "temperature": 0, "max_tokens": NUM_NEW, "ignore_eos": True}
    try:
        server.wait_ready()
        with httpx.Client(timeout=120) as client:
            slow_reply = {}
            slow = threading.Thread(target=lambda: slow_reply.update(client.post(
                f"{server.url}/v1/chat/completions", json={**body, "messages": message(f"{base}/slow.png")}).json()))
            slow.start()
            time.sleep(0.5)  # the slow request is waiting for its image
            for messages in ([{"role": "user", "content": text}], message(_data_url(other))):
                reply = client.post(f"{server.url}/v1/chat/completions", json={**body, "messages": messages})
                assert reply.status_code == 200, reply.text
            assert slow.is_alive() and not slow_reply  # answered while the image had not arrived
            release.set()
            slow.join(120)
            assert slow_reply["choices"][0]["message"]["content"] == expected
            missing = client.post(f"{server.url}/v1/chat/completions", json={**body, "messages": message(f"{base}/none.png")})
            assert missing.status_code == 400 and "cannot fetch the image" in missing.json()["error"]["message"]
    finally:
        release.set()
        server.stop()
        images.shutdown()


def test_tensor_parallel_image_prompts(tmp_path, seed):
    """TP=2 (gloo): Qwen3-VL's image prompts (chunked across steps, batched with text prompts and
    decoding) give TP=1's tokens and logprobs: rank 0 runs the tower and shares each step's vision
    inputs. DP=2: the replicas' replies are TP=1's too."""
    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    _checkpoint(path, seed)
    prompts = [{"prompt_token_ids": _prompt(rng, 0)} for _ in range(2)]
    prompts += [{"prompt_token_ids": _prompt(rng, n), "multi_modal_data": {
        "image": [_image(rng, int(rng.integers(32, 128)), int(rng.integers(32, 128))) for _ in range(n)]}}
        for n in (1, 2)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    engine = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.02,
                  max_model_len=512, block_size=4, max_num_batched_tokens=48)

    def replies(outputs):  # each reply's tokens, and its tokens' logprobs
        return ([o.outputs[0].token_ids for o in outputs],
                [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outputs])

    single = LLM(str(path), **engine)
    expected, expected_logprobs = replies(single.generate(prompts, params, use_tqdm=False))
    with LLM(str(path), tensor_parallel_size=2, **engine) as llm:
        for order in (slice(None), slice(None, None, -1)):
            tokens, logprobs = replies(llm.generate(prompts[order], params, use_tqdm=False))
            assert tokens == expected[order]
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs[order]),
                                       atol=1e-4, rtol=0)  # (DeepStack counted once, not once a rank)
    with LLM(str(path), data_parallel_size=2, **engine) as llm:  # two replicas, each with its own tower
        assert replies(llm.generate(prompts, params, use_tqdm=False))[0] == expected


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_of_image_prompts(tmp_path, seed, method):
    """Drafts verified against image prompts (multimodal RoPE positions on the verified tokens)
    give the target's greedy tokens, with drafts proposed and verified. The draft model (the
    checkpoint itself) reads no images, so it guesses about them from the placeholders."""
    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    _checkpoint(path, seed)
    prompts = [{"prompt_token_ids": _prompt(rng, n), "multi_modal_data": {
        "image": [_image(rng, int(rng.integers(32, 96)), int(rng.integers(32, 96))) for _ in range(n)]}}
        for n in (1, 2, 1)] + [{"prompt_token_ids": _prompt(rng, 0)}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.02,
                  max_model_len=512, block_size=4)
    expected = [o.outputs[0].token_ids for o in LLM(str(path), **engine).generate(prompts, params, use_tqdm=False)]
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
            "draft_model": {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}}[method]
    llm = LLM(str(path), speculative_config=spec, **engine)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    stats = llm.engine.core.spec_stats
    assert stats.num_draft_tokens > 0, stats
    if method == "draft_model":  # itself as the draft: the text prompt's drafts are all accepted,
        # its 23 tokens after the first in five verifications of 3 drafts and one of 2 (the room left)
        assert stats.num_accepted_tokens >= 17, stats


def test_tower_calls_hold_at_most_the_budget(tmp_path, seed, monkeypatch):
    """The vision tower's calls hold at most a step's token budget of images (or the largest
    image, the processor's longest_edge): many images in one step go through it in several calls,
    and the replies are those of one call; the memory profile's blank call of that size runs."""
    from baryon.runner.image_inputs import ImageEncoder

    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    _checkpoint(path, seed)
    prompts = [{"prompt_token_ids": _prompt(rng, n), "multi_modal_data": {
        "image": [_image(rng, int(rng.integers(64, 160)), int(rng.integers(64, 160))) for _ in range(n)]}}
        for n in (3, 2)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    calls = []
    original = ImageEncoder._tower
    monkeypatch.setattr(ImageEncoder, "_tower", lambda self, images: (calls.append(sum(i.num_tokens for i in images)),
                                                                      original(self, images))[1])
    engine = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_memory_gib=0.02, max_model_len=512,
                  block_size=4)
    roomy = LLM(str(path), max_num_batched_tokens=512, **engine)
    assert roomy.engine.core.runner.images.largest_image == 25  # 160 x 160 pixels in 32 x 32 merged patches
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert len(calls) == 1
    calls.clear()
    tight = LLM(str(path), max_num_batched_tokens=32, **engine)
    assert tight.engine.core.runner.images.budget == 32
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == expected
    assert len(calls) > 1 and max(calls) <= 32
    model, grids = tight.engine.core.runner.model, []
    encode = model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda patches, g: (grids.extend(g), encode(patches, g))[1])
    tight.engine.core.runner.images.profile()  # blank images worth the budget, each at most the largest
    tokens = [t * h * w // 4 for t, h, w in grids]
    assert sum(tokens) == 32 and max(tokens) <= 25


def test_image_prompts_under_preemption(tmp_path, seed, monkeypatch):
    """Image requests in a cache too small for them all: running ones are preempted and recomputed
    (their images encoded again), and every reply is what the request gives alone."""
    from baryon.engine.scheduler import Scheduler

    rng = np.random.default_rng(seed)
    path = tmp_path / "qwen3-vl"
    _checkpoint(path, seed)
    prompts = [{"prompt_token_ids": _prompt(rng, 1), "multi_modal_data": {"image": _image(rng, 128, 160)}}
               for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4,
                kv_cache_memory_gib=0.02, max_model_len=512)
    alone = [roomy.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, r: (preempted.append(r.request_id), original(self, r)))
    tiny = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=4, num_kv_blocks=48,
               max_model_len=192, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in tiny.generate(prompts, params, use_tqdm=False)] == alone
    assert preempted, "the tiny cache was expected to force preemptions"
    assert not tiny.engine.core.runner.images.outputs
