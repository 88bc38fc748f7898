"""The C++ token-by-token recurrences (csrc/recurrent_ops.cpp) against transformers' own torch
ones on the same inputs: Mamba2's `mamba2_selective_state_update` and Qwen3-Next's
`torch_recurrent_gated_delta_rule`; the short convolution (LFM2's, Mamba2's conv1d) against
PyTorch's depthwise `conv1d`. The kernels read each sequence's state from one slot of a pool,
run T tokens, and write the state after token t to slot dst[b, t] where one is given, leaving
every other slot as it was."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wallbreaker import _C

# dst per step count: a decode step, and a verification whose middle state is not kept
DST = {1: [[2], [5], [7]], 3: [[2, -1, 3], [5, 6, 8], [-1, -1, 7]]}
SRC = [1, 4, 1]  # the first and last sequence share a slot, as forks do


def untouched(pool, before, dst):
    keep = [s for s in range(pool.shape[0]) if s not in {d for row in dst for d in row}]
    return torch.equal(pool[keep], before[keep])


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("d_state", [32, 20])  # 20: the vector loop and the scalar tail
def test_ssm_step_matches_transformers_and_writes_out_of_place(steps, d_state):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update
    torch.manual_seed(0)
    batch, heads, head_dim, groups, slots = 3, 8, 16, 2, 10
    pool = torch.randn(slots, heads, head_dim, d_state)
    before = pool.clone()
    x = torch.randn(batch, steps, heads, head_dim)
    B, C = torch.randn(batch, steps, groups, d_state), torch.randn(batch, steps, groups, d_state)
    dt_raw, dt_bias = torch.randn(batch, steps, heads), torch.randn(heads)
    A, D = -torch.rand(heads) * 4, torch.randn(heads)
    y = _C.ssm_step(pool, torch.tensor(SRC), torch.tensor(DST[steps]), x, B, C, F.softplus(dt_raw + dt_bias), A, D)
    state = before[SRC].clone()
    for t in range(steps):
        expected = mamba2_selective_state_update(
            state, x[:, t], dt_raw[:, t, :, None].expand(-1, -1, head_dim), A[:, None, None].expand(-1, head_dim, d_state),
            B[:, t], C[:, t], D[:, None].expand(-1, head_dim), dt_bias[:, None].expand(-1, head_dim), dt_softplus=True)
        torch.testing.assert_close(y[:, t], expected, rtol=1e-5, atol=1e-5)
        for b in range(batch):
            if DST[steps][b][t] >= 0:
                torch.testing.assert_close(pool[DST[steps][b][t]], state[b], rtol=1e-5, atol=1e-5)
    assert untouched(pool, before, DST[steps])


@pytest.mark.parametrize("k_heads,v_heads,steps", [(4, 4, 1), (2, 4, 1), (2, 4, 3)])
def test_delta_step_matches_transformers_and_writes_out_of_place(k_heads, v_heads, steps):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule
    torch.manual_seed(1)
    batch, k_dim, v_dim, slots = 3, 16, 24, 10
    pool = torch.randn(slots, v_heads, k_dim, v_dim) * 0.1
    before = pool.clone()
    q, k = torch.randn(batch, steps, k_heads, k_dim), torch.randn(batch, steps, k_heads, k_dim)
    v = torch.randn(batch, steps, v_heads, v_dim)
    g, beta = -torch.rand(batch, steps, v_heads), torch.rand(batch, steps, v_heads)
    group = v_heads // k_heads
    qn = (F.normalize(q, dim=-1, eps=1e-6) / k_dim ** 0.5).repeat_interleave(group, 2).contiguous()
    kn = F.normalize(k, dim=-1, eps=1e-6).repeat_interleave(group, 2).contiguous()
    o = _C.delta_step(pool, torch.tensor(SRC), torch.tensor(DST[steps]), qn, kn, v, g, beta)
    for t in range(steps):
        expected, final = torch_recurrent_gated_delta_rule(
            q[:, :t + 1], k[:, :t + 1], v[:, :t + 1], g[:, :t + 1], beta[:, :t + 1], initial_state=before[SRC].clone(),
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, t], expected[:, t], rtol=1e-5, atol=1e-5)
        for b in range(batch):
            if DST[steps][b][t] >= 0:
                torch.testing.assert_close(pool[DST[steps][b][t]], final[b], rtol=1e-5, atol=1e-5)
    assert untouched(pool, before, DST[steps])


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("bias_and_silu", [False, True], ids=["lfm2", "mamba2"])
def test_conv_step_matches_torch_conv1d_and_writes_out_of_place(steps, bias_and_silu):
    torch.manual_seed(0)
    batch, kernel, channels, slots = 3, 4, 37, 10  # 37 channels: two 16-lane vectors and a tail
    pool = torch.randn(slots, kernel - 1, channels)
    before = pool.clone()
    x = torch.randn(batch, steps + 1, channels)[:, 1:]  # rows strided, as a projection's split gives them
    taps = torch.randn(kernel, channels)  # tap k multiplies the input kernel - 1 - k tokens back
    bias = torch.randn(channels) if bias_and_silu else None
    out = _C.conv_step(pool, torch.tensor(SRC), torch.tensor(DST[steps]), x, taps, bias, bias_and_silu)
    window = torch.cat([before[SRC], x], dim=1)  # [B, K - 1 + T, C]
    expected = F.conv1d(window.transpose(1, 2), taps.t()[:, None], bias, groups=channels).transpose(1, 2)
    torch.testing.assert_close(out, F.silu(expected) if bias_and_silu else expected, rtol=1e-5, atol=1e-5)
    for b in range(batch):
        for t in range(steps):
            if DST[steps][b][t] >= 0:
                assert torch.equal(pool[DST[steps][b][t]], window[b, t + 1:t + kernel])
    assert untouched(pool, before, DST[steps])


def test_kernels_refuse_a_slot_outside_the_pool_or_writing_the_one_read():
    pool = torch.zeros(3, 1, 1, 4)
    args = (torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1),
            torch.zeros(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="slot out of range"):
        _C.ssm_step(pool, torch.tensor([0]), torch.tensor([[3]]), *args)
    with pytest.raises(RuntimeError, match="out of place"):
        _C.ssm_step(pool, torch.tensor([1]), torch.tensor([[1]]), *args)
    with pytest.raises(RuntimeError, match="out of place"):
        _C.conv_step(torch.zeros(3, 2, 4), torch.tensor([1]), torch.tensor([[1]]), torch.zeros(1, 1, 4),
                     torch.zeros(3, 4), None, False)


def _ssm_inputs(batch, steps, heads, head_dim, groups, d_state, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, steps, heads, head_dim, generator=g), torch.randn(batch, steps, groups, d_state, generator=g),
            torch.randn(batch, steps, groups, d_state, generator=g), torch.rand(batch, steps, heads, generator=g))


@pytest.mark.parametrize("d_state", [32, 20])
def test_ssm_step_logged_states_replay_to_the_same_bits(d_state):
    """A verification that logs the states after its drafts (saves 2..5 as logs rooted at save 1)
    gives the outputs of one that writes them whole, bit for bit; and a step from each logged slot
    (the root's state replayed through its entries) gives the outputs and state of one from the
    whole slot, bit for bit, as greedy decoding with and without speculation needs."""
    torch.manual_seed(2)
    batch, heads, head_dim, groups, steps = 2, 4, 16, 2, 5
    A, D = -torch.rand(heads) * 4, torch.randn(heads)
    whole = torch.randn(40, heads, head_dim, d_state)
    logged_pool = whole.clone()
    src = torch.tensor([1, 2])
    verify = _ssm_inputs(batch, steps, heads, head_dim, groups, d_state, 0)
    dst_whole = torch.tensor([[10 + t for t in range(steps)], [20 + t for t in range(steps)]])
    y_whole = _C.ssm_step(whole, src, dst_whole, *verify, A, D)
    y_logged = _C.ssm_step(logged_pool, src, dst_whole, *verify, A, D,
                           torch.tensor([[-1, 0, 1], [-1, 0, 1]]))  # tokens 1.. logged
    assert torch.equal(y_whole, y_logged)
    assert torch.equal(logged_pool[10], whole[10]) and torch.equal(logged_pool[20], whole[20])  # the roots, whole
    assert not torch.equal(logged_pool[12], whole[12])  # a log, not the state
    for t in range(1, steps):  # the next step from each kept draft
        nxt = _ssm_inputs(batch, 2, heads, head_dim, groups, d_state, t)
        out_whole = _C.ssm_step(whole, dst_whole[:, t].contiguous(), torch.tensor([[30, -1], [31, -1]]), *nxt, A, D)
        out_logged = _C.ssm_step(logged_pool, dst_whole[:, t].contiguous(), torch.tensor([[30, -1], [31, -1]]), *nxt, A, D,
                                 torch.tensor([[10, t, 2], [20, t, 2]]))
        assert torch.equal(out_whole, out_logged)
        assert torch.equal(whole[30:32], logged_pool[30:32])


def test_ssm_step_refuses_logs_it_cannot_read():
    pool = torch.zeros(8, 2, 4, 4)  # room for one entry a head (4 + 4 + 1 of 16)
    args = (torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2),
            torch.zeros(2), torch.zeros(2))
    src, dst = torch.tensor([1]), torch.tensor([[2, 3]])
    with pytest.raises(RuntimeError, match="entries"):
        _C.ssm_step(pool, src, dst, *args, torch.tensor([[4, 2, 2]]))
    with pytest.raises(RuntimeError, match="root"):
        _C.ssm_step(pool, src, dst, *args, torch.tensor([[2, 1, 2]]))
    with pytest.raises(RuntimeError, match="saved whole"):
        _C.ssm_step(pool, src, torch.tensor([[-1, 3]]), *args, torch.tensor([[-1, 0, 1]]))
