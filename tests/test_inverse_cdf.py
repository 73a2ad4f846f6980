"""Inverse-CDF sampling (model/layers/inverse_cdf.py): stratified uniforms give each token its exact share,
zero-probability tokens are never drawn, and seeded draws do not depend on the batch."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.model.layers.inverse_cdf import CDF_BLOCK, draw_uniforms, inverse_cdf_sample
from pagedllm.model.layers.sampler import Sampler, SamplingRow
from pagedllm.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.mark.parametrize("vocab", [7, CDF_BLOCK, 3 * CDF_BLOCK + 5])
def test_stratified_uniforms_give_each_token_its_share(device: torch.device, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(vocab, generator=g) ** 4  # uneven, and unnormalised: the total scales u
    probs[torch.randperm(vocab, generator=g)[: vocab // 3]] = 0.0  # masked tokens
    n = 20_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # one point per 1/n of the distribution
    tokens = inverse_cdf_sample(probs.expand(n, vocab).to(device), u.to(device)).cpu()
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = probs.double() / probs.double().sum() * n
    assert (counts - expected).abs().max() <= 1.0 + 1e-6  # the count of a token is floor or ceil of n·p
    assert counts[probs == 0].sum() == 0


def test_zero_probability_tokens_are_never_drawn_at_the_edges(device: torch.device) -> None:
    vocab = 4 * CDF_BLOCK + 3
    probs = torch.zeros(vocab)
    allowed = [0, CDF_BLOCK - 1, CDF_BLOCK, 2 * CDF_BLOCK + 17, vocab - 4]  # block edges, whole zero blocks
    probs[allowed] = torch.tensor([1e-30, 0.3, 1e-9, 0.5, 0.2])
    edge = [0.0, 1e-300, 0.3 / 1.0000000010, 0.3, 0.5, 0.8, 1.0 - 2**-53, 1.0 - 1e-12]
    u = torch.tensor(edge + torch.rand(500, dtype=torch.float64).tolist(), dtype=torch.float64)
    tokens = inverse_cdf_sample(probs.expand(len(u), vocab).to(device), u.to(device)).cpu().tolist()
    assert set(tokens) <= set(allowed)
    assert tokens[6] == vocab - 4 and tokens[7] == vocab - 4  # u just below 1: the last allowed token


def test_one_token_rows_always_give_that_token(device: torch.device) -> None:
    probs = torch.zeros(5, 1000)
    probs[torch.arange(5), torch.tensor([0, 255, 256, 511, 999])] = torch.tensor([1.0, 2.0, 1e-20, 7.0, 0.5])
    u = torch.tensor([0.0, 0.5, 0.999999, 0.25, 1.0 - 2**-53], dtype=torch.float64)
    assert inverse_cdf_sample(probs.to(device), u.to(device)).tolist() == [0, 255, 256, 511, 999]


def test_draw_uniforms_takes_each_seeded_span_from_its_generator(device: torch.device) -> None:
    def draws(layout: list[tuple[int, int]], total: int) -> torch.Tensor:
        gens = [(start, count, torch.Generator().manual_seed(seed)) for seed, (start, count) in enumerate(layout)]
        return draw_uniforms(gens, total, device).cpu()

    a = draws([(0, 2), (5, 3)], 9)
    b = draws([(3, 2), (0, 3)], 6)  # the same two generators at other places, among other rows
    assert a.dtype == torch.float64 and ((a >= 0) & (a < 1)).all()
    assert torch.equal(a[0:2], b[3:5]) and torch.equal(a[5:8], b[0:3])


def test_host_generators_draw_their_own_spans(device: torch.device) -> None:
    a = draw_uniforms([(1, 2, random.Random(5)), (4, 1, random.Random(6))], 6, device).cpu()
    b = draw_uniforms([(0, 1, random.Random(6)), (2, 2, random.Random(5))], 4, device).cpu()
    assert torch.equal(a[1:3], b[2:4]) and torch.equal(a[4:5], b[0:1])
    assert a.device.type == "cpu" and a.dtype == torch.float64


def test_engine_generators_sample_independently_of_the_batch(device: torch.device) -> None:
    """A seeded row (the engine gives it a random.Random) samples the same tokens whatever rows surround it."""
    sampler = Sampler()
    target = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)).to(device) * 2
    params = SamplingParams(temperature=0.9, top_p=0.97, seed=1)

    def run(companions: int) -> list[int]:
        gen, out = random.Random(11), []
        for step in range(30):
            others = [SamplingRow(SamplingParams(temperature=1.0), [], []) for _ in range((step + companions) % 4)]
            rows = others + [SamplingRow(params, [], [], gen)]
            logits = torch.cat([torch.randn(len(others), 300).to(device), target])
            out.append(sampler(logits, rows)[0][-1].token_ids[0])
        return out

    alone = run(0)
    assert run(1) == alone == run(2) and len(set(alone)) > 1


@pytest.mark.parametrize("mode", ["auto", "race", "inverse_cdf"])
def test_every_mode_samples_the_softmax(device: torch.device, mode: str) -> None:
    vocab, draws = 12, 30_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2)).to(device) * 1.5
    gen = torch.Generator(device).manual_seed(0) if mode == "race" else random.Random(0)
    rows = [SamplingRow(SamplingParams(temperature=0.7, seed=0), [], [], gen, num_samples=draws)]
    tokens = Sampler(mode)(logits, rows)[0][0].token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / draws
    target = (logits.float().cpu()[0] / 0.7).softmax(-1).double()
    assert 0.5 * (freq - target).abs().sum() < 0.02  # ~0.006 expected at 30 000 draws


def test_bad_modes_and_generators_are_refused() -> None:
    with pytest.raises(ValueError, match="random_sampling must be"):
        Sampler("gumbel")
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], [], random.Random(0))]
    with pytest.raises(ValueError, match="race sampling draws on cpu"):
        Sampler("race")(torch.zeros(1, 8), rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="only a GPU batch mixes the race and inverse-CDF rows")
def test_a_gpu_batch_mixing_device_and_host_generators() -> None:
    """With a filter on (torch ops), a row of a device generator takes the race and a row of a host generator the
    inverse CDF, in one batch; each gives what it gives alone."""
    sampler = Sampler()
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(8)).cuda() * 2
    params = SamplingParams(temperature=0.9, top_k=40)

    def rows() -> list[SamplingRow]:
        return [SamplingRow(params, [], [], torch.Generator("cuda").manual_seed(1)),
                SamplingRow(params, [], [], random.Random(2)),
                SamplingRow(params, [], [])]

    together = [r.token_ids[0] for r in sampler(logits, rows())[0]]
    alone = [sampler(logits[i:i + 1], [rows()[i]])[0][0].token_ids[0] for i in range(2)]
    assert together[:2] == alone
    top40 = logits.topk(40, dim=-1).indices.cpu()
    assert all(t in top40[i].tolist() for i, t in enumerate(together))
