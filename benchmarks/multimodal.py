"""Image prompts: pagedllm against transformers' LlavaForConditionalGeneration on the same requests, same run.

    python benchmarks/multimodal.py --num-prompts 32 --output-len 64

Builds a LLaVA-shaped model with random weights (no hub): a CLIP ViT-B/32-sized vision tower (224 px, 32 px patches:
49 image tokens per image, 12 layers, hidden 768) and the bundled SmolLM2-135M's shape as the language model, with
the bundled tokenizer plus an <image> token. Every request carries one distinct image and its own question and
decodes --output-len tokens (greedy, no end of sequence). transformers runs them as one left-padded static batch
(or --hf-batch-size at a time); pagedllm through `LLM.generate`. Prints both wall times, output tok/s, the ratio and
how many requests got the same tokens from both.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def build_llava(path: Path, tokenizer_dir: str) -> None:
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<image>"], special_tokens=True)
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=32, projection_dim=512)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.save_pretrained(path)
    LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 224},
                                                      crop_size={"height": 224, "width": 224}),
                   tokenizer=tok, patch_size=32, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1).save_pretrained(path)


def make_requests(n: int, seed: int = 0) -> list[tuple[str, object]]:
    from PIL import Image

    rng = np.random.RandomState(seed)
    subjects = ["a harbour", "a forest", "a kitchen", "a street", "a desert", "a library", "a garden", "a station"]
    out = []
    for i in range(n):
        pixels = rng.randint(0, 256, 3) + rng.normal(0, 40, (240, 320, 3))
        image = Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"))
        out.append((f"USER: <image>\nIs this {subjects[i % len(subjects)]}? Say why. ASSISTANT:", image))
    return out


def run_hf(model_dir: str, requests, output_len: int, batch_size: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoProcessor, GenerationConfig, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                              eos_token_id=None, pad_token_id=processor.tokenizer.pad_token_id or 0)
    tokens: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            inputs = processor(text=[t for t, _ in batch], images=[im for _, im in batch], return_tensors="pt",
                               padding=True)
            out = model.generate(**inputs, generation_config=config)
            tokens += out[:, inputs["input_ids"].shape[1]:].tolist()
    return time.perf_counter() - start, tokens


def run_pagedllm(model_dir: str, requests, output_len: int) -> tuple[float, float, list[list[int]]]:
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model_dir, max_model_len=1024)
    init_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return init_s, time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: all requests in one batch")
    args = p.parse_args()
    from pagedllm.model.loader import prepare_model_dir

    tokenizer_dir = str(prepare_model_dir(None))
    with tempfile.TemporaryDirectory() as d:
        build_llava(Path(d), tokenizer_dir)
        requests = make_requests(args.num_prompts)
        init_s, ours_s, ours = run_pagedllm(d, requests, args.output_len)
        hf_s, theirs = run_hf(d, requests, args.output_len, args.hf_batch_size or args.num_prompts)
    n_out = args.num_prompts * args.output_len
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"{args.num_prompts} image requests (49 image tokens each), {args.output_len} output tokens each; "
          f"threads={torch.get_num_threads()}; pagedllm engine init {init_s:.1f} s")
    print(f"pagedllm  {ours_s:7.2f} s  {n_out / ours_s:8.1f} out tok/s")
    print(f"hf        {hf_s:7.2f} s  {n_out / hf_s:8.1f} out tok/s  (static batch of "
          f"{args.hf_batch_size or args.num_prompts})")
    print(f"ratio pagedllm/hf: {hf_s / ours_s:.2f}x; identical token sequences: {same}/{args.num_prompts}")


if __name__ == "__main__":
    main()
