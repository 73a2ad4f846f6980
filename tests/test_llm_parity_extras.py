"""Small vLLM-parity items of the offline LLM: text parts joined with "\\n" in the "string" content format, the
allowed_local_media_path engine argument (LLM.chat with file:// images on a tiny random LLaVA), and
LLM.apply_model (one result per worker, tensor-parallel processes included)."""
from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints import cli

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Shows the content a "string" template gets.
STRING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_gpu_blocks_override=64, max_model_len=256, enable_sleep_mode=True)


# -- text parts joined with "\n" (vLLM's _parse_chat_message_content_parts) ---------------------------------------
def test_text_parts_join_with_newline_in_the_string_format(llm):
    tok = llm.get_tokenizer()

    def prompt_ids(content, **kw) -> list[int]:
        return llm.chat([{"role": "user", "content": content}], ONE_TOKEN, use_tqdm=False, **kw)[0].prompt_token_ids

    two = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "Be brief."}]
    # The model's own template reads strings ("auto" resolves to "string").
    own = tok.apply_chat_template([{"role": "user", "content": "Name a colour.\nBe brief."}], tokenize=False,
                                  add_generation_prompt=True)
    assert prompt_ids(two) == tok.encode(own, add_special_tokens=False)
    assert prompt_ids(two, chat_template=STRING_TEMPLATE, chat_template_content_format="string") == \
        tok.encode("<user>Name a colour.\nBe brief.</user>", add_special_tokens=False)
    # One part: nothing to join, the same prompt as the plain string.
    assert prompt_ids([two[0]]) == prompt_ids("Name a colour.")
    assert prompt_ids([]) == prompt_ids("")


# -- allowed_local_media_path ---------------------------------------------------------------------------------------
def test_allowed_local_media_path_is_an_engine_argument(tmp_path):
    args = cli.build_parser().parse_args(["generate", "--allowed-local-media-path", str(tmp_path)])
    assert EngineArgs.from_cli_args(args).allowed_local_media_path == str(tmp_path)
    (tmp_path / "a.png").write_bytes(b"")
    # Checked before the model loads.
    with pytest.raises(ValueError, match=r"allowed_local_media_path .*nope: no such directory"):
        LLM(allowed_local_media_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"allowed_local_media_path .*a\.png: not a directory"):
        LLM(allowed_local_media_path=str(tmp_path / "a.png"))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, default_model_dir) -> str:
    from test_multimodal_llava import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), default_model_dir)


def test_llm_chat_reads_file_urls_under_allowed_local_media_path(llava_dir, tmp_path):
    from PIL import Image

    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    rng = np.random.RandomState(3)
    img = Image.fromarray(rng.randint(0, 256, (40, 48, 3)).astype("uint8"))
    img.save(allowed / "in.png")
    img.save(outside / "out.png")

    def chat(llm: LLM, part: dict) -> list[int]:
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
        return list(llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)

    kw = dict(num_gpu_blocks_override=64, block_size=8, max_model_len=256, swap_space=0.01)
    llm = LLM(llava_dir, allowed_local_media_path=str(allowed), **kw)
    # "<dir>/../allowed" resolves to the directory itself.
    url = f"file://{allowed}/../allowed/in.png"
    assert chat(llm, {"type": "image_url", "image_url": {"url": url}}) == chat(llm, {"type": "image_pil",
                                                                                      "image_pil": img})
    with pytest.raises(ValueError, match="not under the allowed local media directory"):
        chat(llm, {"type": "image_url", "image_url": {"url": f"file://{outside}/out.png"}})
    del llm
    plain = LLM(llava_dir, **kw)
    with pytest.raises(ValueError, match=r"local files \(file://\) are refused.*allowed_local_media_path=DIR"):
        chat(plain, {"type": "image_url", "image_url": {"url": f"file://{allowed}/in.png"}})


# -- apply_model ------------------------------------------------------------------------------------------------------
def _embedding_rows(model) -> int:
    """A module-level function for apply_model: this rank's rows of the input embedding."""
    return int(model.model.embed_tokens.weight.shape[0])


def test_apply_model_runs_on_the_model_of_each_worker(llm):
    assert llm.apply_model(lambda m: type(m).__name__) == ["LlamaForCausalLM"]
    vocab = llm.llm_engine.hf_config.vocab_size
    assert llm.apply_model(_embedding_rows) == [vocab]
    assert llm.apply_model(lambda m: m.training) == [False]
    with pytest.raises(ValueError, match="func must be a callable taking the model"):
        llm.apply_model("embed_tokens")  # type: ignore[arg-type]
    llm.sleep(level=2)
    try:
        with pytest.raises(RuntimeError, match="holds no model .*wake_up"):
            llm.apply_model(_embedding_rows)
    finally:
        llm.wake_up()
    assert llm.apply_model(_embedding_rows) == [vocab]


def test_apply_model_with_tensor_parallel_worker_processes(tmp_path):
    from tiny_models import save_tiny_llama

    llm = LLM(model=save_tiny_llama(tmp_path), skip_tokenizer_init=True, num_gpu_blocks_override=16,
              max_model_len=64, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert llm.apply_model(lambda m: type(m).__name__) == ["LlamaForCausalLM"] * 2  # a lambda, cloudpickled
    # Each rank holds its shard: half of the 1024-row vocabulary.
    assert llm.apply_model(_embedding_rows) == [512, 512]
    offset = 1000  # a closure's captured value crosses too
    assert llm.apply_model(lambda m: _embedding_rows(m) + offset) == [1512, 1512]
