"""Client-side drivers of the reliability suite, shared by tests/test_reliability*.py and benchmarks/soak.py:
schema fuzzing (schemathesis), hostile raw bodies, and a load of concurrent streams whose every
request must end exactly once, visibly."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema

ERROR_TYPES = {"invalid_request_error", "server_error"}


def error_body_problem(status: int, content: bytes) -> str | None:
    """None if a 4xx body has OpenAI's error shape, else what is wrong."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"{status}: body is not JSON: {content[:120]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"{status}: no 'error' object: {content[:120]!r}"
    if not isinstance(err.get("message"), str) or not err["message"]:
        return f"{status}: error.message missing"
    if err.get("type") not in ERROR_TYPES:
        return f"{status}: error.type {err.get('type')!r}"
    if "param" not in err or "code" not in err:
        return f"{status}: error.param / error.code missing"
    return None


def check_response(status: int, content: bytes, what: str) -> list[str]:
    if status >= 500:
        return [f"{what}: {status} {content[:200]!r}"]
    if 400 <= status < 500:
        problem = error_body_problem(status, content)
        return [f"{what}: {problem}"] if problem else []
    return []


# -- schema fuzzing ---------------------------------------------------------------------------------
def fuzz_schema(base_url: str, headers: dict[str, str], max_examples: int, seed: int = 0,
                timeout: float = 60.0, paths: tuple[str, ...] | None = None) -> tuple[Counter, list[str]]:
    """Seeded schemathesis cases (valid and invalid) for every route of /openapi.json (or those in `paths`).

    Returns (status counts, failures): a failure is a 5xx, a dropped connection, or a 4xx without
    OpenAI's error body.
    """
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    statuses: Counter = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        if paths is not None and op.path not in paths:
            continue
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            takes_input = op.method.upper() != "GET" and any((op.body, op.path_parameters, op.query, op.headers))
            if mode == schemathesis.GenerationMode.NEGATIVE and not takes_input:
                continue  # GET routes and POST /ping take no input: nothing to get wrong

            @hseed(seed)
            @settings(max_examples=max_examples, derandomize=False, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(op.as_strategy(generation_mode=mode))
            def run(case) -> None:
                what = f"{op.label} [{mode.value}] body={str(case.body)[:160]}"
                try:
                    resp = case.call(base_url=base_url, headers=headers, timeout=timeout)
                except Exception as e:  # dropped connection, timeout
                    failures.append(f"{what}: {type(e).__name__}: {e}")
                    return
                statuses[resp.status_code] += 1
                failures.extend(check_response(resp.status_code, resp.content, what))

            run()
    return statuses, failures


# -- hostile bodies -------------------------------------------------------------------------------------
def hostile_bodies() -> list[tuple[str, str, bytes, str]]:
    """(name, path, raw body, content type): bodies no client library would send."""
    j = "application/json"
    big = b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'", "max_tokens": 1}'
    cases = [
        ("invalid-utf8", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}'),
        ("lone-surrogate", b'{"prompt": "\\ud800", "max_tokens": 1}'),
        ("surrogate-in-chat", None),
        ("deep-nesting-list", b"[" * 200_000 + b"]" * 200_000),
        ("deep-nesting-prompt", b'{"prompt": ' + b"[" * 100_000 + b"1" + b"]" * 100_000 + b"}"),
        ("10MB-body", big),
        ("nan", b'{"prompt": "hi", "max_tokens": 1, "temperature": NaN}'),
        ("infinity", b'{"prompt": "hi", "max_tokens": 1, "top_p": Infinity}'),
        ("-infinity", b'{"prompt": "hi", "max_tokens": 1, "presence_penalty": -Infinity}'),
        ("huge-int", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"),
        ("huge-max-tokens", b'{"prompt": "hi", "max_tokens": 99999999999999999999999}'),
        ("negative-max-tokens", b'{"prompt": "hi", "max_tokens": -5}'),
        ("huge-seed", b'{"prompt": "hi", "max_tokens": 1, "seed": 1e400}'),
        ("huge-seed-int", b'{"prompt": "hi", "max_tokens": 1, "seed": 99999999999999999999999}'),
        ("huge-top-k", b'{"prompt": "hi", "max_tokens": 1, "top_k": 99999999999}'),
        ("huge-n", b'{"prompt": "hi", "max_tokens": 1, "n": 1000000000}'),
        ("negative-n", b'{"prompt": "hi", "max_tokens": 1, "n": -1}'),
        ("huge-logprobs", b'{"prompt": "hi", "max_tokens": 1, "logprobs": 1000000}'),
        ("huge-token-id", b'{"prompt": [99999999999999999999999], "max_tokens": 1}'),
        ("negative-token-id", b'{"prompt": [-1], "max_tokens": 1}'),
        ("huge-stop-token-id", b'{"prompt": "hi", "max_tokens": 1, "stop_token_ids": [99999999999999999999]}'),
        ("empty-prompt-list", b'{"prompt": [], "max_tokens": 1}'),
        ("empty-inner-list", b'{"prompt": [[]], "max_tokens": 1}'),
        ("huge-prompt-list", json.dumps({"prompt": ["x"] * 5000, "max_tokens": 1}).encode()),
        ("huge-stop-list", json.dumps({"prompt": "hi", "max_tokens": 1, "stop": ["z"] * 100_000}).encode()),
        ("empty-body", b""),
        ("null-body", b"null"),
        ("string-body", b'"hello"'),
        ("truncated", b'{"prompt": "hi", "max_t'),
        ("null-bytes", b'{"prompt": "\\u0000\\u0000", "max_tokens": 1}'),
        ("duplicate-keys", b'{"prompt": "a", "prompt": [1], "max_tokens": 1}'),
        ("bool-as-int", b'{"prompt": "hi", "max_tokens": true}'),
        ("float-as-int", b'{"prompt": "hi", "max_tokens": 1.5}'),
        ("logit-bias-list", b'{"prompt": "hi", "max_tokens": 1, "logit_bias": [1]}'),
        ("logit-bias-nan", b'{"prompt": "hi", "max_tokens": 1, "logit_bias": {"1": NaN}}'),
    ]
    out = [(name, "/v1/completions", body, j) for name, body in cases if body is not None]
    out.append(("surrogate-in-chat", "/v1/chat/completions",
                b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}', j))
    out.append(("chat-deep-content", "/v1/chat/completions",
                b'{"messages": [{"role": "user", "content": ' + b"[" * 50_000 + b"]" * 50_000 + b"}]}", j))
    out.append(("chat-empty-messages", "/v1/chat/completions", b'{"messages": []}', j))
    out.append(("chat-huge-messages", "/v1/chat/completions",
                json.dumps({"messages": [{"role": "user", "content": "x"}] * 20_000, "max_tokens": 1}).encode(), j))
    out.append(("tokenize-surrogate", "/tokenize", b'{"prompt": "\\ud83d"}', j))
    out.append(("detokenize-huge", "/detokenize", b'{"tokens": [99999999999999999999]}', j))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        out.append((f"content-type-{ctype or 'none'}", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}', ctype))
    return out


def send_hostile(base_url: str, headers: dict[str, str], timeout: float = 120.0) -> tuple[Counter, list[str]]:
    statuses: Counter = Counter()
    failures: list[str] = []
    with httpx.Client(base_url=base_url, timeout=timeout) as client:
        for name, path, body, ctype in hostile_bodies():
            h = dict(headers)
            if ctype:
                h["content-type"] = ctype
            try:
                r = client.post(path, content=body, headers=h)
            except httpx.HTTPError as e:
                failures.append(f"{name}: {type(e).__name__}: {e}")
                continue
            statuses[r.status_code] += 1
            if r.status_code == 200:
                continue
            failures.extend(check_response(r.status_code, r.content, name))
    return statuses, failures


# -- load and accounting ------------------------------------------------------------------------------------
PROMPTS = [
    "The capital of France is",
    "The capital of France is a city that",  # shares a prefix with the first (prefix caching)
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three colours:",
    "The quick brown fox",
]


@dataclass
class LoadResult:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # completed / error:<code> / client_disconnect / lost
    problems: list[str] = field(default_factory=list)  # lost requests and wrong outputs
    latencies: list[float] = field(default_factory=list)  # completed requests, seconds
    constrained: Counter = field(default_factory=Counter)  # constrained outputs by "form:finish_reason"

    @property
    def lost(self) -> int:
        return self.outcomes["lost"]

    def p(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _plan(i: int, rng: random.Random, max_tokens: int, allowed: dict[str, int]) -> dict[str, Any]:
    """Request i of the load: a mix of streams and whole responses, n, best_of, stop strings, aborts,
    requests under a choice, regex or JSON-schema constraint, calls of a named tool, and requests whose
    allowed_token_ids (`allowed`: word → its one token id) and logit_bias leave only some words."""
    prompt = PROMPTS[i % len(PROMPTS)]
    kind = rng.choice(["greedy", "greedy", "sampled_n2", "best_of", "stop", "chat", "disconnect", "abort", "bad",
                       "constrained", "tool", "allowed"])
    base = {"prompt": prompt, "max_tokens": max_tokens}
    if kind == "bad":  # refused with a 400 while the rest run
        wrong = rng.choice([{"temprature": 0.5}, {"max_tokens": -1}, {"n": "2"}, {"logit_bias": {"x": 1}}])
        return {"kind": kind, "stream": rng.random() < 0.5, "body": {**base, **wrong}}
    if kind == "greedy":
        return {"kind": kind, "stream": True, "body": {**base, "temperature": 0, "ignore_eos": True}}
    if kind == "sampled_n2":
        return {"kind": kind, "stream": True,
                "body": {**base, "temperature": 1.0, "n": 2, "seed": i, "ignore_eos": True}}
    if kind == "best_of":
        return {"kind": kind, "stream": False,
                "body": {**base, "temperature": 1.0, "n": 2, "best_of": 3, "seed": i, "ignore_eos": True}}
    if kind == "stop":
        return {"kind": kind, "stream": True, "body": {**base, "temperature": 0.8, "seed": i, "stop": [" the", "\n"]}}
    if kind == "chat":
        return {"kind": kind, "stream": True, "chat": True,
                "body": {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True}}
    if kind == "constrained":  # a grammar per request: n = 2 forks it, preemption replays it
        form, constraint = rng.choice(list(CONSTRAINTS.items()))
        return {"kind": kind, "stream": rng.random() < 0.5, "form": form,
                "body": {**base, **constraint, "temperature": 1.0, "seed": i, "n": rng.choice([1, 2]),
                         "max_tokens": 4 * max_tokens}}
    if kind == "tool":  # a named function: its arguments are generated under the function's JSON schema
        return {"kind": kind, "stream": rng.random() < 0.5, "chat": True, "form": "json",
                "body": {"messages": [{"role": "user", "content": prompt}], "tools": [ITEM_TOOL],
                         "tool_choice": {"type": "function", "function": {"name": "record_item"}},
                         "temperature": 1.0, "seed": i, "max_tokens": 2 * max_tokens}}  # the chat template's tokens
    if kind == "allowed":  # the words' tokens only, one of them banned by a -100 bias
        banned = rng.choice(sorted(allowed))
        return {"kind": kind, "stream": rng.random() < 0.5, "form": "allowed", "words": sorted(set(allowed) - {banned}),
                "body": {**base, "temperature": 1.0, "seed": i, "n": rng.choice([1, 2]), "ignore_eos": True,
                         "allowed_token_ids": sorted(allowed.values()), "logit_bias": {str(allowed[banned]): -100}}}
    if kind == "disconnect":
        return {"kind": kind, "stream": True, "disconnect_after": rng.randint(1, 3),
                "body": {**base, "temperature": 1.0, "ignore_eos": True, "max_tokens": 4 * max_tokens}}
    return {"kind": kind, "stream": False, "abort_after_s": rng.uniform(0.05, 1.0),
            "body": {**base, "temperature": 1.0, "ignore_eos": True, "max_tokens": 4 * max_tokens}}


async def _one(client: httpx.AsyncClient, plan: dict[str, Any], refs: dict[str, str], res: LoadResult) -> None:
    body = dict(plan["body"])
    path = "/v1/chat/completions" if plan.get("chat") else "/v1/completions"
    n = body.get("n", 1)
    t0 = time.monotonic()
    tag = f"{plan['kind']}:{body.get('prompt', '')[:20]!r}"
    if plan["stream"]:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    try:
        if not plan["stream"]:
            coro = client.post(path, json=body)
            if "abort_after_s" in plan:
                try:
                    r = await asyncio.wait_for(coro, plan["abort_after_s"])
                except asyncio.TimeoutError:
                    res.outcomes["client_abort"] += 1
                    return
            else:
                r = await coro
            _judge_whole(r, plan, n, tag, res, time.monotonic() - t0, refs=refs)
            return
        finish: dict[int, str] = {}
        text: dict[int, str] = {}
        usage = None
        error = None
        done = events = 0
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                content = await r.aread()
                _judge_whole(r, plan, n, tag, res, 0.0, content)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done += 1
                    continue
                obj = json.loads(data)
                events += 1
                if "error" in obj:
                    error = obj["error"]
                    continue
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices", []):
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    for call in (ch.get("delta") or {}).get("tool_calls") or []:  # a call's arguments, in pieces
                        piece = (piece or "") + ((call.get("function") or {}).get("arguments") or "")
                    text[ch["index"]] = text.get(ch["index"], "") + (piece or "")
                    if ch.get("finish_reason") is not None:
                        if ch["index"] in finish:
                            res.problems.append(f"{tag}: choice {ch['index']} finished twice")
                        finish[ch["index"]] = ch["finish_reason"]
                if plan.get("disconnect_after") and events >= plan["disconnect_after"]:
                    res.outcomes["client_disconnect"] += 1
                    return
        if error is not None:
            res.outcomes[f"error:{error.get('code')}"] += 1
        elif done != 1:
            res.outcomes["lost"] += 1
            res.problems.append(f"{tag}: stream ended without exactly one [DONE] (got {done})")
        elif any(v == "abort" for v in finish.values()):
            res.outcomes["aborted_visible"] += 1
        elif sorted(finish) != list(range(n)):
            res.outcomes["lost"] += 1
            res.problems.append(f"{tag}: [DONE] but finish_reason only for {sorted(finish)} of {n}: a bare end")
        else:
            res.outcomes["completed"] += 1
            res.latencies.append(time.monotonic() - t0)
            _check_outputs(plan, n, usage, text, tag, refs, res, finish)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.outcomes["lost"] += 1
        res.problems.append(f"{tag}: {type(e).__name__}: {e}")


def _judge_whole(r: httpx.Response, plan, n, tag, res: LoadResult, latency: float, content: bytes | None = None,
                 refs: dict | None = None) -> None:
    content = r.content if content is None else content
    if plan["kind"] == "bad" and r.status_code != 400:
        res.outcomes["lost"] += 1
        res.problems.append(f"{tag}: a bad request got {r.status_code}, not 400: {content[:160]!r}")
        return
    if r.status_code != 200:
        problem = error_body_problem(r.status_code, content)
        if problem:
            res.outcomes["lost"] += 1
            res.problems.append(f"{tag}: {problem}")
        else:
            res.outcomes[f"error:{json.loads(content)['error'].get('code')}"] += 1
        return
    obj = json.loads(content)
    if len(obj["choices"]) != n or any(c.get("finish_reason") is None for c in obj["choices"]):
        res.outcomes["lost"] += 1
        res.problems.append(f"{tag}: {len(obj['choices'])} choices / missing finish_reason")
        return
    res.outcomes["completed"] += 1
    res.latencies.append(latency)
    texts = {c["index"]: _whole_text(c, plan) for c in obj["choices"]}
    finish = {c["index"]: c["finish_reason"] for c in obj["choices"]}
    _check_outputs(plan, n, obj.get("usage"), texts, tag, refs or {}, res, finish)


def _whole_text(choice: dict, plan: dict) -> str:
    """A whole response's choice as the load compares it: its text, or a tool call's arguments."""
    if not plan.get("chat"):
        return choice.get("text", "")
    message = choice["message"]
    calls = "".join(c["function"]["arguments"] for c in message.get("tool_calls") or [])
    return (message.get("content") or "") + calls


ITEM_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
               "required": ["id"], "additionalProperties": False}
#: The constrained requests' forms: each output that ends by the grammar (finish_reason "stop") must satisfy it.
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "choice": {"guided_choice": ["red", "green", "blue"]},
    "regex": {"guided_regex": "[0-9]{3}-[0-9]{2}"},
    "json": {"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM_SCHEMA}}},
}
#: The tool requests' function: its arguments follow the "json" form's schema.
ITEM_TOOL = {"type": "function", "function": {
    "name": "record_item", "description": "Record an item by its id.",
    "parameters": ITEM_SCHEMA}}


#: Words the "allowed" requests may emit (those the tokenizer makes one token each, with a leading space).
ALLOWED_WORDS = (" red", " green", " blue", " yellow")


def constraint_problem(form: str, text: str, words: list[str] | None = None) -> str | None:
    """Why `text` breaks the constraint of `form` (CONSTRAINTS; "allowed": a run of `words`), or None."""
    if form == "allowed":
        return None if re.fullmatch("(?:" + "|".join(map(re.escape, words)) + ")*", text) else "has other words"
    if form == "choice":
        return None if text in CONSTRAINTS["choice"]["guided_choice"] else "not one of the choices"
    if form == "regex":
        return None if re.fullmatch(CONSTRAINTS["regex"]["guided_regex"], text) else "does not match the regex"
    try:
        jsonschema.validate(json.loads(text), ITEM_SCHEMA)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    except jsonschema.ValidationError as e:
        return f"does not follow the schema: {e.message}"
    return None


def _check_outputs(plan, n, usage, text, tag, refs, res: LoadResult, finish: dict[int, str] | None = None) -> None:
    body = plan["body"]
    if plan["kind"] == "allowed":  # every token obeys allowed_token_ids and logit_bias, however the output ends
        for i, t in text.items():
            res.constrained[f"allowed:{(finish or {}).get(i)}"] += 1
            why = constraint_problem("allowed", t, plan["words"])
            if why:
                res.problems.append(f"{tag}: allowed_token_ids output {t!r} {why} than {plan['words']}")
    if plan["kind"] in ("constrained", "tool"):
        ended = ("stop", "tool_calls") if plan["kind"] == "tool" else ("stop",)
        for i, t in text.items():
            reason = (finish or {}).get(i)
            res.constrained[f"{'tool' if plan['kind'] == 'tool' else plan['form']}:{reason}"] += 1
            why = constraint_problem(plan["form"], t) if reason in ended else None
            if why:
                res.problems.append(f"{tag}: {plan['form']} output {t!r} {why}")
    if body.get("ignore_eos") and not body.get("stop"):
        want = n * body["max_tokens"]
        got = (usage or {}).get("completion_tokens")
        if got != want:
            res.problems.append(f"{tag}: completion_tokens {got} != n*max_tokens {want}")
    key = _ref_key(plan, seeded=True)
    if key in refs and text != refs[key]:
        what = "greedy" if plan["kind"] in GREEDY_KINDS else "seeded"
        res.problems.append(f"{tag}: {what} output {text!r} != served alone {refs[key]!r}")


GREEDY_KINDS = ("greedy", "chat")
SEEDED_KINDS = ("sampled_n2", "best_of", "stop", "constrained", "tool", "allowed")  # temperature > 0, a seed each


def _ref_key(plan, seeded: bool) -> str | None:
    """The reference a request's outputs must equal: greedy ones always; seeded sampled ones with `seeded`."""
    if plan["kind"] not in GREEDY_KINDS + (SEEDED_KINDS if seeded else ()):
        return None
    return f"{plan['kind']}|{json.dumps(plan['body'], sort_keys=True)}"


async def _references(client: httpx.AsyncClient, plans, seeded: bool) -> dict[str, dict[int, str]]:
    """Each distinct greedy (and, with `seeded`, seeded sampled) request served alone, before the load: its
    choices' texts by index."""
    refs: dict[str, dict[int, str]] = {}
    for plan in plans:
        key = _ref_key(plan, seeded)
        if key is None or key in refs:
            continue
        path = "/v1/chat/completions" if plan.get("chat") else "/v1/completions"
        r = await client.post(path, json=plan["body"])
        r.raise_for_status()
        refs[key] = {ch["index"]: _whole_text(ch, plan) for ch in r.json()["choices"]}
    return refs


async def _one_token_words(client: httpx.AsyncClient, words: tuple[str, ...]) -> dict[str, int]:
    """word → token id, for the words the server's tokenizer makes one token (at least two of them)."""
    out = {}
    for w in words:
        r = await client.post("/tokenize", json={"prompt": w, "add_special_tokens": False})
        r.raise_for_status()
        if len(ids := r.json()["tokens"]) == 1:
            out[w] = ids[0]
    if len(out) < 2:
        raise RuntimeError(f"the tokenizer makes fewer than two of {words} one token each: {out}")
    return out


async def run_load(base_url: str, headers: dict[str, str], n_requests: int, max_tokens: int = 4, seed: int = 0,
                   timeout: float = 600.0, check_seeded: bool = False) -> LoadResult:
    """All requests at once (one connection each); every one must end exactly once, visibly. Greedy requests must
    equal themselves served alone; with `check_seeded` seeded sampled ones too (n > 1, best_of and stop strings
    included: exact where the server is batch-invariant, or where nothing changes a request's chunking)."""
    rng = random.Random(seed)
    res = LoadResult(sent=n_requests)
    # An idle keep-alive connection is dropped by the client after 1 s, well before uvicorn's 5 s server-side
    # timeout: with equal timeouts a request sent on a connection the server is closing at that moment ends
    # in a ReadError that no server can prevent (HTTP/1.1 keep-alive race), and would count as lost.
    limits = httpx.Limits(max_connections=n_requests + 8, max_keepalive_connections=n_requests + 8,
                          keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as client:
        allowed = await _one_token_words(client, ALLOWED_WORDS)
        plans = [_plan(i, rng, max_tokens, allowed) for i in range(n_requests)]
        refs = await _references(client, plans, check_seeded)
        await asyncio.gather(*(_one(client, p, refs, res) for p in plans))
    return res
