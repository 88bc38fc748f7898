"""The Mamba (v1) mixer (layers/mamba.py) against transformers' own MambaMixer (and Falcon-Mamba's) on
the same weights, token by token from saved states: through the C++ forms on the pool
(`_C.conv_step`, `_C.ssm1_step`) and through the torch forms they replace; a span of several tokens
with a save after each (a verification step); every state read from one slot and written to others."""
from __future__ import annotations

import pytest
import torch

from tiny_recurrent import assert_mixer_close as assert_close, load_reference
from tiny_recurrent import mixer_reference_output as reference_output, run_mixer as run
from wallbreaker.formats.hf_model import read_hf_folder
from wallbreaker.layers.recurrent import StateSpan
from wallbreaker.models.mamba import mamba_mixer
from wallbreaker.models.source import WeightSource

LENGTH, SLOTS = 13, 12


@pytest.fixture(scope="module", params=[("mamba", True), ("mamba", False), ("falcon_mamba", True)],
                ids=["mamba-pool", "mamba-torch", "falcon_mamba-pool"])
def mixers(request, recurrent_folder):
    """(ours, transformers') layer-0 mixers of the tiny model; ours with short spans on the pool (C++)
    or through the torch forms."""
    arch, in_pool = request.param
    folder = recurrent_folder(arch)
    files = read_hf_folder(folder)
    ours = mamba_mixer(files.config, 0, WeightSource(files.weights, torch.float32, packed=False))
    ours.state = [torch.zeros(SLOTS, *shape) for shape in ours.state_shapes()]
    ours.in_pool = in_pool
    return ours, load_reference(folder).backbone.layers[0].mixer, files.config.hidden_size


def inputs(seed: int, hidden: int) -> torch.Tensor:
    return torch.randn(LENGTH, hidden, generator=torch.Generator().manual_seed(seed))


def test_token_by_token_for_two_sequences_at_once_matches_transformers(mixers):
    ours, theirs, hidden = mixers
    for p in ours.state:
        p.zero_()
    xa, xb = inputs(0, hidden), inputs(1, hidden)
    outs, src = [], (0, 0)  # (a's, b's) slot before the token; each step writes to the other pair
    for t in range(LENGTH):
        dst = (1, 2) if t % 2 == 0 else (3, 4)
        rows = torch.stack([xa[t], xb[t]])
        outs.append(run(ours, rows, [StateSpan(0, 1, src[0], [(1, dst[0])]), StateSpan(1, 1, src[1], [(1, dst[1])])]))
        src = dst
    assert_close(torch.stack([o[0] for o in outs]), reference_output(theirs, xa))
    assert_close(torch.stack([o[1] for o in outs]), reference_output(theirs, xb))
    assert all(p[0].abs().max() == 0 for p in ours.state)  # slot 0 read, never written


def test_a_verification_span_keeps_each_tokens_state(mixers):
    """After 8 tokens token by token, the next 5 in one span saving after each (slots 6..10): the
    outputs are transformers', and each saved state is the one token-by-token decoding reaches."""
    ours, theirs, hidden = mixers
    for p in ours.state:
        p.zero_()
    x = inputs(2, hidden)
    expected = reference_output(theirs, x)
    src = 0
    for t in range(8):
        dst = 1 + t % 2
        run(ours, x[t:t + 1], [StateSpan(0, 1, src, [(1, dst)])])
        src = dst
    got = run(ours, x[8:], [StateSpan(0, 5, src, [(k, 5 + k) for k in range(1, 6)])])
    assert_close(got, expected[8:])
    after_10 = [p[7].clone() for p in ours.state]  # the state after token 10 (8 + 2)
    run(ours, x[8:10], [StateSpan(0, 2, src, [(2, 11)])])
    for p, saved in zip(ours.state, after_10):
        assert torch.allclose(p[11], saved, rtol=1e-5, atol=1e-6)
