"""Structured outputs in the engine (bundled model, CPU): JSON schema / regex / choice / grammar constraints
always hold, leave unconstrained neighbours untouched, survive n > 1, beam search and preemption."""
from __future__ import annotations

import contextlib
import json
import re
import threading
import time

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.core.sequence import SequenceStatus  # noqa: E402
from pagedllm.structured_output.sample_schemas import SCHEMAS, max_tokens_for  # noqa: E402

SO = StructuredOutputsParams


@pytest.fixture(scope="module")
def llm():
    llm = LLM(num_gpu_blocks_override=512, max_num_seqs=64, max_model_len=1024)
    assert llm.llm_engine.structured_output.backend_name == "xgrammar"  # "auto"
    return llm


def _schema_batch(samples_per_schema: int, seed0: int = 0):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for k in range(samples_per_schema):
            prompts.append(f"Reply with JSON matching {json.dumps(schema)[:60]}\n")
            params.append(SamplingParams(temperature=1.0, seed=seed0 + 100 * i + k, max_tokens=max_tokens_for(schema),
                                         structured_outputs=SO(json=schema)))
    return prompts, params


def _assert_all_valid(outs, params):
    for out, p in zip(outs, params):
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text), p.structured_outputs.json)


def test_json_schemas_20_generations(llm):
    """20 schemas x 1 seeded sample at temperature 1 (compiles all 20; the 200-generation run is below)."""
    prompts, params = _schema_batch(1)
    _assert_all_valid(llm.generate(prompts, params, use_tqdm=False), params)


def test_json_schemas_200_generations(llm):
    prompts, params = _schema_batch(10, seed0=7)
    assert len(prompts) == 200
    _assert_all_valid(llm.generate(prompts, params, use_tqdm=False), params)


def test_regex_choice_grammar_always_match(llm):
    regex = r"(\+33|0)[1-9]( \d\d){4}"
    grammar = 'root ::= "(" expr ")"\nexpr ::= num ("+" num)*\nnum ::= [1-9] [0-9]?'
    choices = ["red", "green", "light blue"]
    params = ([SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=SO(regex=regex))
               for i in range(8)]
              + [SamplingParams(temperature=1.0, seed=i, max_tokens=10, structured_outputs=SO(choice=choices))
                 for i in range(8)]
              + [SamplingParams(temperature=0.8, seed=i, max_tokens=60, structured_outputs=SO(grammar=grammar))
                 for i in range(4)])
    outs = llm.generate(["A phone number or a colour:"] * len(params), params, use_tqdm=False)
    for out in outs[:8]:
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
    assert all(o.outputs[0].text in choices for o in outs[8:16])
    for out in outs[16:]:
        c = out.outputs[0]
        assert c.finish_reason == "length" or re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", c.text), c.text


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    plain = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=0.9, seed=5, max_tokens=16),
             SamplingParams(temperature=0, max_tokens=16)]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed_prompts = [prompts[0], "JSON:", prompts[1], "Pick:", prompts[2]]
    mixed_params = [plain[0], SamplingParams(temperature=1.0, max_tokens=60, structured_outputs=SO(json=SCHEMAS[0])),
                    plain[1], SamplingParams(temperature=0, max_tokens=5, structured_outputs=SO(choice=["a", "b"])),
                    plain[2]]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    for a, m in zip(alone, [mixed[0], mixed[2], mixed[4]]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    assert mixed[3].outputs[0].text in ("a", "b")


def test_n_best_of_and_beam_search_stay_valid(llm):
    schema = SCHEMAS[2]
    outs = llm.generate(["Colour JSON:"] * 2, [
        SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=max_tokens_for(schema), structured_outputs=SO(json=schema)),
        SamplingParams(n=2, best_of=3, temperature=1.0, seed=2, max_tokens=max_tokens_for(schema),
                       structured_outputs=SO(json=schema))], use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [4, 2]
    for o in outs:
        for c in o.outputs:
            jsonschema.validate(json.loads(c.text), schema)
    beam = llm.generate(["Answer:"], SamplingParams(use_beam_search=True, best_of=3, n=3, temperature=0, max_tokens=12,
                                                    structured_outputs=SO(regex=r"(yes|no), [0-9]{1,3}")),
                        use_tqdm=False)[0]
    assert len(beam.outputs) == 3
    for c in beam.outputs:
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", c.text), c.text


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_valid(mode):
    small = LLM(num_gpu_blocks_override=12, max_model_len=256, preemption_mode=mode, swap_space=0.05)
    schema = SCHEMAS[9]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens_for(schema), n=2 if i % 3 == 0 else 1,
                             structured_outputs=SO(json=schema)) for i in range(8)]
    outs = small.generate([f"Steps {i} as JSON:" for i in range(8)], params, use_tqdm=False)
    st = small.stats()
    assert st["num_preemptions"] > 0
    _assert_all_valid(outs, params)
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_bad_inputs_are_clear_errors_and_the_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="exactly one of"):
        SO(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        SO()
    with pytest.raises(ValueError, match="not valid JSON"):
        SO(json="{nope")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        SO(choice=[])
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})
    for bad, needle in ((SO(regex="a(b"), "regex is invalid"), (SO(json={"type": "objectx"}), "json is invalid"),
                        (SO(grammar="root ::= missing"), "grammar is invalid")):
        with pytest.raises(ValueError, match=needle):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, structured_outputs=SO(choice=["hi", "yo"])),
                       use_tqdm=False)[0]
    assert out.outputs[0].text in ("hi", "yo")
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_grammar_that_cannot_finish_ends_with_length(llm):
    out = llm.generate(["Digits:"], SamplingParams(temperature=0, max_tokens=8,
                                                    structured_outputs=SO(regex=r"[0-9]{50}")), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 8 and c.text.isdigit()
    # ignore_eos cannot push a finished grammar past its end.
    out = llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  structured_outputs=SO(choice=["alpha", "beta"])), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text.rstrip("<|im_end|>") in ("alpha", "beta")


@contextlib.contextmanager
def compiles_held(engine):
    """The engine's grammar compiles wait for the yielded event (set, and the backend restored, on exit)."""
    backend = engine.structured_output.backend
    real_compile = backend.compile
    release = threading.Event()
    backend.compile = lambda built: (release.wait(30), real_compile(built))[1]
    try:
        yield release
    finally:
        backend.compile = real_compile
        release.set()


def step_until(engine, finished: dict, done, seconds: float = 60.0) -> None:
    """Step the engine until `done()` (or `seconds` pass), keeping finished outputs by request id."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out


@pytest.mark.parametrize("mode", ["prefill", "wait", "defer"])
def test_compiling_request_waits_without_stalling_others(llm, mode, monkeypatch):
    """While a new grammar compiles (slowed down here), other requests keep decoding; the constrained one's
    prompt runs meanwhile up to its last token (prefill: the GPU engine's default), or not at all (wait: a CPU
    engine's, for a long prompt), or whole with its last logits row kept (defer: a CPU engine's, for a short
    prompt); it samples only once its grammar is ready, and a deferred first token is the one the request gets
    when its grammar is already compiled."""
    engine = llm.llm_engine
    assert engine._prefill_while_compiling == (engine.executor.device.type != "cpu")
    prefill_while_compiling = mode == "prefill"
    monkeypatch.setattr(engine, "_prefill_while_compiling", prefill_while_compiling)
    monkeypatch.setattr(engine, "_defer_sample_max_prompt", 64 if mode == "defer" else 0)
    threads = torch.get_num_threads()
    finished: dict[str, object] = {}
    with compiles_held(engine) as release:
        engine.add_request("plain", "Tell me a story", SamplingParams(temperature=0, max_tokens=12))
        prompt = "Answer in JSON whether you had to wait for the grammar to compile. JSON:"
        key = f"waited_{mode}"  # a schema of its own per run: not cached
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(
            json={"type": "object", "properties": {key: {"type": "boolean"}}, "required": [key]}))
        group = engine.add_request("json", prompt, params)
        step_until(engine, finished, lambda: "plain" in finished)
        assert "json" not in finished and any(g.request_id == "json" for g in engine._awaiting_grammar)
        seq = group.seqs[0]
        n_prompt = len(seq.prompt_token_ids)
        assert seq.num_computed_tokens == {"prefill": n_prompt - 1, "wait": 0, "defer": n_prompt}[mode]
        assert ("held_logits" in group.extra) == (mode == "defer")
        assert not seq.output_token_ids
        assert engine.get_num_unfinished_requests() == 1
        # A CPU engine's forward pass leaves a core to the compile thread meanwhile, and takes it back after.
        on_cpu = engine.executor.device.type == "cpu"
        assert torch.get_num_threads() == (max(1, threads - 1) if on_cpu else threads)
        release.set()
        step_until(engine, finished, lambda: "json" in finished)
    assert json.loads(finished["json"].outputs[0].text) in ({key: True}, {key: False})
    assert torch.get_num_threads() == threads
    again = llm.generate([prompt], params, use_tqdm=False)[0]  # the grammar is cached now: sampled in its step
    assert again.outputs[0].token_ids == finished["json"].outputs[0].token_ids
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks


def test_a_deferred_first_sample_forks_and_draws_as_an_immediate_one(llm, monkeypatch):
    """n = 3 seeded samples of a short prompt whose grammar compiled while its prompt ran whole: the first
    tokens come from the kept logits row (three forks), and every output equals the one the same request
    gets once the grammar is cached (sampled in the prompt's own step)."""
    engine = llm.llm_engine
    monkeypatch.setattr(engine, "_prefill_while_compiling", False)
    monkeypatch.setattr(engine, "_defer_sample_max_prompt", 64)
    schema = {"type": "object", "properties": {"forked": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["forked"]}
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=24, structured_outputs=SO(json=schema))
    finished: dict[str, object] = {}
    with compiles_held(engine) as release:
        group = engine.add_request("forks", "Pick a number as JSON:", params)
        engine.step()
        assert "held_logits" in group.extra and not group.seqs[0].output_token_ids
        release.set()
        step_until(engine, finished, lambda: "forks" in finished)
    done = finished["forks"]
    again = llm.generate(["Pick a number as JSON:"], params, use_tqdm=False)[0]
    assert len(done.outputs) == 3
    for c in done.outputs:
        jsonschema.validate(json.loads(c.text), schema)
    assert [c.token_ids for c in done.outputs] == [c.token_ids for c in again.outputs]
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_deferred_request_preempted_before_its_grammar_is_ready_samples_in_a_step_of_its_own(preemption_mode):
    """A short constrained prompt ran whole while its grammar compiled, then lost its place to older requests
    (recompute or swap) before the grammar was ready: the kept logits are dropped, its last prompt token runs
    again once it is back, and that step samples; the output is the one it gets with the grammar cached."""
    small = LLM(num_gpu_blocks_override=8, max_model_len=256, preemption_mode=preemption_mode, swap_space=0.05)
    engine = small.llm_engine
    if engine._prefill_while_compiling:
        pytest.skip("a CPU engine's path")
    schema = {"type": "object", "properties": {"preempted": {"type": "boolean"}}, "required": ["preempted"]}
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(json=schema))
    long = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    finished: dict[str, object] = {}
    with compiles_held(engine) as release:
        engine.add_request("a", "Write a long story about a lighthouse keeper.", long)
        engine.add_request("b", "Write a long story about a mountain village.", long)
        group = engine.add_request("json", "JSON:", params)
        seq = group.seqs[0]
        for _ in range(200):
            engine.step()
            if "held_logits" in group.extra and seq.status != SequenceStatus.RUNNING:
                break
        assert "held_logits" in group.extra and seq.status != SequenceStatus.RUNNING  # held, then preempted
        release.set()
        group.extra["grammar_future"].result(timeout=60)  # ready while it is out: the next step finds it so
        engine.step()
        assert "held_logits" not in group.extra and not seq.output_token_ids
        step_until(engine, finished, lambda: not engine.has_unfinished_requests(), 120)
    assert set(finished) == {"a", "b", "json"}
    again = small.generate(["JSON:"], params, use_tqdm=False)[0]
    assert finished["json"].outputs[0].token_ids == again.outputs[0].token_ids
    jsonschema.validate(json.loads(again.outputs[0].text), schema)
    st = small.stats()
    assert st["num_preemptions"] > 0 and st["kv_blocks_free"] == st["kv_blocks_total"]


@pytest.mark.parametrize("mode", ["prefill", "defer"])
def test_aborting_a_request_whose_grammar_compiles_frees_its_prompt(llm, mode, monkeypatch):
    """Aborted while its grammar compiles and its prompt has run (to its last token, or whole with its logits
    kept): its blocks come back, nothing is left over, and the compile finishing later changes nothing."""
    engine = llm.llm_engine
    monkeypatch.setattr(engine, "_prefill_while_compiling", mode == "prefill")
    monkeypatch.setattr(engine, "_defer_sample_max_prompt", 64)
    with compiles_held(engine) as release:
        group = engine.add_request("doomed", "Describe a cat in JSON, with its name and age. JSON:", SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=SO(json={"type": "object", "properties": {
                f"aborted_{mode}": {"type": "integer"}}, "required": [f"aborted_{mode}"]})))
        for _ in range(3):
            engine.step()
        assert group.defer_sample == ("held_logits" in group.extra) == (mode == "defer")
        assert group.seqs[0].num_computed_tokens > 0 and llm.stats()["kv_blocks_free"] < llm.stats()["kv_blocks_total"]
        engine.abort_request("doomed")
        release.set()
        time.sleep(0.2)
        engine.step()
        assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
        assert group.is_finished() and not engine._awaiting_grammar
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_a_lone_held_prompt_waits_for_its_grammar_instead_of_spinning(llm, monkeypatch):
    """When the only work left is a prompt held at its last token, a step blocks on the compile (as with no work
    at all) instead of returning at once, so the step loop does not spin against the compile thread."""
    import pagedllm.engine.llm_engine as engine_module

    engine = llm.llm_engine
    monkeypatch.setattr(engine, "_prefill_while_compiling", True)
    waits = []
    real_wait = engine_module.wait_futures
    monkeypatch.setattr(engine_module, "wait_futures", lambda *a, **k: (waits.append(1), real_wait(*a, **k))[1])
    with compiles_held(engine) as release:
        group = engine.add_request("lone", "Give me a JSON object with a single flag in it. JSON:", SamplingParams(
            temperature=0, max_tokens=10, structured_outputs=SO(json={"type": "object", "properties": {
                "lone": {"type": "boolean"}}, "required": ["lone"]})))
        engine.step()  # the prompt's first part runs: no wait
        seq = group.seqs[0]
        assert seq.num_computed_tokens == len(seq.prompt_token_ids) - 1 and not waits
        for _ in range(4):  # (with asynchronous scheduling the first of them completes the step in flight)
            engine.step()
        assert len(waits) >= 3 and not seq.output_token_ids
        release.set()
        while engine.has_unfinished_requests():
            engine.step()
    text = engine.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    assert json.loads(text) in ({"lone": True}, {"lone": False})


@pytest.mark.parametrize("prefill_while_compiling", [True, False], ids=["prefill", "wait"])
def test_failed_compile_aborts_the_request_also_from_the_cache(llm, monkeypatch, prefill_while_compiling):
    """A grammar whose compile fails (after its schema validated) ends its request as aborted, and so does a
    later request with the same schema, which finds the failed compile in the cache; other requests finish, and
    the blocks of a prompt that ran meanwhile come back."""
    engine = llm.llm_engine
    monkeypatch.setattr(engine, "_prefill_while_compiling", prefill_while_compiling)
    backend = engine.structured_output.backend
    real_compile = backend.compile

    def failing_compile(built):
        if "doomed" in str(built):
            time.sleep(0.2)  # steps run meanwhile (with prefill_while_compiling, the prompt's)
            raise RuntimeError("compile failed on purpose")
        return real_compile(built)

    monkeypatch.setattr(backend, "compile", failing_compile)
    name = f"doomed_{prefill_while_compiling}"  # a schema of its own per run (a failed compile stays cached)
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    doomed = SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(json=schema))
    prompt = "Describe today's weather as a JSON object. JSON:"
    first = llm.generate([prompt], doomed, use_tqdm=False)[0]
    assert first.outputs[0].finish_reason == "abort" and not first.outputs[0].token_ids
    outs = llm.generate([prompt, "Hello"], [doomed, SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert len(outs[1].outputs[0].token_ids) == 5
    st = llm.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_llguidance_backend():
    """The other grammar engine (the default, "auto", is xgrammar)."""
    pytest.importorskip("llguidance")  # the optional engine: the rest of this file runs without it
    g = LLM(num_gpu_blocks_override=128, max_model_len=512, structured_outputs_backend="guidance")
    assert g.llm_engine.structured_output.backend_name == "guidance"
    prompts, params = _schema_batch(1)
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    params = params[:4] + [SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs=SO(regex=r"[a-c]{3}-\d\d")),
                           SamplingParams(temperature=0.8, seed=2, max_tokens=40, structured_outputs=SO(grammar=grammar))]
    outs = g.generate(prompts[:4] + ["x", "Sum:"], params, use_tqdm=False)
    _assert_all_valid(outs[:4], params[:4])
    assert re.fullmatch(r"[a-c]{3}-\d\d", outs[4].outputs[0].text)
    c = outs[5].outputs[0]
    assert c.finish_reason == "length" or re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", c.text), c.text
    with pytest.raises(ValueError, match="grammar is invalid"):
        g.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=SO(grammar="root ::= missing")), use_tqdm=False)


def test_grammar_caches_stay_bounded(llm, monkeypatch):
    """Every distinct schema a client sends is a cache key: compiled grammars and their compile times keep
    only the most recent CACHE_SIZE (a server fed unique schemas must not grow without bound)."""
    from pagedllm.structured_output import manager as manager_mod

    monkeypatch.setattr(manager_mod, "CACHE_SIZE", 3)
    mgr = llm.llm_engine.structured_output
    for i in range(6):
        mgr.request(SO(regex=f"bounded{i}[a-z]")).result(timeout=60)
    assert len(mgr._cache) <= 3 and len(mgr.compile_seconds) <= 3
    assert mgr.cache_key(SO(regex="bounded5[a-z]")) in mgr.compile_seconds


def test_constrained_steps_pipeline_under_async_scheduling():
    """With asynchronous scheduling, a constrained step's forward pass is launched before the previous step's
    tokens reach the host (its masks are filled once they have): constrained steps stay in flight, and
    outputs (seeded sampling, mixed constrained/unconstrained batches, n > 1, a grammar that ends a sequence
    one step before its twin) equal the synchronous engine's token for token."""
    kw = dict(num_gpu_blocks_override=256, max_num_seqs=16, max_model_len=1024)
    sync, asy = LLM(async_scheduling=False, **kw), LLM(async_scheduling=True, **kw)
    schemas = [SCHEMAS[0], SCHEMAS[2], SCHEMAS[9]]
    prompts = [f"Reply with JSON {i}:" for i in range(6)] + ["Pick one:", "Once upon a time", "A phone number:"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens_for(schemas[i % 3]),
                             n=2 if i == 4 else 1, structured_outputs=SO(json=schemas[i % 3])) for i in range(6)]
    params += [SamplingParams(temperature=0, max_tokens=6, structured_outputs=SO(choice=["yes", "no", "maybe"])),
               SamplingParams(temperature=0.8, seed=9, max_tokens=24),
               SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                              structured_outputs=SO(regex=r"(\+33|0)[1-9]( \d\d){4}"))]
    want = sync.generate(prompts, params, use_tqdm=False)
    got = asy.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert [c.token_ids for c in w.outputs] == [c.token_ids for c in g.outputs], w.request_id
        assert [c.finish_reason for c in w.outputs] == [c.finish_reason for c in g.outputs]
    _assert_all_valid(got[:6], params[:6])
    engine = asy.llm_engine
    engine.add_request("c0", "JSON:", SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=SCHEMAS[0])))
    engine.step()  # the prompt ran; its first token is still on the device
    assert engine._inflight is not None and engine._inflight.mask_rows == [0]
    engine.step()  # the first decode was launched before that token reached the host
    assert engine._inflight is not None
    while engine.has_unfinished_requests():
        engine.step()
    for llm in (sync, asy):
        st = llm.stats()
        assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_llguidance_sees_the_exact_token_bytes(llm):
    """llguidance's token table is built from each token's exact bytes (not by re-parsing the tokenizer's
    JSON, which gave wrong masks under another transformers version): text round-trips byte for byte through
    it, and the chat template's special tokens are special (never matched as literal text)."""
    pytest.importorskip("llguidance")
    from pagedllm.structured_output.backends import GuidanceBackend

    eng = llm.llm_engine
    backend = GuidanceBackend(eng.tokenizer, int(eng.hf_config.vocab_size), eng.eos_token_ids, num_threads=1)
    text = 'Hello\n  world {"a": [1, 2.5e-3], "é": "\\n"}\t ok'
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    assert backend._tok.decode_bytes(ids) == text.encode("utf-8")
    specials = [eng.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    assert all(backend._tok.is_special_token(i) for i in specials)
    assert not backend._tok.is_special_token(ids[0])
