"""layers/short_conv.py against transformers' Lfm2ShortConv on the same weights: a prompt in one
chunk, in pieces resumed from saved slots, and one token at a time for several sequences at once,
through the in-pool form and through `step` and `chunk`;
the states handed to the recurrence are never written (slot 0 stays zero, a source slot keeps its
state)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wallbreaker.layers.linear import Linear
from wallbreaker.layers.recurrent import StateMetadata, StateSpan
from wallbreaker.layers.short_conv import ShortConv

HIDDEN = 24
SLOTS = 8


@pytest.fixture(scope="module", params=[(3, True), (4, True), (3, False), (4, False)],
                ids=["kernel3", "kernel4", "kernel3-by-piece", "kernel4-by-piece"])
def pair(request):
    """(transformers' module, ours) with the same random weights; "by-piece": without `step_in_pool`,
    so that scan_spans runs every span through `step` and `chunk`."""
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
    kernel, in_pool = request.param
    torch.manual_seed(kernel)
    config = Lfm2Config(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["conv"], conv_L_cache=kernel)
    ref = Lfm2ShortConv(config, 0).eval()
    with torch.no_grad():
        ref.conv.weight.normal_()
    ours = ShortConv(Linear(ref.in_proj.weight.detach().clone()), ref.conv.weight.detach()[:, 0].clone(),
                     Linear(ref.out_proj.weight.detach().clone()))
    if not in_pool:
        ours.step_in_pool = None
    return ref, ours


def reference(ref, x: torch.Tensor) -> torch.Tensor:
    """transformers' output for a whole sequence [L, hidden] (no cache: the causal convolution over it)."""
    with torch.no_grad():
        return ref(x.unsqueeze(0))[0]


def bind_pool(mixer: ShortConv) -> list[torch.Tensor]:
    mixer.state = [torch.zeros(SLOTS, *shape) for shape in mixer.state_shapes()]
    return mixer.state


def run(mixer: ShortConv, x: torch.Tensor, spans: list[StateSpan]) -> torch.Tensor:
    with torch.no_grad():
        return mixer(x, SimpleNamespace(state=StateMetadata(spans)))


def test_state_is_the_last_kernel_minus_one_conv_inputs(pair):
    ref, ours = pair
    assert ours.state_shapes() == [(ref.conv_kernel_size - 1, HIDDEN)]


def test_one_chunk_matches_transformers_and_saves_the_state(pair):
    ref, ours = pair
    pool = bind_pool(ours)
    x = torch.randn(11, HIDDEN)
    out = run(ours, x, [StateSpan(0, 11, 0, [(11, 3)])])
    torch.testing.assert_close(out, reference(ref, x), rtol=1e-5, atol=1e-5)
    b, _, v = (x @ ref.in_proj.weight.T).chunk(3, dim=-1)
    torch.testing.assert_close(pool[0][3], (b * v)[-(ref.conv_kernel_size - 1):], rtol=1e-6, atol=1e-6)
    assert not pool[0][0].any()


def test_pieces_resumed_from_saved_slots_match_one_pass(pair):
    """Saves inside a span and spans that start from a saved slot give what one pass gives; the
    source slot is left as it was."""
    ref, ours = pair
    pool = bind_pool(ours)
    x = torch.randn(13, HIDDEN)
    want = reference(ref, x)
    # one-token pieces, then chunks shorter than the state (whose new state keeps some of the old)
    first = run(ours, x[:6], [StateSpan(0, 6, 0, [(1, 1), (2, 2), (4, 7), (6, 3)])])
    kept = pool[0][3].clone()
    second = run(ours, x[6:], [StateSpan(0, 7, 3, [(3, 4), (7, 5)])])
    torch.testing.assert_close(torch.cat([first, second]), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[0][3], kept, rtol=0, atol=0)
    assert not pool[0][0].any()
    again = run(ours, x[9:], [StateSpan(0, 4, 4, [(4, 6)])])  # resumed from the checkpoint after 9 tokens
    torch.testing.assert_close(again, want[9:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[0][6], pool[0][5], rtol=1e-6, atol=1e-6)


def test_a_long_prompt_with_checkpoints_matches_transformers(pair):
    """A span longer than what scan_spans gives the one-token form (MAX_STEP_TOKENS): cut at its
    saves into one-token pieces and chunks."""
    ref, ours = pair
    pool = bind_pool(ours)
    x = torch.randn(45, HIDDEN)
    want = reference(ref, x)
    out = run(ours, x, [StateSpan(0, 45, 0, [(1, 1), (2, 2), (20, 3), (21, 4), (45, 5)])])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    resumed = run(ours, x[21:], [StateSpan(0, 24, 4, [(24, 6)])])
    torch.testing.assert_close(resumed, want[21:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[0][6], pool[0][5], rtol=1e-6, atol=1e-6)
    assert not pool[0][0].any()


def test_token_by_token_for_several_sequences_matches_transformers(pair):
    """A decode step computes every sequence's token at once (the one-token form), each from its
    own slot into another, as the scheduler alternates them."""
    ref, ours = pair
    pool = bind_pool(ours)
    xs = [torch.randn(7, HIDDEN), torch.randn(7, HIDDEN)]
    src, outs = [0, 0], [[], []]
    for t in range(7):
        dst = [1 + (t % 2) * 2, 2 + (t % 2) * 2]  # slots 1, 2 then 3, 4, alternating
        step = torch.stack([xs[0][t], xs[1][t]])
        out = run(ours, step, [StateSpan(0, 1, src[0], [(1, dst[0])]), StateSpan(1, 1, src[1], [(1, dst[1])])])
        outs[0].append(out[0])
        outs[1].append(out[1])
        src = dst
    for x, out in zip(xs, outs):
        torch.testing.assert_close(torch.stack(out), reference(ref, x), rtol=1e-5, atol=1e-5)
    assert not pool[0][0].any()


def test_a_prefill_and_a_decode_in_one_step(pair):
    """A step holding one sequence's chunk beside another's single token (rows in span order)."""
    ref, ours = pair
    pool = bind_pool(ours)
    a, b = torch.randn(5, HIDDEN), torch.randn(9, HIDDEN)
    run(ours, b[:8], [StateSpan(0, 8, 0, [(8, 1)])])
    out = run(ours, torch.cat([a, b[8:]]), [StateSpan(0, 5, 0, [(5, 2)]), StateSpan(5, 1, 1, [(1, 3)])])
    torch.testing.assert_close(out[:5], reference(ref, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[5], reference(ref, b)[8], rtol=1e-5, atol=1e-5)
    assert not pool[0][0].any()


def test_verifying_drafts_of_several_sequences_keeps_the_states_asked_for(pair):
    """Spans of one length from different slots (a speculative step: the state after each draft),
    some positions' states kept and others not; each kept one resumes exactly."""
    ref, ours = pair
    pool = bind_pool(ours)
    a, b = torch.randn(9, HIDDEN), torch.randn(9, HIDDEN)
    run(ours, torch.cat([a[:5], b[:5]]), [StateSpan(0, 5, 0, [(5, 1)]), StateSpan(5, 5, 0, [(5, 2)])])
    kept = pool[0][1].clone()
    out = run(ours, torch.cat([a[5:], b[5:]]),
              [StateSpan(0, 4, 1, [(2, 3), (4, 4)]), StateSpan(4, 4, 2, [(1, 5), (3, 6), (4, 7)])])
    torch.testing.assert_close(out[:4], reference(ref, a)[5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[4:], reference(ref, b)[5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[0][1], kept, rtol=0, atol=0)
    resumed = run(ours, a[7:], [StateSpan(0, 2, 3, [(2, 4)])])  # from the state after a's 7th token
    torch.testing.assert_close(resumed, reference(ref, a)[7:], rtol=1e-5, atol=1e-5)
    assert not pool[0][0].any()


def test_no_fused_kernel_package_is_importable():
    """transformers' reference runs its own torch convolution only when causal_conv1d is absent."""
    from tiny_recurrent import no_fused_kernels
    assert no_fused_kernels() == []
