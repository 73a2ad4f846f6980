"""Tests for pagedllm.tokenizer with the real default model's tokenizer."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagedllm.model.loader import prepare_model_dir  # noqa: E402
from pagedllm.tokenizer import (  # noqa: E402
    IncrementalDetokenizer,
    apply_chat_template,
    get_tokenizer,
    render_chat_template,
)

MULTIBYTE = "héllo wörld 你好 🙂 — naïve café, Ελληνικά, русский, 日本語テキスト 🚀🎉"
ENGLISH = "The quick brown fox jumps over the lazy dog.\n\n  Indented line\twith tab, 12345 digits!"


@pytest.fixture(scope="session")
def tok() -> Any:
    return get_tokenizer(prepare_model_dir(None))


def stream(tok: Any, ids: list[int], chunk: int = 1, prompt: list[int] | None = None,
           **kwargs: Any) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` chunk by chunk; returns all deltas (flush last) and the detokenizer."""
    d = IncrementalDetokenizer(tok, prompt or [], **kwargs)
    deltas = [d.append(ids[i:i + chunk]).delta_text for i in range(0, len(ids), chunk)]
    deltas.append(d.flush())
    return deltas, d


def test_get_tokenizer_variants(tok: Any) -> None:
    assert tok.eos_token == "<|im_end|>"
    assert tok.encode("Hi", add_special_tokens=False) == tok.encode("Hi")  # no BOS added
    assert get_tokenizer(None).vocab_size == tok.vocab_size  # default model name / None work too
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_tokenizer("/nonexistent/model/dir")


@pytest.mark.parametrize("text", [ENGLISH, MULTIBYTE])
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_decode(tok: Any, text: str, chunk: int) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    prompt = apply_chat_template(tok, [{"role": "user", "content": "Say something"}])
    deltas, d = stream(tok, ids, chunk=chunk, prompt=prompt)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert d.output_text == text
    assert not any("\ufffd" in x for x in deltas)  # split characters are never emitted half-done


def test_multibyte_characters_wait_for_completion(tok: Any) -> None:
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is split across byte-level tokens
    d = IncrementalDetokenizer(tok, [])
    assert [d.append([i]).delta_text for i in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_random_token_ids_match_decode(tok: Any) -> None:
    rng = random.Random(1234)
    for trial in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        skip = trial % 2 == 0
        deltas, _ = stream(tok, ids, chunk=rng.choice([1, 2, 5]), prompt=prompt, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids


def test_special_tokens_kept_when_not_skipped(tok: Any) -> None:
    ids = tok.encode("Hello<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "Hello<|im_end|>"
    assert "".join(stream(tok, ids, skip_special_tokens=True)[0]) == "Hello"


def test_stop_string_truncates_and_ignores_rest(tok: Any) -> None:
    ids = tok.encode("The capital of France is Paris. It is big.", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["Paris"])
    deltas, matched = [], None
    for i in ids:
        r = d.append([i])
        deltas.append(r.delta_text)
        if r.stop_str_matched:
            matched = r.stop_str_matched
            break
    assert matched == "Paris" and d.stop_str_matched == "Paris" and d.finished
    assert "".join(deltas) == d.output_text == "The capital of France is "
    assert d.append(tok.encode(" More text", add_special_tokens=False)).delta_text == ""
    assert d.flush() == "" and d.output_text == "The capital of France is "


def test_stop_string_hold_back_and_release(tok: Any) -> None:
    d = IncrementalDetokenizer(tok, [], stop=["Paris"])
    d.append(tok.encode("I like Pa", add_special_tokens=False))
    assert d.output_text == "I like "  # "Pa" may start "Paris": held back
    r = d.append(tok.encode("per", add_special_tokens=False))
    assert r.delta_text == "Paper" and d.output_text == "I like Paper"  # ruled out: released
    d.append(tok.encode(" from Par", add_special_tokens=False))
    assert d.output_text == "I like Paper from "
    assert d.flush() == "Par" and d.output_text == "I like Paper from Par"


def test_stop_string_across_tokens_and_earliest_match(tok: Any) -> None:
    text = "alpha beta\n\nUser: gamma END"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, d = stream(tok, ids, stop=["END", "\n\nUser:"])
    assert d.stop_str_matched == "\n\nUser:" and d.output_text == "".join(deltas) == "alpha beta"


def test_include_stop_str_in_output(tok: Any) -> None:
    ids = tok.encode("The capital of France is Paris. It is big.", add_special_tokens=False)
    deltas, d = stream(tok, ids, stop=["Paris"], include_stop_str_in_output=True)
    assert d.stop_str_matched == "Paris"
    assert "".join(deltas) == d.output_text == "The capital of France is Paris"


def test_include_multi_token_stop_str(tok: Any) -> None:
    ids = tok.encode("alpha beta\n\nUser: gamma", add_special_tokens=False)
    deltas, d = stream(tok, ids, stop=["\n\nUser:"], include_stop_str_in_output=True)
    assert d.stop_str_matched == "\n\nUser:"
    assert "".join(deltas) == d.output_text == "alpha beta\n\nUser:"


def test_stop_within_multibyte_text(tok: Any) -> None:
    ids = tok.encode("你好 🙂 世界", add_special_tokens=False)
    deltas, d = stream(tok, ids, stop=["🙂"])
    assert "".join(deltas) == d.output_text == "你好 " and d.stop_str_matched == "🙂"


def test_random_stop_strings_properties(tok: Any) -> None:
    rng = random.Random(7)
    corpus = [ENGLISH, MULTIBYTE, "Paris is in France. Parisians like Paris."]
    for _ in range(200):
        text = rng.choice(corpus)
        ids = tok.encode(text, add_special_tokens=False)
        a = rng.randrange(len(text))
        stops = [text[a:a + rng.randrange(1, 6)], rng.choice(["zzz", "Par", "ö", "\n\n", "🙂"])]
        include = rng.random() < 0.5
        deltas, d = stream(tok, ids, chunk=rng.choice([1, 2, 4]), stop=stops, include_stop_str_in_output=include)
        out = d.output_text
        assert "".join(deltas) == out and text.startswith(out)
        assert d.stop_str_matched is not None  # stops[0] is a substring of the text
        cut = min(text.find(s) for s in stops if s in text)
        matched = d.stop_str_matched
        assert out == (text[:cut] + matched if include else text[:cut])


def test_detokenizer_is_fast(tok: Any) -> None:
    ids = tok.encode((MULTIBYTE + " " + ENGLISH) * 20, add_special_tokens=False)
    t0 = time.perf_counter()
    stream(tok, ids, stop=["Paris", "\n\nUser:"])
    per_token = (time.perf_counter() - t0) / len(ids)
    assert per_token < 200e-6, f"{per_token * 1e6:.1f} us/token"


def test_chat_template_structure(tok: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = render_chat_template(tok, messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = apply_chat_template(tok, messages)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3  # special tokens are single ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    no_prompt = render_chat_template(tok, messages, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    default_system = render_chat_template(tok, [{"role": "user", "content": "Hi"}])
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert render_chat_template(tok, [messages[0]] + parts) == text.replace("Hi there", "Hi\nthere")  # vLLM's "\n"
    one_part = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    assert render_chat_template(tok, [messages[0]] + one_part) == text


def test_chat_template_errors(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="role"):
        apply_chat_template(tok, [{"content": "no role"}])
    with pytest.raises(ValueError, match="content"):
        apply_chat_template(tok, [{"role": "user"}])
    with pytest.raises(ValueError, match="must be a dict"):
        apply_chat_template(tok, ["hello"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="list of dicts"):
        apply_chat_template(tok, "hello")  # type: ignore[arg-type]
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, [{"role": "user", "content": "Hi"}])
    ids = apply_chat_template(tok, [{"role": "user", "content": "Hi"}], chat_template=custom)
    assert tok.decode(ids) == "[user] Hi\n"
