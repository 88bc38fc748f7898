"""layers/gated_delta.py against transformers' own Qwen3NextGatedDeltaNet on the same weights: a prompt
in one chunk, in pieces that continue from saved states, and token by token with sequences batched;
states written out of place (the slot read is unchanged, slot 0 stays zero)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_recurrent import no_fused_kernels

from wallbreaker.formats.qwen3_next import qkvz_rows
from wallbreaker.layers.gated_delta import GatedDeltaNet, chunked_delta_rule
from wallbreaker.layers.linear import Linear
from wallbreaker.layers.recurrent import StateMetadata, StateSpan

HIDDEN, K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL = 64, 2, 4, 16, 8, 4
SLOTS = 16


@pytest.fixture(scope="module")
def pair():
    """(transformers' module, ours on its weights), random weights with norms and dt_bias moved off
    their initial values."""
    assert not no_fused_kernels()
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
                          linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS, linear_key_head_dim=K_DIM,
                          linear_value_head_dim=V_DIM, linear_conv_kernel_dim=KERNEL, rms_norm_eps=1e-6)
    ref = Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        ref.dt_bias.add_(torch.randn(V_HEADS) * 0.5)
        ref.norm.weight.add_(torch.randn(V_DIM) * 0.2)
    qkv_rows, z_rows = qkvz_rows(K_HEADS, V_HEADS, K_DIM, V_DIM)
    w = ref.in_proj_qkvz.weight.detach()
    in_proj = Linear(torch.cat([w[qkv_rows], w[z_rows], ref.in_proj_ba.weight.detach()]))
    ours = GatedDeltaNet(in_proj, Linear(ref.out_proj.weight.detach()), ref.conv1d.weight.detach()[:, 0],
                         -ref.A_log.detach().exp(), ref.dt_bias.detach(), ref.norm.weight.detach(),
                         K_HEADS, V_HEADS, K_DIM, V_DIM, 1e-6)
    return ref, ours


def _bind(ours: GatedDeltaNet) -> list[torch.Tensor]:
    ours.state = [torch.zeros(SLOTS, *shape) for shape in ours.state_shapes()]
    return ours.state


def _run(ours: GatedDeltaNet, x: torch.Tensor, spans: list[StateSpan]) -> torch.Tensor:
    with torch.no_grad():
        return ours(x, SimpleNamespace(state=StateMetadata(spans)))


def _reference(ref, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(x[None])[0]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fused_kernel_packages_are_absent():
    assert no_fused_kernels() == []


def test_one_chunk(pair):
    ref, ours = pair
    _bind(ours)
    x = torch.randn(150, HIDDEN)  # three chunks of the chunked form, the last one partial
    _close(_run(ours, x, [StateSpan(0, 150, 0, [(150, 1)])]), _reference(ref, x))
    assert not ours.state[0][0].any() and not ours.state[1][0].any()


def test_pieces_continue_from_saved_states(pair):
    ref, ours = pair
    pool = _bind(ours)
    x = torch.randn(160, HIDDEN)
    expected = _reference(ref, x)
    first = _run(ours, x[:70], [StateSpan(0, 70, 0, [(2, 1), (5, 2), (70, 3)])])
    _close(first, expected[:70])
    kept = [p[3].clone() for p in pool]
    rest = _run(ours, x[70:], [StateSpan(0, 90, 3, [(90, 4)])])
    _close(rest, expected[70:])
    assert all(torch.equal(p[3], k) for p, k in zip(pool, kept))  # read, never written
    # from the state after 5 tokens (fewer than the kernel's history: the zero prefix is in it), then
    # after 2 (one row: the one-token form)
    _close(_run(ours, x[5:40], [StateSpan(0, 35, 2, [(35, 5)])]), expected[5:40])
    _close(_run(ours, x[2:3], [StateSpan(0, 1, 1, [])]), expected[2:3])
    # a span that keeps the state after each of its tokens (speculative verification), then two
    # short spans in one step, from two of those states
    _close(_run(ours, x[40:45], [StateSpan(0, 5, 5, [(k, 6 + k) for k in range(1, 6)])]), expected[40:45])
    both = _run(ours, torch.cat([x[43:46], x[41:44]]), [StateSpan(0, 3, 9, [(3, 13)]), StateSpan(3, 3, 7, [(2, 14)])])
    _close(both, torch.cat([expected[43:46], expected[41:44]]))
    for p in pool:
        torch.testing.assert_close(p[14], p[9], rtol=1e-4, atol=1e-5)
    _close(_run(ours, x[43:60], [StateSpan(0, 17, 9, [(17, 15)])]), expected[43:60])
    # the state after the whole prompt does not depend on the cut
    _run(ours, x, [StateSpan(0, 160, 0, [(160, 6)])])
    for p in pool:
        torch.testing.assert_close(p[6], p[4], rtol=1e-4, atol=1e-5)
    assert not pool[0][0].any() and not pool[1][0].any()


def test_token_by_token_batched(pair):
    ref, ours = pair
    _bind(ours)
    a, b = torch.randn(12, HIDDEN), torch.randn(9, HIDDEN)
    want_a, want_b = _reference(ref, a), _reference(ref, b)
    # two prompts prefilled in one step, then decode steps of both at once, alternating slots
    out = _run(ours, torch.cat([a[:4], b[:3]]), [StateSpan(0, 4, 0, [(4, 1)]), StateSpan(4, 3, 0, [(3, 2)])])
    _close(out, torch.cat([want_a[:4], want_b[:3]]))
    slots = {"a": 1, "b": 2}
    free = [3, 4, 5, 6]
    for t in range(6):
        meta = [StateSpan(0, 1, slots["a"], [(1, free[0])]), StateSpan(1, 1, slots["b"], [(1, free[1])])]
        out = _run(ours, torch.stack([a[4 + t], b[3 + t]]), meta)
        _close(out, torch.stack([want_a[4 + t], want_b[3 + t]]))
        free = free[2:] + [slots["a"], slots["b"]]
        slots = {"a": meta[0].saves[0][1], "b": meta[1].saves[0][1]}


def test_chunked_form_equals_the_recurrence():
    """The chunked delta rule against the token-by-token one it condenses, from a non-zero state,
    over lengths around the chunk size."""
    torch.manual_seed(1)
    heads, dk, dv = 3, 8, 5
    for length in (1, 7, 16, 33):
        q, k = torch.nn.functional.normalize(torch.randn(2, heads, length, dk), dim=-1)
        v, s0 = torch.randn(heads, length, dv), torch.randn(heads, dk, dv)
        g, beta = -torch.rand(heads, length), torch.rand(heads, length)
        out, s = chunked_delta_rule(q, k, v, g, beta, s0, chunk=16)
        state, rows = s0, []
        for t in range(length):
            state = state * g[:, t, None, None].exp()
            kt = k[:, t]
            delta = (v[:, t] - torch.einsum("hkv,hk->hv", state, kt)) * beta[:, t, None]
            state = state + kt[:, :, None] * delta[:, None, :]
            rows.append(torch.einsum("hkv,hk->hv", state, q[:, t]))
        torch.testing.assert_close(out, torch.stack(rows, 1), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, state, rtol=1e-4, atol=1e-5)
