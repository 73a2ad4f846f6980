"""vLLM's reward models: `Qwen2ForRewardModel` (per-token rewards, ALL pooling) and `Qwen2ForProcessRewardModel`
(STEP pooling: the rows of the step-tag tokens, in `returned_token_ids` columns, softmaxed), `LLM.reward` /
`LLM.encode`, `POST /pooling`, and the errors of STEP's settings.

transformers has no such classes, so the reference is built here: a random 2-layer `transformers.Qwen2Model` and a
random `score` head (Linear → ReLU → Linear, with biases), saved under the checkpoint names vLLM loads (`model.*`,
`score.0.*`, `score.2.*`); pagedllm's rows must equal `head(Qwen2Model(ids).last_hidden_state)` in float32. Prompts
of different lengths run in one batch with a step budget smaller than the longest (rows gathered across chunks).
`convert="reward"` (vLLM's as_reward_model) on a random transformers LlamaForCausalLM: its rows are
`model.model(ids).last_hidden_state` (ALL, or STEP's rows and columns)."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from pagedllm import LLM, PoolingParams
from pagedllm.config import PoolerConfig
from test_classify_score import COMMON, TEXTS, save_model  # noqa: E402
from test_token_pooling import ENGINE_KW, _assert_idle  # noqa: E402

TAG = 1234  # the step tag of the process reward model's prompts (Qwen2.5-Math-PRM's is <extra_0>, 151651)


def save_reward_model(path: Path, tokenizer_dir: Path, arch: str, num_labels: int | None):
    """A random Qwen2 decoder and reward head saved as `arch` (config `num_labels` left out when None: transformers'
    default, 2) with the bundled tokenizer → (decoder, head, tokenizer)."""
    import safetensors.torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    extra = {} if num_labels is None else {"num_labels": num_labels}
    cfg = transformers.Qwen2Config(vocab_size=len(tok), **COMMON, **extra)
    torch.manual_seed(0)
    decoder = transformers.Qwen2Model(cfg)
    head = nn.Sequential(nn.Linear(cfg.hidden_size, cfg.hidden_size), nn.ReLU(),
                         nn.Linear(cfg.hidden_size, 1 if arch == "Qwen2ForRewardModel" else 2))
    for name, p in decoder.named_parameters():
        p.data.normal_(1.0, 0.1) if name.endswith("norm.weight") else p.data.normal_(0, 0.08)
    for p in head.parameters():
        p.data.normal_(0, 0.3)  # a wide head: probabilities far from uniform
    decoder, head = decoder.float().eval(), head.float().eval()
    cfg.architectures = [arch]
    cfg.save_pretrained(path)
    tensors = {f"model.{k}": v for k, v in decoder.state_dict().items()}
    tensors.update({f"score.{k}": v for k, v in head.state_dict().items()})
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return decoder, head, tok


def reference(decoder, head, ids: list[int]) -> torch.Tensor:
    """The head's raw outputs at every token [len(ids), num_labels]."""
    with torch.no_grad():
        return head(decoder(input_ids=torch.tensor([ids])).last_hidden_state[0])


def step_prompts(vocab: int) -> list[list[int]]:
    """Token-id prompts of 5 to ~90 tokens: the step tag several times in some, once in one, never in one."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return [t for t in torch.randint(0, vocab, (n,), generator=g).tolist() if t != TAG]

    steps = [ids(20) + [TAG] for _ in range(4)]
    return [sum(steps, []), ids(12) + [TAG] + ids(9) + [TAG], ids(5), ids(7) + [TAG] + ids(3)]


@pytest.fixture(scope="module")
def prm(tmp_path_factory, default_model_dir: Path):
    path = tmp_path_factory.mktemp("prm")
    decoder, head, tok = save_reward_model(path, default_model_dir, "Qwen2ForProcessRewardModel", 2)
    return path, decoder, head, tok


def test_reward_model_per_token_rewards(tmp_path: Path, default_model_dir: Path) -> None:
    """Qwen2ForRewardModel: runner auto → pooling, task token_classify, pooler ALL with the activation off (vLLM's
    defaults), one raw reward per token (its config's num_labels, transformers' default 2, does not count);
    `reward` = `encode(pooling_task="token_classify")` = `encode()`; activation=True → sigmoid (one value)."""
    decoder, head, _ = save_reward_model(tmp_path, default_model_dir, "Qwen2ForRewardModel", None)
    llm = LLM(str(tmp_path), **ENGINE_KW, enable_prefix_caching=True)
    mc = llm.llm_engine.config.model_config
    assert (llm.llm_engine.runner, mc.pooling_task) == ("pooling", "token_classify")
    assert (mc.pooler_config.pooling_type, mc.pooler_config.activation) == ("ALL", False)
    outs = llm.reward(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > ENGINE_KW["max_num_batched_tokens"]
    for out in outs:
        assert out.outputs.data.shape == (len(out.prompt_token_ids), 1)
        torch.testing.assert_close(out.outputs.data, reference(decoder, head, out.prompt_token_ids), atol=1e-5,
                                   rtol=0)
    for other in (llm.encode(TEXTS, use_tqdm=False), llm.encode(TEXTS, use_tqdm=False, pooling_task="token_classify")):
        for a, b in zip(outs, other):
            torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=0, rtol=0)
    on = llm.reward(TEXTS[0], pooling_params=PoolingParams(activation=True), use_tqdm=False)[0]
    torch.testing.assert_close(on.outputs.data, outs[0].outputs.data.sigmoid(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="step_tag_id applies to STEP pooling.*pools ALL"):
        llm.reward("hi", pooling_params=PoolingParams(step_tag_id=5))
    with pytest.raises(ValueError, match="token classifier.*LLM.reward"):
        llm.embed("hi")
    _assert_idle(llm)
    with pytest.raises(ValueError, match="step_tag_id applies to pooling_type 'STEP' only.*'ALL'"):
        LLM(str(tmp_path), **ENGINE_KW, pooler_config={"step_tag_id": 5})
    with pytest.raises(ValueError, match=r"returned_token_ids \[1\] are out of range.*1 values per token"):
        LLM(str(tmp_path), **ENGINE_KW, pooler_config={"pooling_type": "STEP", "returned_token_ids": [0, 1]})
    with pytest.raises(ValueError, match="pooling_type 'ALL' only.*or 'STEP'"):
        LLM(str(tmp_path), **ENGINE_KW, pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="STEP.*this one is Qwen2ForRewardModel, served as an embedding model"):
        LLM(str(tmp_path), **ENGINE_KW, convert="embed", pooler_config={"pooling_type": "STEP"})


def test_process_reward_model_step_pooling(prm) -> None:
    """Qwen2ForProcessRewardModel: STEP pooling by default; each prompt's rows at its step tags, softmaxed (an
    empty [0, 2] tensor for a prompt without one, as vLLM); a request's returned_token_ids (one column: sigmoid,
    as vLLM picks by width), step_tag_id and activation=False; prefix caching asked for, chunked steps."""
    path, decoder, head, tok = prm
    prompts = step_prompts(len(tok))
    llm = LLM(str(path), **ENGINE_KW, enable_prefix_caching=True,
              pooler_config=PoolerConfig(pooling_type="STEP", step_tag_id=TAG))
    pooler = llm.llm_engine.config.model_config.pooler_config
    assert (pooler.pooling_type, pooler.step_tag_id, pooler.returned_token_ids) == ("STEP", TAG, None)
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.reward(token_prompts, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        ref = reference(decoder, head, ids)[torch.tensor(ids) == TAG]
        assert out.outputs.data.shape == (ids.count(TAG), 2)
        torch.testing.assert_close(out.outputs.data, ref.softmax(-1), atol=1e-5, rtol=0)
    assert [len(o.outputs.data) for o in outs] == [4, 2, 0, 1]
    for a, b in zip(outs, llm.encode(token_prompts, use_tqdm=False)):
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=0, rtol=0)
    other_tag = prompts[0][3]
    variants = [PoolingParams(returned_token_ids=[1]), PoolingParams(returned_token_ids=[1, 0], activation=False),
                PoolingParams(step_tag_id=other_tag)]
    got = llm.reward([token_prompts[1]] * 2 + [token_prompts[0]], pooling_params=variants, use_tqdm=False)
    ref1 = reference(decoder, head, prompts[1])[torch.tensor(prompts[1]) == TAG]
    torch.testing.assert_close(got[0].outputs.data, ref1[:, [1]].sigmoid(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1].outputs.data, ref1[:, [1, 0]], atol=1e-5, rtol=0)
    ref0 = reference(decoder, head, prompts[0])[torch.tensor(prompts[0]) == other_tag]
    torch.testing.assert_close(got[2].outputs.data, ref0.softmax(-1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"returned_token_ids \[2\] are out of range.*columns 0 to 1"):
        llm.reward("hi", pooling_params=PoolingParams(returned_token_ids=[0, 2]))
    with pytest.raises(ValueError, match="step_tag_id=999999 is not a token of this model's vocabulary"):
        llm.reward("hi", pooling_params=PoolingParams(step_tag_id=999999))
    _assert_idle(llm)


def test_process_reward_model_pooler_settings(prm, default_model_dir: Path) -> None:
    """vLLM's default step tag (151651) is outside this tiny vocabulary: a clear error, not empty results; ALL on a
    PRM drops that default (every token's softmax); STEP on a model without per-token classifier outputs, and
    malformed settings, are refused naming what is allowed."""
    path, decoder, head, tok = prm
    with pytest.raises(ValueError, match="pooler_config step_tag_id=151651 is not a token"):
        LLM(str(path), **ENGINE_KW)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=16, pooler_config=json.dumps({"pooling_type": "ALL"}))
    assert llm.llm_engine.config.model_config.pooler_config.step_tag_id is None
    out = llm.reward(TEXTS[0], use_tqdm=False)[0]
    torch.testing.assert_close(out.outputs.data, reference(decoder, head, out.prompt_token_ids).softmax(-1),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="returned_token_ids applies to STEP pooling"):
        llm.reward("hi", pooling_params=PoolingParams(returned_token_ids=[0]))
    _assert_idle(llm)
    with pytest.raises(ValueError, match="pooling_type='STEP'.*LlamaForCausalLM, served as an embedding model"):
        LLM(str(default_model_dir), runner="pooling", pooler_config={"pooling_type": "STEP", "step_tag_id": 1})
    for bad, match in (({"step_tag_id": -1}, "step_tag_id must be a token id"),
                       ({"returned_token_ids": "0,1"}, "returned_token_ids must be a list"),
                       ({"pooling_type": "STEPS"}, "pooling_type must be one of.*'STEP'")):
        with pytest.raises(ValueError, match=match):
            PoolerConfig(**bad)
    with pytest.raises(ValueError, match="step_tag_id must be a token id"):
        PoolingParams(step_tag_id=True)


def test_step_rows_kept_once_across_chunks_and_recompute() -> None:
    """STEP keeps each step-tag row once when chunks repeat after a preemption by recompute, in position order."""
    from pagedllm.engine.pooling import PoolingState

    ids = [7, TAG, 3, TAG, TAG, 9, 1, TAG, 2, 5]
    rows = torch.randn(10, 3)
    pooler = PoolerConfig("STEP", activation=False, step_tag_id=TAG, returned_token_ids=[2, 0])
    state = PoolingState.of(PoolingParams(), pooler, num_labels=3, token_ids=ids)
    assert state.wants_every_row and state.activation is None
    state.add_rows(0, rows[:4])
    state.add_rows(0, rows[:6])  # recomputed after a preemption, one chunk further
    state.add_rows(6, rows[6:])
    torch.testing.assert_close(state.finish(rows[-1], 10), rows[[1, 3, 4, 7]][:, [2, 0]])
    none = PoolingState.of(PoolingParams(task="token_classify"), pooler, num_labels=3, token_ids=[1, 2])
    none.add_rows(0, rows[:2])
    assert none.finish(rows[1], 2).shape == (0, 2)


def test_server_pooling_route_step_rewards(prm) -> None:
    """One server of the PRM (--pooler-config sets the step tag): POST /pooling's step rows equal the reference's,
    one list per step tag ([] for a prompt without one); the pool is whole afterwards."""
    from conftest_server import RemoteServer

    path, decoder, head, tok = prm
    prompts = step_prompts(len(tok))
    server = RemoteServer(["--model", str(path), "--served-model-name", "prm", "--num-gpu-blocks-override", "64",
                           "--max-model-len", "256", "--max-num-batched-tokens", "32", "--dtype", "float32",
                           "--no-dashboard", "--pooler-config", json.dumps({"step_tag_id": TAG})])
    try:
        r = httpx.post(server.url("/pooling"), json={"model": "prm", "input": prompts}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
        for ids, item in zip(prompts, body["data"]):
            ref = reference(decoder, head, ids)[torch.tensor(ids) == TAG].softmax(-1)
            assert len(item["data"]) == ids.count(TAG)
            if ref.numel():
                torch.testing.assert_close(torch.tensor(item["data"]), ref, atol=1e-5, rtol=0)
        bad = httpx.post(server.url("/pooling"), json={"model": "prm", "input": "hi", "task": "embed"}, timeout=60)
        assert bad.status_code == 400 and "token classifier" in bad.json()["error"]["message"], bad.text
        m = server.wait_idle()
        assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.logs()[-3000:]


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory, default_model_dir: Path):
    """A random 2-layer transformers LlamaForCausalLM (the bundled tokenizer) → (its path, model, tokenizer)."""
    path = tmp_path_factory.mktemp("causal_lm")
    hf, tok = save_model(path, default_model_dir, causal=True)
    return path, hf, tok


def hidden_states(hf, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (LlamaModel's last_hidden_state: after the final norm) [len(ids), hidden]."""
    with torch.no_grad():
        return hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def test_convert_reward_per_token_hidden_states(causal_lm) -> None:
    """convert='reward' on a *ForCausalLM: runner pooling, task token_classify, pooler ALL; every prompt token's
    final hidden state (chunked steps), softmaxed by default as vLLM's token_classify head does (activation=False:
    the hidden states as they are); reward = encode = encode(pooling_task='token_classify')."""
    path, hf, _ = causal_lm
    llm = LLM(str(path), convert="reward", **ENGINE_KW)
    mc = llm.llm_engine.config.model_config
    assert (llm.llm_engine.runner, mc.pooling_task, mc.pooler_config.pooling_type) == ("pooling", "token_classify",
                                                                                       "ALL")
    raw = llm.reward(TEXTS, pooling_params=PoolingParams(activation=False), use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in raw) > ENGINE_KW["max_num_batched_tokens"]
    for out in raw:
        ref = hidden_states(hf, out.prompt_token_ids)
        assert out.outputs.data.shape == (len(out.prompt_token_ids), COMMON["hidden_size"])
        torch.testing.assert_close(out.outputs.data, ref, atol=1e-5, rtol=0)
    outs = llm.reward(TEXTS, use_tqdm=False)
    for a, b in zip(raw, outs):
        torch.testing.assert_close(b.outputs.data, a.outputs.data.softmax(-1), atol=1e-6, rtol=0)
    for other in (llm.encode(TEXTS, use_tqdm=False), llm.encode(TEXTS, use_tqdm=False, pooling_task="token_classify")):
        for a, b in zip(outs, other):
            torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=0, rtol=0)
    with pytest.raises(ValueError, match="token classifier.*LLM.reward"):
        llm.embed("hi")
    _assert_idle(llm)


def test_convert_reward_step_pooling(causal_lm) -> None:
    """convert='reward' with pooler_config STEP: the rows of the step-tag tokens, in the returned_token_ids columns
    of the hidden state (as vLLM's StepPooler indexes them), softmaxed over those columns (sigmoid for one); columns
    beyond the hidden size are refused."""
    path, hf, tok = causal_lm
    prompts = step_prompts(len(tok))
    cols = [5, 0, 17]
    llm = LLM(str(path), convert="reward", **ENGINE_KW,
              pooler_config={"pooling_type": "STEP", "step_tag_id": TAG, "returned_token_ids": cols})
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.reward(token_prompts, use_tqdm=False)
    variants = [PoolingParams(activation=False), PoolingParams(returned_token_ids=[9])]
    raw, one = llm.reward([token_prompts[0]] * 2, pooling_params=variants, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        ref = hidden_states(hf, ids)[torch.tensor(ids) == TAG]
        assert out.outputs.data.shape == (ids.count(TAG), len(cols))
        torch.testing.assert_close(out.outputs.data, ref[:, cols].softmax(-1), atol=1e-5, rtol=0)
    ref0 = hidden_states(hf, prompts[0])[torch.tensor(prompts[0]) == TAG]
    torch.testing.assert_close(raw.outputs.data, ref0[:, cols], atol=1e-5, rtol=0)
    torch.testing.assert_close(one.outputs.data, ref0[:, [9]].sigmoid(), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"returned_token_ids \[64\] are out of range"):
        llm.reward("hi", pooling_params=PoolingParams(returned_token_ids=[0, 64]))
    _assert_idle(llm)


def test_convert_reward_errors(causal_lm, tmp_path: Path, default_model_dir: Path) -> None:
    """convert='reward' with runner='generate', or on a checkpoint that is a pooling model already (an embedding
    model, a classifier), is refused naming what is allowed."""
    path, _, _ = causal_lm
    with pytest.raises(ValueError, match="convert='reward' makes a reward model.*runner='pooling'"):
        LLM(str(path), convert="reward", runner="generate", dtype="float32")
    for name, labels in (("embed", None), ("classify", 3)):
        (tmp_path / name).mkdir()
        save_model(tmp_path / name, default_model_dir, num_labels=labels)
        with pytest.raises(ValueError, match=r"\((LlamaModel|LlamaForSequenceClassification)\) is a pooling model "
                                             r"already: drop convert.*convert='embed'"):
            LLM(str(tmp_path / name), convert="reward", dtype="float32")
