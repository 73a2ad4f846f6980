"""Tests for pagedllm.model.layers.sampler."""

from __future__ import annotations

import math
from collections import Counter
from functools import partial

import pytest
import torch

from pagedllm.model.layers.sampler import (
    RowSample,
    Sampler,
    SamplingRow,
    compute_prompt_logprobs,
)
from pagedllm.sampling_params import SamplingParams

VOCAB = 64

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Run a test on CPU and, where available, on CUDA."""
    return str(request.param)


def _row(
    params: SamplingParams | None = None,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    eos: tuple[int, ...] = (),
    device: str = "cpu",
) -> SamplingRow:
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return SamplingRow(
        params=params or SamplingParams(),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=gen,
        num_samples=num_samples,
        eos_token_ids=eos,
    )


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 3).to(device)


def _t(data: list[list[float]], device: str) -> torch.Tensor:
    return torch.tensor(data, device=device)


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[RowSample]:
    return Sampler()(logits, rows)[0]


# --------------------------------------------------------------------------- #
# Reproducibility
# --------------------------------------------------------------------------- #
def test_seeded_independent_of_batch_composition_and_order(device: str) -> None:
    mk = partial(_row, device=device)
    target = _logits(1, seed=42, device=device)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)

    def run_alone(steps: int) -> list[int]:
        row = mk(params, seed=7)
        out = []
        for _ in range(steps):
            out.append(_sample(target.unsqueeze(0), [row])[0].token_ids[0])
        return out

    alone = run_alone(20)
    # Same seeded row, different companions, different positions, each step.
    row = mk(params, seed=7)
    mixed: list[int] = []
    for step in range(20):
        others = [
            mk(SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.3), output=[1, 2]),
            mk(SamplingParams(temperature=0.0)),
            mk(SamplingParams(seed=99, min_p=0.1), seed=99, num_samples=3),
            mk(SamplingParams(), num_samples=2),
        ][: step % 5]
        pos = step % (len(others) + 1)
        rows = others[:pos] + [row] + others[pos:]
        logits = _logits(len(rows), seed=1000 + step, device=device)
        logits[pos] = target
        mixed.append(_sample(logits, rows)[pos].token_ids[0])
    assert mixed == alone
    assert len(set(alone)) > 1  # it really is random


def test_same_seed_same_tokens_num_samples(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(1, device=device)
    a = _sample(logits, [mk(seed=3, num_samples=5)])[0].token_ids
    b = _sample(logits, [mk(seed=3, num_samples=5)])[0].token_ids
    assert a == b and len(a) == 5


# --------------------------------------------------------------------------- #
# Greedy / top-k / top-p / min-p
# --------------------------------------------------------------------------- #
def test_greedy_is_argmax(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(4, device=device)
    res = _sample(logits, [mk(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert [r.token_ids[0] for r in res] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_greedy_rows_are_the_samplers_greedy_tokens_and_logprobs(device: str, batch_invariant: bool) -> None:
    """Speculative verification's greedy rows (one kernel, or torch ops under batch invariance): each row's first
    maximal index, as greedy sampling picks it (ties included), and its raw log-softmax; an empty batch gives
    nothing."""
    logits = _logits(20, vocab=49152, device=device)
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1.0  # a tie: the first index wins
    sampler = Sampler(batch_invariant=batch_invariant)
    tokens, logprobs = sampler.greedy_rows(logits)
    assert tokens == logits.argmax(-1).tolist() and tokens[3] == 7
    want = logits.float().log_softmax(-1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    assert logprobs == pytest.approx(want.tolist(), abs=1e-4)
    plain = _sample(logits, [_row(SamplingParams(temperature=0.0), device=device) for _ in range(20)])
    assert [r.token_ids[0] for r in plain] == tokens
    assert sampler.greedy_rows(logits[:0]) == ([], [])


def test_top_k_one_equals_greedy(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(6, seed=5, device=device)
    logits[0, :2] = 10.0  # a tie at the max
    greedy = _sample(logits, [mk(SamplingParams(temperature=0.0)) for _ in range(6)])
    topk1 = _sample(
        logits, [mk(SamplingParams(temperature=1.3, top_k=1), seed=i) for i in range(6)]
    )
    assert [r.token_ids for r in topk1] == [r.token_ids for r in greedy]


def test_top_k_restricts_support(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(1, seed=2, device=device)
    allowed = set(logits[0].topk(3).indices.tolist())
    res = _sample(logits, [mk(SamplingParams(temperature=5.0, top_k=3), seed=0, num_samples=300)])
    assert set(res[0].token_ids) <= allowed
    assert len(set(res[0].token_ids)) == 3


def test_tiny_top_p_is_argmax(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(3, seed=9, device=device)
    res = _sample(
        logits,
        [mk(SamplingParams(temperature=2.0, top_p=1e-9), num_samples=50) for _ in range(3)],
    )
    for r, best in zip(res, logits.argmax(-1).tolist()):
        assert set(r.token_ids) == {best}


def test_top_p_nucleus(device: str) -> None:
    mk = partial(_row, device=device)
    # probs 0.5, 0.3, 0.15, 0.05 -> top_p 0.75 keeps {0, 1}; 0.85 keeps {0, 1, 2};
    # 0.4 keeps {0}. (Exact boundaries such as 0.8 are avoided: float rounding.)
    probs = _t([[0.5, 0.3, 0.15, 0.05]], device)
    logits = probs.log()
    r = _sample(logits, [mk(SamplingParams(top_p=0.75), seed=0, num_samples=400)])[0]
    assert set(r.token_ids) == {0, 1}
    r = _sample(logits, [mk(SamplingParams(top_p=0.85), seed=0, num_samples=400)])[0]
    assert set(r.token_ids) == {0, 1, 2}
    r = _sample(logits, [mk(SamplingParams(top_p=0.4), num_samples=50)])[0]
    assert set(r.token_ids) == {0}


def test_min_p(device: str) -> None:
    mk = partial(_row, device=device)
    probs = _t([[0.4, 0.3, 0.2, 0.08, 0.02]], device)
    logits = probs.log()
    # threshold 0.45 * 0.4 = 0.18 -> keeps tokens with p >= 0.18.
    r = _sample(logits, [mk(SamplingParams(min_p=0.45), seed=0, num_samples=500)])[0]
    assert set(r.token_ids) == {0, 1, 2}
    r = _sample(logits, [mk(SamplingParams(min_p=1.0), num_samples=50)])[0]
    assert set(r.token_ids) == {0}


# --------------------------------------------------------------------------- #
# min_tokens
# --------------------------------------------------------------------------- #
def test_min_tokens_masks_eos_and_stop_token_ids(device: str) -> None:
    mk = partial(_row, device=device)
    logits = torch.zeros(2, 8, device=device)
    logits[:, 3] = 50.0  # eos
    logits[:, 5] = 49.0  # stop token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    res = _sample(
        logits,
        [mk(params, output=[1], eos=(3,)), mk(params, output=[1, 1], eos=(3,))],
    )
    assert res[0].token_ids[0] not in (3, 5)
    assert res[1].token_ids[0] == 3  # min_tokens reached: eos allowed again
    # Random rows as well.
    rp = SamplingParams(min_tokens=1, stop_token_ids=[5])
    r = _sample(logits[:1], [mk(rp, eos=(3,), num_samples=100)])[0]
    assert not set(r.token_ids) & {3, 5}
    # Log-probs stay those of the raw distribution.
    raw = torch.log_softmax(logits[0], -1)
    assert r.logprobs[0] == pytest.approx(raw[r.token_ids[0]].item(), abs=1e-5)


def test_logit_bias_and_allowed_token_ids(device: str) -> None:
    """logit_bias is added before sampling (100 forces a token, -100 bans one); allowed_token_ids restricts the
    support; both leave other rows and the raw logprobs alone, greedy and random, and a batch of rows with
    adjustments equals each row sampled alone."""
    mk = partial(_row, device=device)
    logits = _logits(4, device=device)
    top = int(logits[0].argmax())
    forced = (top + 7) % VOCAB
    greedy_bias = SamplingParams(temperature=0.0, logit_bias={forced: 100.0, top: -100.0})
    allowed = [3, 11, 29]
    logits[1, allowed] = torch.tensor([1.0, 0.5, 0.0], device=device)
    logits[1, 0] = 20.0  # the likeliest token by far, not allowed
    sampled_allowed = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    plain = SamplingParams(temperature=0.0)
    rows = [mk(greedy_bias), mk(sampled_allowed, seed=5, num_samples=200), mk(plain), mk(greedy_bias)]
    res = _sample(logits, rows)
    assert res[0].token_ids == [forced] and res[3].token_ids == [forced]
    assert set(res[1].token_ids) <= set(allowed) and len(set(res[1].token_ids)) > 1
    assert res[2].token_ids == [int(logits[2].argmax())]  # a row without adjustments is untouched
    raw = torch.log_softmax(logits.float(), -1)
    assert res[0].logprobs[0] == pytest.approx(raw[0, forced].item(), abs=1e-5)  # raw, as vLLM reports
    alone = _sample(logits[1:2], [mk(sampled_allowed, seed=5, num_samples=200)])[0]
    assert alone.token_ids == res[1].token_ids
    # The distribution over the allowed tokens is the softmax of their logits alone.
    counts = Counter(_sample(logits[1:2], [mk(sampled_allowed, seed=9, num_samples=4000)])[0].token_ids)
    want = torch.softmax(logits[1, allowed].float(), -1)
    for tok, w in zip(allowed, want.tolist()):
        assert counts[tok] / 4000 == pytest.approx(w, abs=0.03)


def test_bad_words_ban_a_last_token_only_after_the_rest(device: str) -> None:
    """bad_words as token sequences: a one-token word is always banned; a longer word's last token only when the
    output ends with the rest of it (vLLM's rule; the prompt does not count)."""
    logits = torch.zeros(3, 8, device=device)
    logits[:, 5] = 10.0  # the greedy token
    logits[:, 6] = 9.0
    params = SamplingParams(temperature=0.0, bad_words=["x"])
    words = ((6, 5),)  # "... 6 5": 5 is banned right after a 6
    rows = [SamplingRow(params, [], [1, 6], bad_words_token_ids=words),
            SamplingRow(params, [6], [1, 2], bad_words_token_ids=words),
            SamplingRow(params, [], [1], bad_words_token_ids=((5,),))]
    res = _sample(logits, rows)
    assert [r.token_ids[0] for r in res] == [6, 5, 6]


def test_logit_adjustment_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="logit_bias must hold non-negative int token ids"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(logit_bias={1: float("nan")})
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words must be a list of non-blank strings"):
        SamplingParams(bad_words=["ok", " "])
    assert SamplingParams(bad_words=["no"]).has_logit_adjustments
    with pytest.raises(ValueError, match="not supported with beam search"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, logit_bias={1: 1.0})
    assert SamplingParams(logit_bias={}).has_logit_adjustments is False
    assert SamplingParams(allowed_token_ids=(4, 5)).allowed_token_ids == [4, 5]


# --------------------------------------------------------------------------- #
# Penalties vs. a per-row reference
# --------------------------------------------------------------------------- #
def _reference_penalties(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    out = logits.clone()
    counts = Counter(output)
    for tok in range(out.shape[0]):
        v = out[tok].item()
        if tok in prompt or tok in counts:
            v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        v -= counts.get(tok, 0) * p.frequency_penalty
        v -= (1.0 if counts.get(tok, 0) > 0 else 0.0) * p.presence_penalty
        out[tok] = v
    return out


def test_cpu_penalties_on_seen_tokens_equal_the_dense_form() -> None:
    """The CPU's sparse penalties (only the tokens a row saw) give the dense form's bits: repeated and out-of-range
    ids, -inf and zero logits, empty rows, mixed per-row settings."""
    import random

    from pagedllm.model.layers.logits_ops import penalties_dense, penalties_on_seen_tokens

    rng = random.Random(0)
    rows, vocab = 12, 3000
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 3
    x[3, 100], x[5] = float("-inf"), 0.0
    prompts = [[rng.randrange(-5, vocab + 5) for _ in range(rng.randint(0, 80))] for _ in range(rows)]
    outputs = [[rng.randrange(0, 400) for _ in range(rng.randint(0, 120))] for _ in range(rows)]
    outputs[3] += [100, 100]
    outputs[7] = []
    settings = [([0.5] * rows, [0.0] * rows, [1.0] * rows), ([0.0] * rows, [0.7] * rows, [1.3] * rows),
                ([rng.uniform(-2, 2) for _ in range(rows)], [rng.uniform(-2, 2) for _ in range(rows)],
                 [rng.choice([1.0, 0.8, 1.5]) for _ in range(rows)])]
    for presence, frequency, repetition in settings:
        want = penalties_dense(x, prompts, outputs, presence, frequency, repetition)
        got = penalties_on_seen_tokens(x, prompts, outputs, presence, frequency, repetition)
        assert torch.equal(got, want)
    assert torch.equal(penalties_on_seen_tokens(x, [[]] * rows, [[]] * rows, [0.5] * rows, [0.0] * rows,
                                                [1.0] * rows), x)


def test_penalties_match_reference(device: str) -> None:
    mk = partial(_row, device=device)
    from pagedllm.model.layers.sampler import apply_penalties

    vocab = 16
    logits = _logits(4, vocab=vocab, seed=11, device=device)
    cfgs = [
        (SamplingParams(repetition_penalty=1.5), [1, 2, 3], [3, 4, 4]),
        (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), [0], [5, 5, 5, 6]),
        (SamplingParams(), [7], [8, 9]),  # defaults: untouched
        (
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
            [10, 11],
            [11, 12, 12, 15],
        ),
    ]
    got = apply_penalties(
        logits,
        [c[1] for c in cfgs],
        [c[2] for c in cfgs],
        [c[0].presence_penalty for c in cfgs],
        [c[0].frequency_penalty for c in cfgs],
        [c[0].repetition_penalty for c in cfgs],
    )
    for i, (p, prompt, output) in enumerate(cfgs):
        ref = _reference_penalties(logits[i], prompt, output, p)
        torch.testing.assert_close(got[i], ref)

    # End to end: greedy sampling takes the argmax of the penalised logits.
    rows = [
        mk(SamplingParams(temperature=0.0, **_pen(c[0])), prompt=c[1], output=c[2])
        for c in cfgs
    ]
    res = _sample(logits, rows)
    for i, (p, prompt, output) in enumerate(cfgs):
        ref = _reference_penalties(logits[i], prompt, output, p)
        assert res[i].token_ids[0] == ref.argmax().item()
        raw = torch.log_softmax(logits[i], -1)
        assert res[i].logprobs[0] == pytest.approx(raw[res[i].token_ids[0]].item(), abs=1e-5)


def _pen(p: SamplingParams) -> dict[str, float]:
    return {
        "repetition_penalty": p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
    }


def test_repetition_penalty_changes_greedy_choice(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _t([[2.0, 1.9, 0.0, -1.0]], device)
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert _sample(logits, [mk(p, prompt=[0])])[0].token_ids == [1]
    assert _sample(logits, [mk(p, prompt=[3])])[0].token_ids == [0]


# --------------------------------------------------------------------------- #
# Log-probs
# --------------------------------------------------------------------------- #
def test_sampled_logprob_is_raw_log_softmax(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(5, seed=4, device=device)
    rows = [
        mk(SamplingParams(temperature=0.3, top_k=4, presence_penalty=1.0), output=[0, 1]),
        mk(SamplingParams(temperature=0.0)),
        mk(SamplingParams(top_p=0.5), seed=1, num_samples=3),
        mk(SamplingParams(min_p=0.2)),
        mk(SamplingParams(temperature=2.0)),
    ]
    raw = torch.log_softmax(logits, -1)
    for want_tensor in (False, True):
        res, full = Sampler()(logits, rows, return_logprobs_tensor=want_tensor)
        assert (full is not None) == want_tensor
        if full is not None:
            torch.testing.assert_close(full, raw)
        for i, r in enumerate(res):
            assert r.top_logprobs is None
            for tok, lp in zip(r.token_ids, r.logprobs):
                assert lp == pytest.approx(raw[i, tok].item(), abs=1e-5)


def test_top_logprobs_contain_top_k_and_sampled(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(3, seed=8, device=device)
    rows = [
        mk(SamplingParams(logprobs=3, temperature=5.0), num_samples=4, seed=0),
        mk(SamplingParams(logprobs=0)),
        mk(SamplingParams()),  # no logprobs requested
    ]
    res = _sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    top3 = set(raw[0].topk(3).indices.tolist())
    assert res[0].top_logprobs is not None and len(res[0].top_logprobs) == 4
    by_rank = raw[0].topk(3).indices.tolist()
    for tok, d in zip(res[0].token_ids, res[0].top_logprobs):
        assert set(d) == top3 | {tok}
        assert len(d) in (3, 4)
        assert next(iter(d)) == tok  # the sampled token first, with its rank by a brute-force count
        assert d[tok].rank == int((raw[0] >= raw[0, tok]).sum())
        for t, e in d.items():
            assert e.logprob == pytest.approx(raw[0, t].item(), abs=1e-5)
            if t != tok:
                assert e.rank == by_rank.index(t) + 1
    only = res[1].top_logprobs
    assert len(only) == 1 and list(only[0]) == res[1].token_ids
    tok = res[1].token_ids[0]
    assert only[0][tok].logprob == pytest.approx(res[1].logprobs[0])
    assert only[0][tok].rank == int((raw[1] >= raw[1, tok]).sum())
    assert res[2].top_logprobs is None


def test_compute_prompt_logprobs(device: str) -> None:
    logits = _logits(4, vocab=10, seed=3, device=device)
    nxt = torch.tensor([1, 9, 0, 4])
    raw = torch.log_softmax(logits, -1)
    out = compute_prompt_logprobs(logits, nxt, 2)
    ranks = [d[int(t)].rank for d, t in zip(out, nxt)]
    assert len(out) == 4
    # vLLM's rank: 1 + the number of other tokens at least as likely.
    assert ranks == [int((raw[i] >= raw[i, int(t)]).sum()) for i, t in enumerate(nxt)]
    assert all(1 <= r <= 10 for r in ranks)
    for i, d in enumerate(out):
        want = set(raw[i].topk(2).indices.tolist()) | {int(nxt[i])}
        assert set(d) == want
        assert next(iter(d)) == int(nxt[i])  # actual token first
        for t, e in d.items():
            assert e.logprob == pytest.approx(raw[i, t].item(), abs=1e-5)
            if t != int(nxt[i]):  # a top token: its place in the top 2
                assert e.rank == raw[i].topk(2).indices.tolist().index(t) + 1
    only_actual = compute_prompt_logprobs(logits, nxt, 0)
    assert [list(d) for d in only_actual] == [[1], [9], [0], [4]]
    assert [d[int(t)].rank for d, t in zip(only_actual, nxt)] == ranks
    top1 = raw.argmax(-1)
    assert [d[int(t)].rank for d, t in zip(compute_prompt_logprobs(logits, top1, 0), top1)] == [1, 1, 1, 1]


# --------------------------------------------------------------------------- #
# num_samples, statistics, misc
# --------------------------------------------------------------------------- #
def test_num_samples_returns_that_many(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(3, device=device)
    rows = [mk(num_samples=4), mk(SamplingParams(temperature=0.0), num_samples=2), mk()]
    res = _sample(logits, rows)
    assert [len(r.token_ids) for r in res] == [4, 2, 1]
    assert [len(r.logprobs) for r in res] == [4, 2, 1]
    assert res[1].token_ids == [int(logits[1].argmax())] * 2


def test_temperature_frequencies_match_softmax(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _t([[1.0, 0.5, 0.0, -0.5, -2.0]], device)
    temperature = 0.7
    n = 20000
    r = _sample(logits, [mk(SamplingParams(temperature=temperature), seed=123, num_samples=n)])[0]
    freq = torch.bincount(torch.tensor(r.token_ids), minlength=5).float() / n
    expected = torch.softmax(logits[0] / temperature, -1).cpu()
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)

    # Unseeded rows (default generator) too.
    r = _sample(logits, [mk(SamplingParams(temperature=1.5), num_samples=n)])[0]
    freq = torch.bincount(torch.tensor(r.token_ids), minlength=5).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0] / 1.5, -1).cpu(), atol=0.02)


def test_low_precision_logits_and_masked_entries(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(2, device=device).to(torch.bfloat16)
    logits[:, :10] = float("-inf")
    res = _sample(logits, [mk(num_samples=50), mk(SamplingParams(temperature=0.0))])
    assert all(t >= 10 for t in res[0].token_ids)
    assert all(math.isfinite(lp) for lp in res[0].logprobs)
    assert res[1].token_ids[0] == int(logits[1].float().argmax())


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 5), [_row()])


def test_empty_batch() -> None:
    res, full = Sampler()(torch.zeros(0, 5), [], return_logprobs_tensor=True)
    assert res == [] and full is not None and full.shape == (0, 5)


def test_input_logits_not_modified(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(3, device=device)
    before = logits.clone()
    rows = [
        mk(SamplingParams(min_tokens=3, stop_token_ids=[1]), eos=(0,), seed=1),
        mk(SamplingParams(temperature=0.0, repetition_penalty=1.3), prompt=[2], output=[3]),
        mk(SamplingParams(top_p=0.5, top_k=7, min_p=0.1, temperature=0.5), num_samples=2),
    ]
    Sampler()(logits, rows, return_logprobs_tensor=True)
    assert torch.equal(logits, before)


def test_beam_rows_are_greedy(device: str) -> None:
    mk = partial(_row, device=device)
    logits = _logits(2, device=device)
    beam = SamplingParams(n=2, use_beam_search=True, temperature=0.0)
    res, full = Sampler()(logits, [mk(beam), mk(beam)], return_logprobs_tensor=True)
    assert [r.token_ids[0] for r in res] == logits.argmax(-1).tolist()
    assert full is not None and full.shape == logits.shape


def test_cpu_processed_rows_take_the_c_kernel_and_draw_what_the_torch_path_draws(monkeypatch) -> None:
    """Float32 CPU rows with filters or penalties (one sample each, no top logprobs) go to the C sampling kernel on
    their processed logits; with the same host generators they draw the tokens the torch path draws, with the same
    raw logprobs."""
    import random

    from pagedllm.kernels.cpu_kernels import load_cpu_kernels

    native = load_cpu_kernels()
    if native is None:
        pytest.skip("no C compiler: the native CPU kernels are unavailable")
    logits = _logits(12, vocab=4096, seed=9) * 2
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8), SamplingParams(temperature=1.0, top_k=50),
              SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.2, min_p=0.05),
              SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0.0, top_k=5, frequency_penalty=2.0)]

    def rows(draw: int) -> list[SamplingRow]:
        return [SamplingRow(params[i % len(params)], [1, 2, 3], [4, 4, 5 + i], random.Random(1000 * draw + i))
                for i in range(12)]

    calls = []
    orig = type(native).sample_rows
    monkeypatch.setattr(type(native), "sample_rows", lambda self, *a: calls.append(1) or orig(self, *a))
    same = 0
    for draw in range(20):
        got, _ = Sampler()(logits, rows(draw))
        want, _ = Sampler(native_cpu=False)(logits, rows(draw))
        same += sum(g.token_ids == w.token_ids for g, w in zip(got, want))
        for g, w in zip(got, want):
            if g.token_ids == w.token_ids:
                assert g.logprobs[0] == pytest.approx(w.logprobs[0], abs=1e-5)
    assert len(calls) == 20  # every call took the kernel, and only the native sampler's
    # The two inverse CDFs sum the weights in other orders: a draw may fall on the other side of a boundary
    # only where a float's last bits decide; across 240 draws that is at most a handful.
    assert same >= 236, same
