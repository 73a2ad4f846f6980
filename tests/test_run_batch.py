"""`pagedllm run-batch`: OpenAI Batch API files through the server's handlers, in process, on the real model:
answers in input order, each line's errors on that line only, greedy outputs as the engine gives them."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.run_batch import BatchLine, BatchRoute, run_batch_file

PROMPTS = ["The capital of France is", "1, 2, 3,", "Hello, my name is", "Water boils at"]
ENGINE_KW = dict(num_gpu_blocks_override=64, max_model_len=512, swap_space=0.05, max_num_seqs=8)


def _line(custom_id, url="/v1/completions", body=None, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body if body is not None else {"model": "m", "prompt": "x"}, **extra})


def _routes() -> dict[str, BatchRoute]:
    async def never(req):  # the parse tests never run a request
        raise AssertionError("not run")
    return {"/v1/completions": BatchRoute(CompletionRequest, never)}


@pytest.mark.parametrize("text, param, words", [
    ("{not json", None, "not valid JSON"),
    ("[1, 2]", None, "JSON object with custom_id"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "custom_id", "non-empty string"),
    (_line("a", method="GET"), "method", "must be POST"),
    (_line("a", url="/v1/images"), "url", "supported: /v1/completions"),
    (_line("a", body=[]), "body", "JSON object"),
    (_line("a", body={"model": "m", "prompt": "x", "stream": True}), "stream", "cannot stream"),
    (_line("a", body={"model": "m", "prompt": "x", "temperature": "hot"}), "temperature", None),
])
def test_bad_lines_say_what_is_wrong(text: str, param: str | None, words: str | None) -> None:
    line = BatchLine(text, _routes(), set())
    assert line.error is not None and line.error.status == 400
    assert line.error.param == param
    if words:
        assert words in line.error.message


def test_custom_ids_must_be_unique() -> None:
    seen: set[str] = set()
    assert BatchLine(_line("a"), _routes(), seen).error is None
    again = BatchLine(_line("a"), _routes(), seen)
    assert again.error is not None and "earlier line" in again.error.message


@pytest.fixture(scope="module")
def expected_texts() -> list[str]:
    llm = LLM(**ENGINE_KW)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def _batch_file(tmp_path: Path) -> Path:
    lines = [_line(f"c{i}", body={"model": "SmolLM2-135M-Instruct", "prompt": p, "max_tokens": 8,
                                  "temperature": 0, "ignore_eos": True}) for i, p in enumerate(PROMPTS)]
    lines.insert(2, _line("bad-max", body={"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": -1}))
    lines.insert(3, "")  # blank lines are skipped, as vLLM does
    lines.append(_line("chat", url="/v1/chat/completions", body={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))
    lines.append(_line("wrong-model", body={"model": "nope", "prompt": "x", "max_tokens": 2}))
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _check_output(out_lines: list[dict], expected_texts: list[str]) -> None:
    ids = [o["custom_id"] for o in out_lines]
    assert ids == ["c0", "c1", "bad-max", "c2", "c3", "chat", "wrong-model"]  # input order
    by_id = {o["custom_id"]: o for o in out_lines}
    for i, text in enumerate(expected_texts):
        o = by_id[f"c{i}"]
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["text"] == text
    chat = by_id["chat"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["choices"][0]["message"]["role"] == "assistant"
    for bad, param in (("bad-max", "max_tokens"), ("wrong-model", "model")):
        o = by_id[bad]
        assert o["response"]["status_code"] in (400, 404) and o["response"]["body"] is None
        assert o["error"]["error"]["param"] == param
    assert len({o["id"] for o in out_lines}) == len(out_lines)


def test_batch_in_process(tmp_path: Path, expected_texts: list[str]) -> None:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.serving_common import ServingContext
    from pagedllm.tokenizer import get_tokenizer

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(**ENGINE_KW))
    info = engine.info
    ctx = ServingContext(engine=engine, tokenizer=get_tokenizer(info.model_dir), served_model_names=[
        "SmolLM2-135M-Instruct"], model_path=info.model_dir, max_model_len=info.max_seq_len, max_n=8)
    out = tmp_path / "out.jsonl"
    lines = _batch_file(tmp_path).read_text().splitlines()
    summary = asyncio.run(run_batch_file(ctx, lines, str(out), max_in_flight=16, show_progress=False))
    assert (summary.requests, summary.failed) == (7, 2)
    _check_output([json.loads(t) for t in out.read_text().splitlines()], expected_texts)


def test_run_batch_command(tmp_path: Path, expected_texts: list[str]) -> None:
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(_batch_file(tmp_path)),
           "-o", str(out), "--num-gpu-blocks-override", "64", "--max-model-len", "512", "--swap-space", "0.05",
           "--max-num-seqs", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_output([json.loads(t) for t in out.read_text().splitlines()], expected_texts)
    assert "7 requests, 2 failed" in proc.stderr
