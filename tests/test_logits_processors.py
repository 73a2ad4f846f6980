"""Custom logits processors (pagedllm/logits_processor.py, vLLM's V1 programming model): the persistent batch's
updates and row order, processors on the bundled model next to requests that use none, vLLM V0-style per-request
callables through AdapterLogitsProcessor, params refused at arrival, and the flag through a real server."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import httpx
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.logits_processor import (STR_SPEC_DEC_REJECTS_LOGITSPROCS, BatchUpdate, LogitsProcessor,
                                       LogitsProcessorBatch, LogitsRow, MoveDirectionality,
                                       process_dict_updates, resolve_logits_processor_classes)

sys.path.insert(0, str(Path(__file__).parent))
from logits_processor_examples import NoRepeatLogitsProcessor, TargetTokenLogitsProcessor  # noqa: E402

KW = dict(max_model_len=256, num_gpu_blocks_override=64)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


class IndexCheckingProcessor(LogitsProcessor):
    """Follows the batch through its updates and checks, in apply, that row i is the request it holds at i
    (each row's column 0 carries its sequence id); writes its index into column 1."""

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.at: dict[int, int] = {}  # index -> seq id (from the added params' extra_args)
        self.updates = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.updates += 1
        for index in batch_update.removed:
            self.at.pop(index)
        for index, params, _, _ in batch_update.added:
            self.at[index] = params.extra_args["seq"]
        for a, b, direction in batch_update.moved:
            assert direction == MoveDirectionality.UNIDIRECTIONAL
            self.at[b] = self.at.pop(a)
        assert sorted(self.at) == list(range(batch_update.batch_size))  # dense

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert [int(v) for v in logits[:, 0]] == [self.at[i] for i in range(logits.shape[0])]
        logits[:, 1] = torch.arange(logits.shape[0], dtype=logits.dtype)
        return logits


def test_persistent_batch_updates_and_row_order():
    """Fifty steps of sequences joining and leaving in random order: every processor sees a dense batch whose row
    i is the sequence its updates put at i, and the engine gets each row back where it was."""
    batch = LogitsProcessorBatch([IndexCheckingProcessor], None, torch.device("cpu"))
    rng = random.Random(0)
    live: list[int] = []
    next_id = 0
    for _ in range(50):
        live = [s for s in live if rng.random() > 0.2]
        for _ in range(rng.randint(0, 4)):
            live.append(next_id)
            next_id += 1
        rng.shuffle(live)  # the step's own row order
        rows = [LogitsRow(s, SamplingParams(extra_args={"seq": s}), [1], []) for s in live]
        logits = torch.zeros(len(rows), 8)
        logits[:, 0] = torch.tensor(live, dtype=torch.float32)
        out = batch.apply(logits, rows, all_greedy=False)
        assert [int(v) for v in out[:, 0]] == live
        proc = batch.processors[0]
        assert [proc.at[int(i)] for i in out[:, 1]] == live
    assert batch.processors[0].updates > 10


def test_process_dict_updates_order_and_swaps():
    """vLLM's helper: removed, then added (None: the processor leaves the row alone), then moved; a swap trades
    the two rows' states, a one-way move empties its source."""
    state = {0: "a", 1: "b", 2: "c"}
    p = SamplingParams()
    update = BatchUpdate(3, removed=[1], added=[(1, p, None, []), (3, p, None, [])],
                         moved=[(0, 2, MoveDirectionality.SWAP), (3, 1, MoveDirectionality.UNIDIRECTIONAL)])
    fresh = iter(["new1", None])
    assert process_dict_updates(state, update, lambda *_: next(fresh))
    assert state == {0: "c", 2: "a"}  # row 1's new request was replaced by row 3's, which had no state
    assert not process_dict_updates(state, None, lambda *_: None)


def _outputs(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_target_token_only_for_the_requests_that_ask():
    """vLLM's DummyLogitsProcessor: requests with extra_args target_token generate only it; the others are the
    tokens of an engine without processors; the pool is whole after."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = _outputs(LLM(**KW), [greedy] * 4)
    llm = LLM(logits_processors=[TargetTokenLogitsProcessor], **KW)
    target = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, extra_args={"target_token": 42})
    got = _outputs(llm, [target, greedy, target, greedy])
    assert got[0] == got[2] == [42] * 10
    assert got[1] == ref[1] and got[3] == ref[3]
    # sampled rows and parallel samples too
    sampled = SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=6, extra_args={"target_token": 7})
    outs = llm.generate(PROMPTS[:1], sampled, use_tqdm=False)[0].outputs
    assert [list(c.token_ids) for c in outs] == [[7] * 6] * 3
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 64


def test_logprobs_are_the_raw_logits_ones():
    """As vLLM's default (raw_logprobs): a forced row reports its token's log-prob under the model's own
    distribution (not 0.0, the processed one) and the model's top tokens; an untouched row's equal an engine's
    without processors."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    ref = LLM(**KW).generate(PROMPTS[:2], params, use_tqdm=False)
    llm = LLM(logits_processors=[TargetTokenLogitsProcessor], **KW)
    forced = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, extra_args={"target_token": 42})
    got = llm.generate(PROMPTS[:2], [forced, params], use_tqdm=False)
    first = got[0].outputs[0].logprobs[0]
    assert first[42].logprob < -1.0 and first[42].rank > 1
    assert {t for t, lp in first.items() if lp.rank <= 3} == {t for t, lp in ref[0].outputs[0].logprobs[0].items()
                                                              if lp.rank <= 3}
    for a, b in zip(got[1].outputs[0].logprobs, ref[1].outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_v0_style_callables_through_the_adapter():
    """AdapterLogitsProcessor: two- and three-argument callables see the live output tokens; requests without
    the argument keep their reference tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = _outputs(LLM(**KW), [greedy] * 4)
    llm = LLM(logits_processors=["logits_processor_examples:NoRepeatLogitsProcessor"], **KW)
    no_repeat = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, extra_args={"no_repeat": True})
    no_prompt_end = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                   extra_args={"no_repeat": "prompt"})
    got = _outputs(llm, [no_repeat, greedy, no_prompt_end, no_repeat])
    prompt_end = llm.get_tokenizer().encode(PROMPTS[2])[-1]
    for out in (got[0], got[2], got[3]):
        assert all(a != b for a, b in zip(out, out[1:])), out
    assert prompt_end not in got[2]
    assert got[1] == ref[1]
    assert ref[3] != got[3] or all(a != b for a, b in zip(ref[3], ref[3][1:]))
    assert isinstance(llm.llm_engine.logits_processors.processors[0], NoRepeatLogitsProcessor)


def test_params_a_processor_refuses_leave_the_engine_serving():
    llm = LLM(logits_processors=[TargetTokenLogitsProcessor], **KW)
    bad = SamplingParams(max_tokens=4, extra_args={"target_token": "x"})
    with pytest.raises(ValueError, match="target_token must be a token id"):
        llm.generate(PROMPTS[:1], bad, use_tqdm=False)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, extra_args={"target_token": 3}),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == [3] * 4
    assert llm.llm_engine.scheduler.block_manager.get_num_free_gpu_blocks() == 64


def test_configuration_errors():
    assert resolve_logits_processor_classes(["logits_processor_examples.TargetTokenLogitsProcessor"]) == (
        TargetTokenLogitsProcessor,)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_logits_processor_classes(["no_such_module:Thing"])
    with pytest.raises(ValueError, match="has no 'Nope'"):
        resolve_logits_processor_classes(["logits_processor_examples:Nope"])
    with pytest.raises(ValueError, match="is not a subclass of pagedllm.logits_processor.LogitsProcessor"):
        resolve_logits_processor_classes([dict])
    with pytest.raises(ValueError, match=STR_SPEC_DEC_REJECTS_LOGITSPROCS):
        EngineArgs(logits_processors=[TargetTokenLogitsProcessor],
                   speculative_config={"method": "ngram"}).create_engine_config(256)
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=["x"])
    import argparse

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--logits-processors", "a.b:C", "d.e:F"])
    assert EngineArgs.from_cli_args(args).logits_processors == ["a.b:C", "d.e:F"]


@pytest.mark.slow
def test_server_passes_vllm_xargs_to_the_processor():
    """`pagedllm serve --logits-processors module:Class`: vllm_xargs reach the processor; params it refuses are a
    400 naming what is wrong, and the server keeps serving."""
    from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer

    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": tests_dir + ":" + ":".join(p for p in sys.path if p)}
    server = RemoteServer([*SMALL_SERVER_ARGS, "--logits-processors",
                           "logits_processor_examples:TargetTokenLogitsProcessor"], env=env)
    try:
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(server.url("/v1/completions"), json={**body, "vllm_xargs": {"target_token": 28}},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == [28] * 5
        r = httpx.post(server.url("/v1/completions"), json={**body, "vllm_xargs": {"target_token": -1}}, timeout=60)
        assert r.status_code == 400 and "target_token must be a token id" in r.text
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] != [28] * 5
    finally:
        server.stop()


@pytest.mark.cuda
def test_cuda_processors_on_graph_replayed_steps(tmp_path):
    """On CUDA (a random bf16 Llama, decode steps from CUDA graphs, asynchronous scheduling): the processor's rows
    take its token, the other rows keep an engine's without processors, and no kernel is built after the warm
    start."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path)
    kw = dict(model=str(tmp_path), skip_tokenizer_init=True, device="cuda", dtype="bfloat16", **KW)
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [list(o.outputs[0].token_ids) for o in LLM(**kw).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(logits_processors=[TargetTokenLogitsProcessor], **kw)
    target = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, extra_args={"target_token": 5})
    outs = llm.generate(prompts, [target if i % 2 else greedy for i in range(6)], use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert [got[i] for i in (1, 3, 5)] == [[5] * 12] * 3
    assert [got[i] for i in (0, 2, 4)] == [ref[i] for i in (0, 2, 4)]
    assert llm.llm_engine.executor.driver_worker.model_runner.graph_runner is not None
    assert not llm.llm_engine.executor.driver_worker.model_runner.compile_watch.events
