"""`pagedllm chat`, `pagedllm complete` (vLLM's OpenAI clients) against a real server process with the bundled model,
and `pagedllm collect-env`. The server answers greedily (--override-generation-config temperature 0: the clients,
as vLLM's, send no sampling fields), so a client's reply equals that of a direct request with the same messages."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

from pagedllm.benchmarks.server_process import free_port  # noqa: E402

API_KEY = "test-key-1"
# Greedy, and short replies (max_new_tokens caps every request's max_tokens) so each turn is quick.
GENERATION = {"temperature": 0.0, "max_new_tokens": 16}
CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--no-dashboard", "--no-warm-up-request", "--api-key", API_KEY,
                        "--override-generation-config", json.dumps(GENERATION)])
    yield srv
    srv.stop()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL")}
    return {**env, **extra}


def _cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, text=True, timeout=120, check=False,
                          env=env or _env(), stdin=None if stdin is not None else subprocess.DEVNULL)


def _direct(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url(path), json={"model": MODEL_NAME, **body}, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _chat(server, messages: list[dict]) -> str:
    return _direct(server, "/v1/chat/completions", {"messages": messages})["message"]["content"]


def _url(server) -> str:
    return server.url("/v1")


def test_chat_quick_prints_the_reply(server):
    """`chat -q MESSAGE`: the first listed model, the reply streamed and printed, exit 0."""
    out = _cli("chat", "--url", _url(server), "--api-key", API_KEY, "-q", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    reply = _chat(server, [{"role": "user", "content": "What is the capital of France?"}])
    assert reply
    assert out.stdout == f"Using model: {MODEL_NAME}\n{reply}\n"


def test_chat_repl_keeps_the_conversation_and_system_prompt(server):
    """The REPL reads lines after "> " until EOF; each request carries the system prompt and the turns before it
    (the replies equal direct requests with those messages, and differ from requests without them)."""
    system = {"role": "system", "content": "You are a pirate."}
    out = _cli("chat", "--url", _url(server), "--system-prompt", system["content"], stdin="first\nsecond\n",
               env=_env(OPENAI_API_KEY=API_KEY))  # the key from the environment
    assert out.returncode == 0, out.stderr
    first = [system, {"role": "user", "content": "first"}]
    reply1 = _chat(server, first)
    reply2 = _chat(server, [*first, {"role": "assistant", "content": reply1}, {"role": "user", "content": "second"}])
    assert out.stdout == (f"Using model: {MODEL_NAME}\nPlease enter a message for the chat model:\n"
                          f"> {reply1}\n> {reply2}\n> \n")
    # the system prompt and the history change the replies, so the equalities above show they were sent
    assert reply1 != _chat(server, [{"role": "user", "content": "first"}])
    assert reply2 != _chat(server, [system, {"role": "user", "content": "second"}])


def test_complete_quick_matches_a_direct_completion(server):
    out = _cli("complete", "--url", _url(server), "--api-key", API_KEY, "--model-name", MODEL_NAME,
               "--max-tokens", "6", "-q", "The capital of France is")
    assert out.returncode == 0, out.stderr
    text = _direct(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6})["text"]
    assert text and out.stdout == f"Using model: {MODEL_NAME}\n{text}\n"


def test_ctrl_c_ends_the_repl_cleanly(server):
    proc = subprocess.Popen([*CLI, "chat", "--url", _url(server), "--api-key", API_KEY], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout.readline() == f"Using model: {MODEL_NAME}\n"
        assert proc.stdout.readline() == "Please enter a message for the chat model:\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_errors_are_one_clear_line(server):
    """A wrong key (401), an unknown model and an unreachable server: status 1 and one `error:` line naming the
    problem, no traceback. (Run side by side: each is a CLI start.)"""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    cases = {
        "key": ["chat", "--url", _url(server), "--api-key", "wrong", "-q", "hi"],
        "model": ["complete", "--url", _url(server), "--api-key", API_KEY, "--model-name", "no-such-model", "-q",
                  "hi"],
        "dead": ["chat", "--url", dead, "-q", "hi"],
    }
    procs = {name: subprocess.Popen([*CLI, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=_env())
             for name, args in cases.items()}
    errors = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, (name, err)
        assert "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
        errors[name] = lines[0]
    assert "401" in errors["key"] and "/v1/models" in errors["key"] and "--api-key" in errors["key"]
    assert "no-such-model" in errors["model"] and "/v1/completions" in errors["model"]
    assert "cannot reach the server" in errors["dead"] and dead in errors["dead"]


def test_collect_env():
    """The report names torch's version and build, the CPU ISA pagedllm detects and the variables set, with secrets
    masked; the module imports nothing heavy beyond torch."""
    import torch

    import pagedllm
    from pagedllm.kernels.cpu_isa import detect_cpu_isa

    env = _env(VLLM_API_KEY="secret123", PAGEDLLM_SOME_SETTING="on", HF_TOKEN="hf_secret456")
    probe = ("import sys\nfrom pagedllm.entrypoints import collect_env\ncollect_env.collect_env_info()\n"
             "print(' '.join(m for m in ('transformers', 'fastapi', 'openai', 'xgrammar', 'llguidance', 'triton', "
             "'uvicorn', 'gguf') if m in sys.modules))")
    imports = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True, env=env)
    out = _cli("collect-env", env=env)
    assert out.returncode == 0, out.stderr
    report = out.stdout
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in report.splitlines()
             if " : " in line}
    assert lines["PyTorch version"] == torch.__version__
    assert lines["torch"] == torch.__version__
    assert lines["Is debug build"] in ("True", "False")
    assert "CUDA used to build PyTorch" in lines and "OS" in lines and "Python version" in lines
    assert lines["Is CUDA available"] == str(torch.cuda.is_available())
    assert "GPU models and configuration" in lines
    assert lines["pagedllm CPU ISA"].startswith(detect_cpu_isa().name + " ")
    assert lines["CPU"] and lines["pagedllm"].startswith(pagedllm.__version__)
    assert lines["PAGEDLLM_SOME_SETTING"] == "on"
    assert "VLLM_API_KEY" in lines and "HF_TOKEN" in lines
    assert "secret123" not in report + out.stderr and "hf_secret456" not in report + out.stderr
    for label in ("xgrammar", "llguidance", "fastapi", "uvicorn", "openai", "numpy", "gguf", "transformers"):
        assert lines[label], label  # a version or "not installed"
    heavy, _ = imports.communicate(timeout=120)
    assert imports.returncode == 0 and heavy.strip() == "", heavy


def test_client_commands_start_without_the_engine():
    """`chat` / `complete` / `collect-env` parse without importing torch or fastapi (they start at once); the other
    subcommands still parse."""
    code = ("import sys\nfrom pagedllm.entrypoints import cli\n"
            "rc = cli.main(['--log-level', 'WARNING', 'complete', '--url', sys.argv[1], '-q', 'x'])\n"
            "print(rc, 'torch' in sys.modules, 'fastapi' in sys.modules)\n")
    url = f"http://127.0.0.1:{free_port()}/v1"
    out = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=120, env=_env())
    assert out.stdout.split() == ["1", "False", "False"], (out.stdout, out.stderr)
    assert "cannot reach the server" in out.stderr
    from pagedllm.entrypoints.cli import _command_of, build_parser

    assert _command_of(["--log-level", "DEBUG", "chat", "-q", "hi"]) == "chat"
    assert _command_of(["generate", "--prompt", "chat"]) == "generate"
    assert build_parser().parse_args(["generate", "--max-tokens", "3"]).max_tokens == 3
