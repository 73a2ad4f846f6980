"""Mamba-2 mixer and the Mamba-2 / hybrid model classes against transformers' torch implementation (CPU, float32).

The mixer runs a flat batch whose state lives in slots (model/layers/mamba_state.py): a whole prompt, the same prompt
in chunks over successive steps, single-token decode steps (against transformers' own cache), and a mixed batch of
decodes and prefill chunks in scrambled slots. Mamba2ForCausalLM's prompt logits match transformers' after loading a
checkpoint transformers wrote; the hybrids (Bamba, GraniteMoeHybrid, Nemotron-H) load every tensor of one.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import DynamicCache

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.attention import TorchAttentionBackend
from pagedllm.model.layers.mamba2 import Mamba2Mixer
from pagedllm.model.layers.mamba_state import MambaStateMetadata, allocate_layer_caches
from pagedllm.model.loader import iterate_weights, load_config
from pagedllm.model.models.mamba2 import mamba2_dims
from pagedllm.model.models.registry import get_model_class

TP1 = TensorParallelGroup()
NUM_SLOTS = 6
ATOL = 1e-4


def _mamba2_config(**overrides) -> transformers.Mamba2Config:
    kwargs = dict(vocab_size=96, hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16,
                  num_hidden_layers=2, expand=2, conv_kernel=4, chunk_size=16, use_conv_bias=True,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Mamba2Config(**kwargs)


BLOCK = 4
BLOCKS_PER_SEQ = 16


def _meta(query_lens: list[int], context_before: list[int], slots: list[int], caches: list,
          num_decodes: int, seq_ids: list[int] | None = None) -> AttentionMetadata:
    """A flat batch's metadata as the engine builds it: the i-th sequence owns state slot `slots[i]` and KV blocks
    from seq_ids[i]·BLOCKS_PER_SEQ on (for the hybrids' attention layers, through the torch backend)."""
    seq_lens = [c + q for c, q in zip(context_before, query_lens)]
    starts = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_ids = list(range(len(slots))) if seq_ids is None else seq_ids
    tables = torch.stack([torch.arange(s * BLOCKS_PER_SEQ, (s + 1) * BLOCKS_PER_SEQ, dtype=torch.int32)
                          for s in seq_ids])
    slot_mapping = torch.cat([tables[i].long()[torch.arange(c, c + q) // BLOCK] * BLOCK + torch.arange(c, c + q) % BLOCK
                              for i, (c, q) in enumerate(zip(context_before, query_lens))])
    state = MambaStateMetadata(state_indices=torch.tensor(slots, dtype=torch.int64), state_indices_cpu=list(slots),
                               has_initial_state=[c > 0 for c in context_before], layer_caches=caches)
    return AttentionMetadata(slot_mapping=slot_mapping, block_tables=tables,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=starts,
                             seq_lens_cpu=seq_lens, query_lens_cpu=list(query_lens), num_decodes=num_decodes,
                             max_seq_len=max(seq_lens), max_query_len=max(query_lens),
                             backend=TorchAttentionBackend(), mamba=state)


def _hf_and_ours(config) -> tuple[torch.nn.Module, Mamba2Mixer]:
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer

    torch.manual_seed(0)
    hf = HFMixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.3)
        hf.A_log.copy_(torch.log(torch.rand_like(hf.A_log) * 4 + 0.5))
        hf.D.copy_(torch.randn_like(hf.D))
    ours = Mamba2Mixer(mamba2_dims(config), TP1, torch.float32, chunk_size=8)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def _caches(config):
    return allocate_layer_caches(mamba2_dims(config).state_shape(1), NUM_SLOTS, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def mixers():
    config = _mamba2_config()
    return config, *_hf_and_ours(config)


def _run(ours, caches, xs: list[torch.Tensor], context_before: list[int], slots: list[int], num_decodes: int):
    meta = _meta([x.shape[0] for x in xs], context_before, slots, caches, num_decodes)
    with torch.inference_mode():
        return ours(torch.cat(xs), caches[0], meta)


def test_prefill_matches_transformers(mixers) -> None:
    config, hf, ours = mixers
    x = torch.randn(1, 37, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hf(x)[0]
    caches = _caches(config)
    caches[0].conv_state.fill_(7.0)  # stale state of an earlier owner of the slot: must be ignored
    caches[0].ssm_state.fill_(7.0)
    got = _run(ours, caches, [x[0]], [0], [2], 0)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_transformers(mixers) -> None:
    """Chunks over successive steps carry the state through slot 4; then decode steps match transformers' cache."""
    config, hf, ours = mixers
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 29, config.hidden_size, generator=gen)
    steps = torch.randn(1, 4, config.hidden_size, generator=gen)
    hf_cache = DynamicCache(config=config)
    with torch.inference_mode():
        want = hf(x, cache=hf_cache)[0]
        want_decode = [hf(steps[:, i:i + 1], cache=hf_cache)[0] for i in range(steps.shape[1])]
    caches = _caches(config)
    done = 0
    for size in (2, 11, 16):  # shorter than the conv window, across chunk boundaries, the rest
        got = _run(ours, caches, [x[0, done:done + size]], [done], [4], 0)
        torch.testing.assert_close(got, want[done:done + size], atol=ATOL, rtol=0)
        done += size
    assert done == x.shape[1]
    for i, expected in enumerate(want_decode):
        got = _run(ours, caches, [steps[0, i:i + 1]], [done + i], [4], 1)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_mixed_batch_matches_sequences_alone(mixers) -> None:
    """Two decodes and two prefill chunks (one continuing, one fresh) in slots [3, 0, 5, 1] give what each
    sequence gives alone, and leave each slot's state as running alone does."""
    config, _, ours = mixers
    gen = torch.Generator().manual_seed(3)
    hidden = config.hidden_size
    prompts = [torch.randn(n, hidden, generator=gen) for n in (9, 5, 12)]
    chunk_lens = [1, 1, 6, 7]
    before = [9, 5, 12, 0]  # tokens each sequence ran before this step
    nexts = [torch.randn(n, hidden, generator=gen) for n in chunk_lens]
    slots = [3, 0, 5, 1]

    alone_out, alone_caches = [], []
    for i in range(4):
        caches = _caches(config)
        if before[i]:
            _run(ours, caches, [prompts[i]], [0], [slots[i]], 0)
        alone_out.append(_run(ours, caches, [nexts[i]], [before[i]], [slots[i]], 1 if chunk_lens[i] == 1 else 0))
        alone_caches.append(caches[0])

    caches = _caches(config)  # the three continuing sequences' earlier steps, in one prefill batch
    _run(ours, caches, [prompts[i] for i in range(3)], [0, 0, 0], slots[:3], 0)
    got = _run(ours, caches, nexts, before, slots, 2)
    torch.testing.assert_close(got, torch.cat(alone_out), atol=ATOL, rtol=0)
    for i, slot in enumerate(slots):
        torch.testing.assert_close(caches[0].conv_state[slot], alone_caches[i].conv_state[slot], atol=ATOL, rtol=0)
        torch.testing.assert_close(caches[0].ssm_state[slot], alone_caches[i].ssm_state[slot], atol=ATOL, rtol=0)


def test_state_snapshots_inside_chunks(mixers) -> None:
    """Prefix caching's cuts: a chunk's state after its first q tokens lands in the cut's slot, as running those q
    tokens alone leaves it; the outputs and the end states do not change. Cuts inside the conv window, across scan
    blocks, two in one chunk, one in a continuing chunk, none in a decode row."""
    config, _, ours = mixers
    gen = torch.Generator().manual_seed(9)
    hidden = config.hidden_size
    first = torch.randn(5, hidden, generator=gen)  # the second sequence's earlier step
    chunks = [torch.randn(n, hidden, generator=gen) for n in (1, 21, 13)]
    before, slots = [3, 5, 0], [0, 1, 2]
    decode_prev = torch.randn(3, hidden, generator=gen)
    cuts = [(1, 2, 3), (1, 17, 4), (2, 9, 5)]  # (batch row, offset, slot)

    def prime(caches):
        _run(ours, caches, [decode_prev, first], [0, 0], slots[:2], 0)

    plain = _caches(config)
    prime(plain)
    want = _run(ours, plain, chunks, before, slots, 1)
    caches = _caches(config)
    prime(caches)
    meta = _meta([c.shape[0] for c in chunks], before, slots, caches, 1)
    meta.mamba.cuts = cuts
    with torch.inference_mode():
        got = ours(torch.cat(chunks), caches[0], meta)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for slot in slots:
        torch.testing.assert_close(caches[0].ssm_state[slot], plain[0].ssm_state[slot], atol=ATOL, rtol=0)
    for row, offset, slot in cuts:
        alone = _caches(config)
        if row == 1:
            _run(ours, alone, [first], [0], [slots[row]], 0)
        _run(ours, alone, [chunks[row][:offset]], [before[row]], [slots[row]], 0)
        torch.testing.assert_close(caches[0].conv_state[slot], alone[0].conv_state[slots[row]], atol=ATOL, rtol=0)
        torch.testing.assert_close(caches[0].ssm_state[slot], alone[0].ssm_state[slots[row]], atol=ATOL, rtol=0)


def test_fresh_decode_row_ignores_stale_slot(mixers) -> None:
    """A one-token prompt scheduled as a decode row starts from zeros, whatever its slot holds."""
    config, hf, ours = mixers
    x = torch.randn(1, 1, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = hf(x)[0]
    caches = _caches(config)
    caches[0].conv_state.normal_()
    caches[0].ssm_state.normal_()
    got = _run(ours, caches, [x[0]], [0], [5], 1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_time_step_limit_as_transformers() -> None:
    """A tight time_step_limit clamps dt on the chunked (prompt) path; decode steps leave it unclamped, as
    transformers' (and mamba_ssm's) recurrent step does."""
    config = _mamba2_config(time_step_limit=(0.0, 0.05))
    hf, ours = _hf_and_ours(config)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 10, config.hidden_size, generator=gen)
    step = torch.randn(1, 1, config.hidden_size, generator=gen)
    hf_cache = DynamicCache(config=config)
    with torch.inference_mode():
        want = hf(x, cache=hf_cache)[0]
        want_step = hf(step, cache=hf_cache)[0]
        unclamped = _hf_and_ours(_mamba2_config())[0](x)[0]
    assert (want - unclamped).abs().max() > 1e-3  # the limit bites here
    caches = _caches(config)
    torch.testing.assert_close(_run(ours, caches, [x[0]], [0], [1], 0), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(_run(ours, caches, [step[0]], [10], [1], 1), want_step, atol=ATOL, rtol=0)


def test_bfloat16_mixer_runs_close_to_float32(mixers) -> None:
    """bfloat16 weights and conv state (SSM state float32): the same outputs within bfloat16's precision."""
    config, _, ours = mixers
    low = Mamba2Mixer(mamba2_dims(config), TP1, torch.bfloat16, chunk_size=8)
    low.load_state_dict({k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()})
    x = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(8))
    caches = allocate_layer_caches(mamba2_dims(config).state_shape(1), NUM_SLOTS, torch.bfloat16,
                                   torch.device("cpu"))
    ref_caches = _caches(config)
    for chunk, before, nd in ((x[:9], 0, 0), (x[9:10], 9, 1), (x[10:], 10, 0)):
        got = _run(low, caches, [chunk.to(torch.bfloat16)], [before], [2], nd)
        want = _run(ours, ref_caches, [chunk], [before], [2], nd)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


def test_mixer_rejects_tensor_parallel() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        Mamba2Mixer(mamba2_dims(_mamba2_config()), TensorParallelGroup(rank=0, size=2), torch.float32)


# -- whole models ------------------------------------------------------------------------------------------------


def _save(model: torch.nn.Module, path: Path) -> Path:
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _load_ours(path: Path) -> torch.nn.Module:
    config = load_config(path)
    model = get_model_class(config)(config, TP1, torch.float32)
    model.load_weights(iterate_weights(path, use_tqdm=False))
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_mamba2_model_logits_match_transformers(tmp_path: Path, tied: bool) -> None:
    config = _mamba2_config(num_hidden_layers=3, tie_word_embeddings=tied, initializer_range=0.1)
    torch.manual_seed(0)
    hf = transformers.Mamba2ForCausalLM(config).eval()
    _save(hf, tmp_path)
    ours = _load_ours(tmp_path)
    cls = type(ours)
    assert cls.sliding_windows(config) == []
    shape = cls.mamba_state_shape(config)
    assert (shape.num_layers, shape.conv_dim, shape.conv_width, shape.num_heads, shape.head_dim,
            shape.state_size) == (3, 128 + 2 * 2 * 16, 3, 8, 16, 16)

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in (13, 4)]
    with torch.inference_mode():
        want = [hf(p[None]).logits[0] for p in prompts]
    caches = allocate_layer_caches(shape, NUM_SLOTS, torch.float32, torch.device("cpu"))
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    meta = _meta([len(p) for p in prompts], [0, 0], [2, 4], caches, 0)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(ids, positions, [], meta))
    torch.testing.assert_close(logits, torch.cat(want), atol=ATOL, rtol=0)

    # a decode step for both, against transformers' full pass over prompt + token
    nxt = torch.randint(3, config.vocab_size, (2,), generator=gen)
    meta = _meta([1, 1], [len(p) for p in prompts], [2, 4], caches, 2)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(nxt, torch.tensor([len(p) for p in prompts]), [], meta))
        want = torch.stack([hf(torch.cat([p, nxt[i:i + 1]])[None]).logits[0, -1] for i, p in enumerate(prompts)])
    torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)


_HYBRID_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
                     mamba_d_conv=4, mamba_chunk_size=16, rms_norm_eps=1e-5, max_position_embeddings=64,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
                     attn_implementation="eager")
_GRANITE_MULTIPLIERS = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                            logits_scaling=3.0)
HYBRIDS = {
    "bamba": ("BambaConfig", "BambaForCausalLM", {**_HYBRID_SHAPE, "attn_layer_indices": [1, 3]},
              ["mamba", "attention", "mamba", "attention"]),
    "granite-moe-nope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        **_HYBRID_SHAPE, **_GRANITE_MULTIPLIERS, "num_local_experts": 4, "num_experts_per_tok": 2,
        "shared_intermediate_size": 48, "position_embedding_type": "nope",
        "layer_types": ["mamba", "mamba", "attention", "mamba"]}, ["mamba", "mamba", "attention", "mamba"]),
    "granite-dense-rope": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        **_HYBRID_SHAPE, **_GRANITE_MULTIPLIERS, "num_local_experts": 0, "shared_intermediate_size": 48,
        "position_embedding_type": "rope", "tie_word_embeddings": True,
        "layer_types": ["attention", "mamba", "mamba", "attention"]}, ["attention", "mamba", "mamba", "attention"]),
    "nemotron-h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=48, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=16, layer_norm_epsilon=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="eager",
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba"]),
        ["mamba", "mlp", "attention", "mlp", "mamba"]),
    # Nemotron 3: ReLU² experts routed as DeepSeek-V3 routes (sigmoid, correction bias, 2 groups, top-1 group,
    # renormalised, scaled), a shared expert, and latent projections around the routed experts.
    "nemotron-h-moe": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=48, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=16, layer_norm_epsilon=1e-5, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="eager", n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, moe_shared_expert_intermediate_size=32, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.5, moe_latent_size=48,
        layers_block_type=["mamba", "moe", "attention", "moe"]),
        ["mamba", "moe", "attention", "moe"]),
}


def _our_kinds(model: torch.nn.Module) -> list[str]:
    if hasattr(model, "backbone"):  # Nemotron-H: one mixer per block
        return [layer.kind for layer in model.backbone.layers]
    return ["mamba" if layer.is_mamba else "attention" for layer in model.model.layers]


def _our_mixer(model: torch.nn.Module, index: int) -> tuple[torch.nn.Module, str]:
    """Layer `index`'s Mamba mixer, and its checkpoint name prefix."""
    if hasattr(model, "backbone"):
        return model.backbone.layers[index].mixer, f"backbone.layers.{index}.mixer."
    return model.model.layers[index].mamba, f"model.layers.{index}.mamba."


def _hybrid(name: str, path: Path) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    config_cls, model_cls, kwargs, _ = HYBRIDS[name]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).eval()
    _save(hf, path)
    return hf, _load_ours(path), load_config(path)


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_hybrid_loads_every_tensor(name: str, tmp_path: Path) -> None:
    """load_weights raises on a checkpoint tensor without a parameter and on a parameter left unloaded; the layer
    kinds, the per-attention-layer windows and the state shape follow the config."""
    hf, ours, config = _hybrid(name, tmp_path)
    kinds = HYBRIDS[name][3]
    assert _our_kinds(ours) == kinds
    cls = type(ours)
    assert cls.sliding_windows(config) == [None] * kinds.count("attention")
    shape = cls.mamba_state_shape(config)
    assert (shape.num_layers, shape.conv_dim, shape.conv_width, shape.num_heads, shape.head_dim,
            shape.state_size) == (kinds.count("mamba"), 128 + 2 * 2 * 16, 3, 8, 16, 16)
    state = {k.replace("model.", "backbone.", 1) if name.startswith("nemotron-h") else k: v
             for k, v in hf.state_dict().items()}
    mixer, prefix = _our_mixer(ours, kinds.index("mamba"))
    for suffix in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                   "out_proj.weight"):
        want = state[prefix + suffix]
        got = dict(mixer.named_parameters())[suffix]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_hybrid_logits_match_transformers(name: str, tmp_path: Path) -> None:
    """Two prompts in one prefill step (the second in two chunks over two steps), then a decode step for both:
    the logits match transformers' full passes."""
    hf, ours, config = _hybrid(name, tmp_path)
    cls = type(ours)
    num_seqs = 2
    caches = allocate_layer_caches(cls.mamba_state_shape(config), NUM_SLOTS, torch.float32, torch.device("cpu"))
    windows = cls.sliding_windows(config)
    kv_shape = (num_seqs * BLOCKS_PER_SEQ, BLOCK, config.num_key_value_heads,
                getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    kv_caches = [(torch.zeros(kv_shape), torch.zeros(kv_shape)) for _ in windows]
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in (11, 14)]
    nxt = torch.randint(3, config.vocab_size, (num_seqs,), generator=gen)
    with torch.inference_mode():
        want = [hf(p[None]).logits[0] for p in prompts]
        want_next = torch.stack([hf(torch.cat([p, nxt[i:i + 1]])[None]).logits[0, -1] for i, p in enumerate(prompts)])

    def step(chunks: list[torch.Tensor], before: list[int], num_decodes: int, seq_ids: list[int]) -> torch.Tensor:
        meta = _meta([len(c) for c in chunks], before, [[4, 1][s] for s in seq_ids], caches, num_decodes, seq_ids)
        positions = torch.cat([torch.arange(b, b + len(c)) for b, c in zip(before, chunks)])
        with torch.inference_mode():
            return ours.compute_logits(ours(torch.cat(chunks), positions, kv_caches, meta))

    got = step([prompts[0], prompts[1][:6]], [0, 0], 0, [0, 1])
    torch.testing.assert_close(got, torch.cat([want[0], want[1][:6]]), atol=ATOL, rtol=0)
    got = step([prompts[1][6:]], [6], 0, [1])
    torch.testing.assert_close(got, want[1][6:], atol=ATOL, rtol=0)
    got = step([nxt[:1], nxt[1:]], [11, 14], 2, [0, 1])
    torch.testing.assert_close(got, want_next, atol=ATOL, rtol=0)
