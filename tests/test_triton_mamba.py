"""The Mamba-2 decode kernels against the mixer's torch path (model/layers/mamba2.py, itself checked against
transformers in test_mamba2_layers.py): the Triton ones (kernels/triton_mamba.py; Triton's interpreter on CPU, compiled
on CUDA) and the CPU's C ones (kernels/cpu/cpu_ops.c). Outputs and the states left in the slots; other slots
untouched."""
from __future__ import annotations

import triton_setup  # noqa: F401  (before the kernel module: TRITON_INTERPRET on CPU)

import pytest
import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.triton_mamba import conv_state_update, ssm_state_update
from pagedllm.model.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from pagedllm.model.layers.mamba_state import MambaLayerCache, MambaStateMetadata

triton_setup.interpreter_numpy_shim()
DEVICE = triton_setup.DEVICE


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_match_torch_path(bias: bool, state_dtype: torch.dtype, monkeypatch) -> None:
    torch.manual_seed(0)
    dims = Mamba2Dims(hidden_size=32, num_heads=6, head_dim=12, n_groups=2, d_state=20, d_conv=4, conv_bias=bias)
    mixer = Mamba2Mixer(dims, TensorParallelGroup(), torch.float32)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.5)
    mixer = mixer.to(DEVICE)
    cache = MambaLayerCache(torch.randn(7, dims.conv_dim, dims.d_conv - 1, device=DEVICE).to(state_dtype),
                            torch.randn(7, dims.num_heads, dims.head_dim, dims.d_state, device=DEVICE).to(state_dtype))
    slots = torch.tensor([5, 0, 3, 6], device=DEVICE)
    proj = torch.randn(4, dims.intermediate + dims.conv_dim + dims.num_heads, device=DEVICE)
    xbc = proj[:, dims.intermediate: dims.intermediate + dims.conv_dim]
    dt = proj[:, -dims.num_heads:]
    before = (cache.conv_state.clone(), cache.ssm_state.clone())

    # the torch path on CPU copies of everything
    monkeypatch.setattr(Mamba2Mixer, "_native_cpu", staticmethod(lambda xbc, cache: None))
    a = -torch.exp(mixer.A_log.float().cpu())
    cpu_mixer = mixer.to("cpu")
    ref_cache = _cpu(cache)
    want = cpu_mixer._decode(xbc.cpu(), dt.cpu(), a, ref_cache,
                             MambaStateMetadata(slots.cpu(), slots.tolist(), [True] * 4, [ref_cache]), 4)
    mixer = cpu_mixer.to(DEVICE)

    conv = conv_state_update(xbc, cache.conv_state, mixer.conv1d.weight, mixer.conv1d.bias, slots)
    got = ssm_state_update(conv, dt, mixer.dt_bias, mixer.A_log, mixer.D, cache.ssm_state, slots, dims.n_groups)
    tol = dict(atol=2e-2, rtol=2e-2) if state_dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.cpu(), want, **tol)
    torch.testing.assert_close(cache.conv_state.cpu().float(), ref_cache.conv_state.float(), **tol)
    torch.testing.assert_close(cache.ssm_state.cpu().float(), ref_cache.ssm_state.float(), **tol)
    untouched = [1, 2, 4]
    assert torch.equal(cache.conv_state[untouched].cpu(), before[0][untouched].cpu())
    assert torch.equal(cache.ssm_state[untouched].cpu(), before[1][untouched].cpu())


def _cpu(cache: MambaLayerCache) -> MambaLayerCache:
    return MambaLayerCache(cache.conv_state.cpu().clone(), cache.ssm_state.cpu().clone())


@pytest.mark.parametrize("bias", [True, False])
def test_native_cpu_decode_matches_torch_path(bias: bool, monkeypatch) -> None:
    from pagedllm.kernels.cpu_kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("no native CPU kernels here (no C compiler)")
    torch.manual_seed(1)
    dims = Mamba2Dims(hidden_size=32, num_heads=6, head_dim=12, n_groups=3, d_state=20, d_conv=4, conv_bias=bias)
    mixer = Mamba2Mixer(dims, TensorParallelGroup(), torch.float32)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.5)
    proj = torch.randn(5, dims.intermediate + dims.conv_dim + dims.num_heads)
    xbc, dt = proj[:, dims.intermediate: dims.intermediate + dims.conv_dim], proj[:, -dims.num_heads:]
    slots = torch.tensor([4, 0, 6, 2, 3])
    states = MambaLayerCache(torch.randn(8, dims.conv_dim, dims.d_conv - 1),
                             torch.randn(8, dims.num_heads, dims.head_dim, dims.d_state))
    ref, before = _cpu(states), _cpu(states)
    meta = MambaStateMetadata(slots, slots.tolist(), [True, False, True, True, False], [states])
    a = -torch.exp(mixer.A_log.float())
    got = mixer._decode(xbc, dt, a, states, meta, 5)  # the C kernels
    monkeypatch.setattr(Mamba2Mixer, "_native_cpu", staticmethod(lambda xbc, cache: None))
    want = mixer._decode(xbc, dt, a, ref, MambaStateMetadata(slots, slots.tolist(), meta.has_initial_state, [ref]), 5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states.conv_state, ref.conv_state, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states.ssm_state, ref.ssm_state, atol=1e-5, rtol=1e-5)
    untouched = [1, 5, 7]
    assert torch.equal(states.ssm_state[untouched], before.ssm_state[untouched])
    assert torch.equal(states.conv_state[untouched], before.conv_state[untouched])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_kernel_matches_torch_path(state_dtype: torch.dtype) -> None:
    """Mamba-1's scan kernel (prefill chunks and decode rows in one launch, snapshots inside chunks) against the
    mixer's torch loop (model/layers/mamba1.py, itself checked against transformers in test_mamba_engine.py)."""
    from pagedllm.kernels.triton_mamba import selective_scan
    from pagedllm.model.layers.mamba1 import selective_scan_torch

    torch.manual_seed(0)
    channels, d_state = 40, 12
    lens, slots = [1, 1, 7, 13], [5, 0, 3, 6]
    snapshots = [(2, 4, 1), (3, 9, 2), (3, 12, 4)]  # (row, offset, slot)
    tokens = sum(lens)
    x, dt, z = (torch.randn(tokens, channels) for _ in range(3))
    a_log = torch.randn(channels, d_state) * 0.5
    b, c = torch.randn(tokens, d_state), torch.randn(tokens, d_state)
    d = torch.randn(channels)
    state = torch.randn(8, channels, 1, d_state).to(state_dtype)
    want_state = state.clone()
    y_ref = selective_scan_torch(x, torch.nn.functional.softplus(dt), -torch.exp(a_log), b, c, want_state, slots,
                                 lens, snapshots)
    want = (y_ref + x * d) * torch.nn.functional.silu(z)
    qsl = torch.tensor([0, 1, 2, 9, 22], device=DEVICE)
    got_state = state.to(DEVICE)
    got = selective_scan(*(t.to(DEVICE) for t in (x, dt, a_log, b, c, d, z)), got_state,
                         torch.tensor(slots, device=DEVICE), qsl, lens, snapshots)
    tol = 1e-4 if state_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(got_state.cpu().float(), want_state.float(), atol=tol, rtol=tol)


def test_mamba1_scan_c_kernel_matches_torch_path(kernels_by_isa) -> None:
    """Mamba-1's C scan (every ISA build this CPU runs: vector lanes and the scalar tail, with lanes past libmvec's
    range) against the torch loop: outputs, the states left in the slots and the snapshot slots, other slots intact."""
    from pagedllm.model.layers.mamba1 import selective_scan_torch

    torch.manual_seed(1)
    channels, lens, slots = 24, [1, 1, 7, 13], [5, 0, 3, 6]
    snapshots = [(2, 4, 1), (3, 9, 2), (3, 12, 4)]
    tokens = sum(lens)
    x = torch.randn(tokens, channels)
    dt = torch.nn.functional.softplus(torch.randn(tokens, channels) * 3)
    for d_state in (16, 20):  # whole vectors; a scalar tail
        a = -torch.exp(torch.randn(channels, d_state) * 2)  # some dt·A below -105
        b, c = torch.randn(tokens, d_state), torch.randn(tokens, d_state)
        state = torch.randn(8, channels, 1, d_state)
        want_state = state.clone()
        want = selective_scan_torch(x, dt, a, b, c, want_state, slots, lens, snapshots)
        for isa, native in kernels_by_isa.items():
            got_state = state.clone()
            got = native.mamba1_scan(x, dt, a, b, c, got_state, slots, lens, snapshots)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{isa}, {d_state}: {m}")
            torch.testing.assert_close(got_state, want_state, atol=1e-4, rtol=1e-4, msg=lambda m: f"{isa}: {m}")


@pytest.mark.parametrize("length,head_dim,d_state,groups", [(64, 16, 16, 2), (32, 24, 40, 1), (16, 64, 128, 4)])
def test_ssd_scan_kernels_match_torch_path(length: int, head_dim: int, d_state: int, groups: int) -> None:
    """The chunked Mamba-2 scan through its three Triton kernels (block states, carry, outputs; reading the packed
    tokens through the block layout's row map) against the torch form of model/layers/mamba2.py (checked against
    transformers in test_mamba2_layers.py): chunks of several blocks, one shorter than a block, snapshot cuts, initial
    states; x, B and C as the mixer passes them (views into one conv output: strided rows)."""
    from pagedllm.model.layers.mamba2 import scan_layout, ssd_varlen_scan

    torch.manual_seed(0)
    heads, lens = 4, [3 * length - 5, 7, 2 * length, length + 1]
    cuts = [[length // 2, length + 3], [], [length], []]
    total = sum(lens)
    inner, width = heads * head_dim, groups * d_state
    conv = torch.randn(total, inner + 2 * width)  # the conv output that x, B and C are views of
    x = conv[:, :inner].reshape(total, heads, head_dim)
    b = conv[:, inner: inner + width].reshape(total, groups, d_state)
    c = conv[:, inner + width:].reshape(total, groups, d_state)
    dt = torch.rand(total, heads) * 0.3
    a = -torch.rand(heads) * 2
    s0 = torch.randn(len(lens), heads, head_dim, d_state)
    want = ssd_varlen_scan(x, dt, a, b, c, s0, lens, length, cuts, kernels=False)
    conv_d = conv.to(DEVICE)
    args = (conv_d[:, :inner].reshape(total, heads, head_dim), dt.to(DEVICE), a.to(DEVICE),
            conv_d[:, inner: inner + width].reshape(total, groups, d_state),
            conv_d[:, inner + width:].reshape(total, groups, d_state), s0.to(DEVICE))
    layout = scan_layout(lens, length, cuts, torch.device(DEVICE))
    got = ssd_varlen_scan(*args, lens, length, cuts, layout, kernels=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="the scan takes its kernel path on a GPU only")
@pytest.mark.cuda
def test_ssd_varlen_scan_on_gpu_matches_cpu() -> None:
    """The whole varlen scan on a GPU (the kernel, the GPU carry) against the CPU's (torch) on the same inputs: chunks of
    several blocks, one shorter than a block, cuts."""
    from pagedllm.model.layers.mamba2 import ssd_varlen_scan

    torch.manual_seed(0)
    heads, head_dim, groups, d_state, lens = 8, 32, 2, 64, [200, 7, 64, 129]
    total = sum(lens)
    x = torch.randn(total, heads, head_dim)
    dt = torch.rand(total, heads) * 0.2
    a = -torch.rand(heads) * 2
    b, c = torch.randn(total, groups, d_state), torch.randn(total, groups, d_state)
    s0 = torch.randn(len(lens), heads, head_dim, d_state)
    cuts = [[64, 128], [], [32], []]
    want = ssd_varlen_scan(x, dt, a, b, c, s0, lens, 64, cuts)
    got = ssd_varlen_scan(*(t.cuda() for t in (x, dt, a, b, c, s0)), lens, 64, cuts)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, atol=2e-4, rtol=2e-4)


def test_ssd_carry_kernel_matches_torch_path() -> None:
    """The carry across a chunked scan's blocks in one launch against the CPU's walk (model/layers/mamba2.py): three
    sequences of 3, 1 and 2 blocks, non-zero initial states; a state larger than one program's slice."""
    from pagedllm.kernels.triton_mamba import SSD_CARRY_BLOCK, ssd_carry_states
    from pagedllm.model.layers.mamba2 import _carry_states, scan_layout

    torch.manual_seed(0)
    blocks, heads, head_dim, d_state = [3, 1, 2], 2, 24, SSD_CARRY_BLOCK // 16
    init = torch.randn(len(blocks), heads, head_dim, d_state)
    block_states = torch.randn(sum(blocks), heads, head_dim, d_state)
    decay = torch.rand(sum(blocks), heads)
    want_starts, want_final = _carry_states(init, block_states, decay,
                                            scan_layout([16 * n for n in blocks], 16, None, torch.device("cpu")))
    first = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE)
    got_starts, got_final = ssd_carry_states(init.to(DEVICE), block_states.to(DEVICE), decay.to(DEVICE), first,
                                             torch.tensor(blocks, dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(got_starts.cpu(), want_starts, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_final.cpu(), want_final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_kernel_matches_torch_path(state_dtype: torch.dtype) -> None:
    """The prefill conv in one launch (plus the saved-input updates) against the torch form of model/layers/mamba2.py:
    chunks longer and shorter than the conv's window (a 2-token chunk reads its slot's saved inputs for two taps and
    keeps one of them), snapshot cuts before and after the window's width, a strided input as the mixer passes it;
    other slots untouched."""
    from pagedllm.model.layers.mamba2 import causal_conv_prefill, conv_layout

    torch.manual_seed(0)
    channels, width, lens, slots = 200, 3, [9, 2, 40, 1], [4, 0, 2, 6]
    cuts, cut_slots = [(0, 2), (2, 5), (2, 31)], [1, 3, 5]
    total = sum(lens)
    proj = torch.randn(total, channels + 17).to(state_dtype)  # the conv input (the model's dtype, as the state's)
    weight = torch.randn(channels, 1, width + 1)
    bias = torch.randn(channels)
    state = torch.randn(8, channels, width).to(state_dtype)
    outs, states = [], []
    for kernels, dev in ((False, "cpu"), (True, DEVICE)):
        st = state.clone().to(dev)
        xbc = proj.to(dev)[:, 5: 5 + channels]
        layout = conv_layout(lens, width, cuts, torch.device(dev))
        out = causal_conv_prefill(xbc, st, weight.to(dev), bias.to(dev), torch.tensor(slots, device=dev), lens, cuts,
                                  torch.tensor(cut_slots, device=dev), layout, kernels=kernels)
        outs.append(out.cpu())
        states.append(st.cpu().float())
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    torch.testing.assert_close(states[1], states[0], atol=0, rtol=0)
    assert torch.equal(states[1][7], state[7].float())  # a slot no chunk owns


def test_mixer_prefill_through_kernels_matches_torch_path() -> None:
    """A Mamba-2 mixer's mixed step (two decode rows, then prefill chunks of 1, 5 and 37 tokens, one starting from
    zeros, one with a snapshot cut) with its prefill chunks through the Triton kernels (conv, scan; Triton's
    interpreter on CPU) against the torch path: outputs, the slots' conv and SSM states, the snapshot slot."""
    from pagedllm.kernels.metadata import AttentionMetadata

    torch.manual_seed(0)
    dims = Mamba2Dims(hidden_size=32, num_heads=6, head_dim=16, n_groups=2, d_state=16, d_conv=4)
    mixer = Mamba2Mixer(dims, TensorParallelGroup(), torch.float32, chunk_size=16)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.5)
    lens = [1, 1, 1, 5, 37]
    slots = [5, 0, 3, 6, 2]
    hidden = torch.randn(sum(lens), dims.hidden_size)
    conv0 = torch.randn(8, dims.conv_dim, dims.d_conv - 1)
    ssm0 = torch.randn(8, dims.num_heads, dims.head_dim, dims.d_state)
    results = []
    for kernels, dev in ((False, "cpu"), (True, DEVICE)):
        cache = MambaLayerCache(conv0.clone().to(dev), ssm0.clone().to(dev))
        state = MambaStateMetadata(torch.tensor(slots, device=dev), slots, [True, True, True, False, True], [cache],
                                   cuts=[(4, 20, 7)])
        meta = AttentionMetadata.__new__(AttentionMetadata)
        meta.mamba, meta.num_decodes, meta.query_lens_cpu = state, 2, lens
        mixer.prefill_kernels = kernels
        with torch.no_grad():
            out = mixer.to(dev)(hidden.to(dev), cache, meta)
        results.append((out.cpu(), cache.conv_state.cpu(), cache.ssm_state.cpu()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group_size,out_dtype", [(24, torch.float32), (64, torch.bfloat16)])
def test_gated_rms_norm_kernel_matches_torch_path(group_size: int, out_dtype: torch.dtype) -> None:
    """The mixer's gated norm in one launch against its torch form: groups whose size is not a power of two, a z that
    is a strided bfloat16 view (as the in-projection's split gives it), float32 and bfloat16 outputs."""
    from pagedllm.model.layers.mamba2 import _GatedNorm

    torch.manual_seed(0)
    size = 3 * group_size
    norm = _GatedNorm(size, group_size, 1e-5, torch.float32)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    y = torch.randn(7, size)
    z = torch.randn(7, size + 5).to(torch.bfloat16)[:, 5:]
    want = norm(y, z, out_dtype, kernel=False)
    got = norm.to(DEVICE)(y.to(DEVICE), z.to(DEVICE), out_dtype, kernel=True)
    assert got.dtype == out_dtype
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
