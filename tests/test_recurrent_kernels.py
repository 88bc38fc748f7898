"""The C++ one-token recurrences (csrc/recurrent_ops.cpp) against transformers' own torch ones on
the same inputs: Mamba2's `mamba2_selective_state_update` and Qwen3-Next's
`torch_recurrent_gated_delta_rule`. The kernels read each sequence's state from one slot of a pool
and write the new state to another, leaving the first as it was."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wallbreaker import _C


def test_ssm_step_matches_transformers_and_writes_out_of_place():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update
    torch.manual_seed(0)
    batch, heads, head_dim, d_state, groups, slots = 3, 8, 16, 32, 2, 10
    pool = torch.randn(slots, heads, head_dim, d_state)
    before = pool.clone()
    src, dst = torch.tensor([1, 4, 1]), torch.tensor([2, 5, 7])
    x = torch.randn(batch, heads, head_dim)
    B, C = torch.randn(batch, groups, d_state), torch.randn(batch, groups, d_state)
    dt_raw, dt_bias = torch.randn(batch, heads), torch.randn(heads)
    A, D = -torch.rand(heads) * 4, torch.randn(heads)
    state = pool[src].clone()
    expected = mamba2_selective_state_update(state, x, dt_raw[..., None].expand(-1, -1, head_dim),
                                             A[:, None, None].expand(-1, head_dim, d_state), B, C,
                                             D[:, None].expand(-1, head_dim),
                                             dt_bias[:, None].expand(-1, head_dim), dt_softplus=True)
    y = _C.ssm_step(pool, src, dst, x, B, C, F.softplus(dt_raw + dt_bias), A, D)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[dst], state, rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(slots) if s not in dst.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("k_heads,v_heads", [(4, 4), (2, 4)])
def test_delta_step_matches_transformers_and_writes_out_of_place(k_heads, v_heads):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule
    torch.manual_seed(1)
    batch, k_dim, v_dim, slots = 3, 16, 24, 8
    pool = torch.randn(slots, v_heads, k_dim, v_dim) * 0.1
    before = pool.clone()
    src, dst = torch.tensor([0, 3, 3]), torch.tensor([1, 2, 6])
    q, k = torch.randn(batch, 1, k_heads, k_dim), torch.randn(batch, 1, k_heads, k_dim)
    v = torch.randn(batch, 1, v_heads, v_dim)
    g, beta = -torch.rand(batch, 1, v_heads), torch.rand(batch, 1, v_heads)
    expected, final = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool[src].clone(),
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    group = v_heads // k_heads
    qn = (F.normalize(q[:, 0], dim=-1, eps=1e-6) / k_dim ** 0.5).repeat_interleave(group, 1).contiguous()
    kn = F.normalize(k[:, 0], dim=-1, eps=1e-6).repeat_interleave(group, 1).contiguous()
    o = _C.delta_step(pool, src, dst, qn, kn, v[:, 0].contiguous(), g[:, 0].contiguous(), beta[:, 0].contiguous())
    torch.testing.assert_close(o, expected[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[dst], final, rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(slots) if s not in dst.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_kernels_refuse_a_slot_outside_the_pool():
    pool = torch.zeros(2, 1, 1, 4)
    with pytest.raises(RuntimeError, match="slot out of range"):
        _C.ssm_step(pool, torch.tensor([0]), torch.tensor([2]), torch.zeros(1, 1, 1), torch.zeros(1, 1, 4),
                    torch.zeros(1, 1, 4), torch.zeros(1, 1), torch.zeros(1), torch.zeros(1))
