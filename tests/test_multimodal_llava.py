"""Image inputs on a tiny random LLaVA (CLIP vision tower, projector, Llama): pagedllm's greedy tokens equal
transformers' LlavaForConditionalGeneration.generate on the same weights, images and prompts, token for token."""
from __future__ import annotations

import base64
import http.server
import io
import threading

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

IMAGE_SIZE, PATCH = 35, 7  # 25 placeholder tokens per image (the CLS feature dropped)
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2
PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
TWO_IMAGES = "USER: <image>\nand <image>\nWhich one is brighter? ASSISTANT:"
TEXT_ONLY = "USER: Describe a sunset over the sea. ASSISTANT:"
MAX_TOKENS = 10


def _image(seed: int, size: tuple[int, int] = (48, 40)):
    from PIL import Image

    rng = np.random.RandomState(seed)  # a colour of its own, a gradient and some noise: images that differ
    base = rng.randint(0, 256, 3)
    ramp = np.linspace(0, 1, size[0])[None, :, None] * rng.randint(-128, 128, 3)
    pixels = base + ramp + rng.normal(0, 20, (size[1], size[0], 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"))


def _png_data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, default_model_dir):
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), default_model_dir)


def build_tiny_llava(path, tokenizer_dir) -> str:
    """A 2-layer Llama (hidden 64) behind a 2-layer CLIP tower (35 px, 7 px patches), the tokenizer of
    `tokenizer_dir` (the bundled SmolLM2's) with an <image> token added, and a LlavaProcessor over a
    CLIPImageProcessor, saved to `path`."""
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_tokens(["<image>"], special_tokens=True)
    image_token_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    model.save_pretrained(path)
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf(llava_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(llava_dir)


def hf_greedy(hf, text: str, images: list, max_tokens: int = MAX_TOKENS, add_special_tokens: bool = True):
    """transformers' greedy tokens for one prompt (the reference)."""
    from transformers import GenerationConfig

    model, processor = hf
    if images:
        inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
    else:
        inputs = processor.tokenizer([text], return_tensors="pt", add_special_tokens=add_special_tokens)
    inputs = inputs.to(model.device)
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():  # no end of sequence: as ignore_eos
        out = model.generate(**inputs, generation_config=config)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _llm(llava_dir, **kwargs) -> LLM:
    args = dict(num_gpu_blocks_override=96, block_size=8, max_model_len=512, swap_space=0.01)
    return LLM(llava_dir, **{**args, **kwargs})


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llm(llava_dir):
    return _llm(llava_dir)


def test_one_image_matches_transformers(llm, hf):
    img = _image(1)
    outs = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)
    ids = outs[0].prompt_token_ids
    assert ids.count(hf[1].tokenizer.convert_tokens_to_ids("<image>")) == TOKENS_PER_IMAGE  # expanded
    assert _tokens(outs) == [hf_greedy(hf, PROMPT, [img])]
    # The image matters: another one gives other tokens (so the equality above is not the text's alone).
    other = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [_image(2)]}}, GREEDY, use_tqdm=False)
    assert _tokens(other) != _tokens(outs)


def test_mixed_batch_matches_transformers(llm, hf):
    """Two prompts with different images, a prompt with two images and text-only prompts, in one batch."""
    a, b, c = _image(3), _image(4, (30, 60)), _image(5, (64, 64))
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": a}},
        TEXT_ONLY,
        {"prompt": PROMPT, "multi_modal_data": {"image": b}},
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": [b, c]}},
        {"prompt": "USER: Hello there! ASSISTANT:"},
    ]
    expected = [hf_greedy(hf, PROMPT, [a]), hf_greedy(hf, TEXT_ONLY, []), hf_greedy(hf, PROMPT, [b]),
                hf_greedy(hf, TWO_IMAGES, [b, c]), hf_greedy(hf, "USER: Hello there! ASSISTANT:", [])]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


def test_chunked_prefill_splits_images(llava_dir, hf):
    """8-token steps split every image's 25 placeholders over several steps (and several sequences share steps):
    still transformers' tokens, and each image runs through the encoder once."""
    llm = _llm(llava_dir, max_num_batched_tokens=8, max_num_seqs=4)
    a, b, c = _image(6), _image(7), _image(8)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": a}},
               {"prompt": TWO_IMAGES, "multi_modal_data": {"image": [b, c]}},
               TEXT_ONLY]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == [hf_greedy(hf, PROMPT, [a]), hf_greedy(hf, TWO_IMAGES, [b, c]),
                             hf_greedy(hf, TEXT_ONLY, [])]
    cache = llm.llm_engine.executor.driver_worker.model_runner.encoder_cache
    assert cache.num_encoded == 3
    assert len(cache) == 0  # every image's placeholders ran: nothing kept


def test_recompute_preemption_with_images(llava_dir, hf):
    """A pool too small for all requests at once: preempted image requests recompute their prompts (re-encoding
    the images) and still give transformers' tokens."""
    llm = _llm(llava_dir, num_gpu_blocks_override=14, preemption_mode="recompute", max_num_batched_tokens=64)
    images = [_image(20 + i) for i in range(4)]
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": img}} for img in images], long,
                        use_tqdm=False)
    assert llm.llm_engine.stats()["num_recompute_preemptions"] > 0
    assert _tokens(outs) == [hf_greedy(hf, PROMPT, [img], max_tokens=24) for img in images]


def test_prefix_cache_keys_on_image_content(llava_dir, hf):
    """Same text, different image: no shared blocks (each output is transformers' for its image); same text and
    same image: the cached blocks are reused."""
    llm = _llm(llava_dir, enable_prefix_caching=True)
    a, b = _image(30), _image(31)

    def run(img):
        before = llm.llm_engine.stats()["prefix_cache_hits"]
        out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)
        return _tokens(out)[0], llm.llm_engine.stats()["prefix_cache_hits"] - before

    tokens_a, hits_a = run(a)
    tokens_b, hits_b = run(b)
    tokens_a2, hits_a2 = run(a)
    assert tokens_a == hf_greedy(hf, PROMPT, [a]) and tokens_b == hf_greedy(hf, PROMPT, [b])
    assert tokens_a != tokens_b
    n_prompt = len(llm.llm_engine.mm_processor.process({"prompt": PROMPT, "multi_modal_data": {"image": a}})
                   ["prompt_token_ids"])
    first_image_block = 8  # the image's placeholders start inside the first block (block_size 8)
    assert hits_a == 0
    assert hits_b < first_image_block  # only blocks before the image could match; here none is whole
    assert hits_a2 == (n_prompt - 1) // 8 * 8  # every full block before the last token
    assert tokens_a2 == tokens_a


def test_chat_with_image_parts_matches_generate(llm, hf):
    """LLM.chat: image_pil and data-URL image_url parts through the chat template (placeholders in front of the
    text, as vLLM writes them for string templates)."""
    img = _image(40)
    tok = hf[1].tokenizer
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                              {"type": "image_pil", "image_pil": img}]}]
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is this?"}], tokenize=False,
                                   add_generation_prompt=True)
    expected = hf_greedy(hf, text, [img], add_special_tokens=False)
    assert _tokens(llm.chat(messages, GREEDY, use_tqdm=False)) == [expected]
    url_messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                  {"type": "image_url", "image_url": {"url": _png_data_url(img)}}]}]
    assert _tokens(llm.chat(url_messages, GREEDY, use_tqdm=False)) == [expected]


# llava-hf's template style: it iterates over each message's content parts (vLLM's "openai" content format).
PARTS_TEMPLATE = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}"
                  "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}"
                  "{% endfor %}{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
                  "{{ part['text'] + ' ' }}{% endfor %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def test_chat_template_over_content_parts(llm, hf):
    """A template that iterates over content parts sees the image parts (and a plain-text message as a part)."""
    img = _image(41)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                             {"type": "text", "text": "What is this?"}]}]
    expected = hf_greedy(hf, "SYSTEM: Be brief. USER: <image>\nWhat is this? ASSISTANT:", [img],
                         add_special_tokens=False)
    assert _tokens(llm.chat(messages, GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)) == [expected]


def test_bad_multimodal_inputs_are_clear_errors(llava_dir, llm):
    img = _image(50)
    with pytest.raises(ValueError, match="PIL.Image"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": np.zeros((4, 4, 3))}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="modality.*not supported"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"audio": img}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="1 '<image>' placeholder"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [img, img]}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="content part type 'input_audio'"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], GREEDY, use_tqdm=False)
    limited = _llm(llava_dir, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match=r"2 images.*at most 1 \(limit_mm_per_prompt"):
        limited.generate({"prompt": TWO_IMAGES, "multi_modal_data": {"image": [img, img]}}, GREEDY, use_tqdm=False)
    # The engine still serves after refusing.
    assert len(_tokens(llm.generate(TEXT_ONLY, GREEDY, use_tqdm=False))[0]) == MAX_TOKENS


def test_text_only_model_refuses_images():
    llm = LLM(num_gpu_blocks_override=16, max_model_len=128)
    with pytest.raises(ValueError, match="accepts only text"):
        llm.generate({"prompt": "Hi <image>", "multi_modal_data": {"image": _image(60)}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="accepts only text"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": _image(60)}]}], GREEDY,
                 use_tqdm=False)


@pytest.mark.parametrize("front", ["process", "thread"])
def test_async_fronts_take_raw_images(llava_dir, hf, front):
    """AsyncMPClient (engine-core process) and AsyncLLMEngine (a thread): a prompt with PIL images is processed on
    the caller's side, its pixel values cross to the engine, and the tokens equal transformers'."""
    import asyncio

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.core_client import AsyncMPClient

    args = EngineArgs(model=llava_dir, num_gpu_blocks_override=96, block_size=8, max_model_len=512, swap_space=0.01)
    a, b = _image(80), _image(81)

    async def main():
        engine = AsyncMPClient(args, startup_timeout_s=120) if front == "process" else \
            AsyncLLMEngine.from_engine_args(args)
        engine.start()
        try:
            async def run(rid, prompt):
                final = None
                async for out in engine.generate(prompt, GREEDY, rid):
                    final = out
                return list(final.outputs[0].token_ids)
            with pytest.raises(ValueError, match="PIL.Image"):
                await engine.add_request("bad", {"prompt": PROMPT, "multi_modal_data": {"image": "x.png"}}, GREEDY)
            return await asyncio.gather(run("a", {"prompt": PROMPT, "multi_modal_data": {"image": a}}),
                                        run("b", {"prompt": TWO_IMAGES, "multi_modal_data": {"image": [a, b]}}),
                                        run("t", TEXT_ONLY))
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == [hf_greedy(hf, PROMPT, [a]), hf_greedy(hf, TWO_IMAGES, [a, b]),
                                   hf_greedy(hf, TEXT_ONLY, [])]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_images_with_graphs_match_transformers(llava_dir):
    """On CUDA (float32, graphs captured): image steps run eagerly, text and decode steps replay the graphs, and
    the tokens equal transformers' on the same device, with an image's placeholders split over 16-token steps."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).to("cuda").eval()
    ref = (model, AutoProcessor.from_pretrained(llava_dir))
    llm = _llm(llava_dir, device="cuda", dtype="float32", max_num_batched_tokens=16, max_num_seqs=8)
    assert llm.llm_engine.executor.driver_worker.model_runner.graph_runner is not None
    a, b = _image(90), _image(91)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": a}}, TEXT_ONLY,
               {"prompt": TWO_IMAGES, "multi_modal_data": {"image": [a, b]}}]
    expected = [hf_greedy(ref, PROMPT, [a]), hf_greedy(ref, TEXT_ONLY, []), hf_greedy(ref, TWO_IMAGES, [a, b])]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


# -- the server ----------------------------------------------------------------------------------------------------
class _ImageHandler(http.server.BaseHTTPRequestHandler):
    """Serves /image.png (a PNG) and /not-an-image (text) from a local thread."""

    png: bytes = b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/image.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self.png if self.path == "/image.png" else b"this is not an image"
        self.send_response(200 if self.path in ("/image.png", "/not-an-image") else 404)
        self.send_header("Content-Type", "image/png" if self.path == "/image.png" else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    buf = io.BytesIO()
    _image(70).save(buf, format="PNG")
    handler = type("Handler", (_ImageHandler,), {"png": buf.getvalue()})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def server(llava_dir):
    from conftest_server import RemoteServer

    srv = RemoteServer(["--model", llava_dir, "--served-model-name", "tiny-llava", "--num-gpu-blocks-override",
                        "96", "--block-size", "8", "--max-model-len", "512", "--swap-space", "0.01",
                        "--allowed-media-domains", "127.0.0.1"])
    yield srv
    srv.stop()


def _chat(server, content, **extra):
    import httpx

    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}
    return httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)


def test_server_chat_with_images(server, image_server, llm):
    """A data: URL and an http URL served locally: the server's tokens equal the offline LLM.chat's."""
    img = _image(70)
    parts = [{"type": "image_url", "image_url": {"url": _png_data_url(img)}}, {"type": "text", "text": "What is it?"}]
    r = _chat(server, parts)
    assert r.status_code == 200, r.text
    offline = _tokens(llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                              {"type": "text", "text": "What is it?"}]}],
                               GREEDY, use_tqdm=False))[0]
    assert r.json()["choices"][0]["token_ids"] == offline
    assert r.json()["usage"]["prompt_tokens"] > TOKENS_PER_IMAGE
    http_parts = [{"type": "image_url", "image_url": {"url": f"{image_server}/image.png"}},
                  {"type": "text", "text": "What is it?"}]
    r = _chat(server, http_parts)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == offline  # the same PNG by URL


def test_server_bad_images_are_400(server, image_server):
    cases = {
        f"{image_server}/not-an-image": "not an image",
        f"{image_server}/missing.png": "HTTP 404",
        "http://127.0.0.1:9/unreachable.png": "could not be fetched",
        "data:image/png;base64,@@@": "not valid base64",
        "file:///etc/passwd": "local files (file://) are refused",  # no --allowed-local-media-path
        "ftp://127.0.0.1/image.png": "scheme 'ftp' is not allowed",
        # --allowed-media-domains 127.0.0.1: another name for the same host is not on the list, and a redirect
        # (which could lead anywhere) is refused.
        image_server.replace("127.0.0.1", "localhost") + "/image.png": "not in the server's --allowed-media-domains",
        f"{image_server}/redirect": "HTTP 302",
    }
    for url, message in cases.items():
        r = _chat(server, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}])
        assert r.status_code == 400, (url, r.text)
        assert message in r.json()["error"]["message"], (url, r.text)
    r = _chat(server, [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
    assert r.status_code == 400 and "input_audio" in r.json()["error"]["message"]
    # Still serving, images and text alike.
    assert _chat(server, "Hello!").status_code == 200
    ok = _chat(server, [{"type": "image_url", "image_url": {"url": f"{image_server}/image.png"}}])
    assert ok.status_code == 200, ok.text


def test_without_an_allow_list_redirects_are_followed(image_server):
    from pagedllm.multimodal.media import MediaLimits, load_image_url

    assert load_image_url(f"{image_server}/redirect").size == _image(70).size
    with pytest.raises(ValueError, match="HTTP 302"):
        load_image_url(f"{image_server}/redirect", MediaLimits(allowed_domains=("127.0.0.1",)))
