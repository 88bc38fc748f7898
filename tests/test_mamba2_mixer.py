"""The Mamba2 mixer (layers/mamba2.py) against transformers' own Mamba2Mixer on the same weights,
on its torch path: a prompt in one chunked pass, in pieces with states saved between them, and one
token at a time from the saved state (two sequences a step); every state is read from one slot and
written to others, slot 0 staying zero."""
from __future__ import annotations

import pytest
import torch

from tiny_mamba import mamba2_config, save_model
from tiny_recurrent import assert_mixer_close as assert_close, load_reference
from tiny_recurrent import mixer_reference_output as reference_output, run_mixer as run
from wallbreaker.formats.hf_model import read_hf_folder
from wallbreaker.layers.mamba2 import Mamba2Mixer
from wallbreaker.models.mamba2 import mamba2_mixer
from wallbreaker.layers.recurrent import StateSpan
from wallbreaker.models.source import WeightSource

LENGTH = 21  # three SSD chunks of 8 (the tiny model's chunk_size), the last one partial
SLOTS = 8


@pytest.fixture(scope="module", params=["default", "clamped", "torch-step"])
def mixers(request, tmp_path_factory, recurrent_folder):
    """(ours, transformers') layer-0 mixers, of the tiny Mamba2 the recurrent tests share. "clamped": a
    time_step_limit that binds (dt is ~0.001-0.1); "torch-step": short spans through the torch `step`
    rather than the C++ `step_in_pool`."""
    if request.param == "clamped":
        hf = mamba2_config(time_step_limit=(0.0, 0.02))
        folder = save_model(hf, tmp_path_factory.mktemp("mamba2_clamped") / "model")
    else:
        folder = recurrent_folder("mamba2")
    files = read_hf_folder(folder)
    ours = mamba2_mixer(files.config, 0, WeightSource(files.weights, torch.float32, packed=False))
    ours.state = [torch.zeros(SLOTS, *shape) for shape in ours.state_shapes()]
    ours.in_pool = request.param != "torch-step"
    return ours, load_reference(folder).backbone.layers[0].mixer


def inputs(seed: int, length: int = LENGTH) -> torch.Tensor:
    return torch.randn(length, 64, generator=torch.Generator().manual_seed(seed))


def clear(mixer: Mamba2Mixer) -> None:
    for p in mixer.state:
        p.zero_()


def test_one_chunked_pass_matches_transformers(mixers):
    ours, theirs = mixers
    clear(ours)
    x = inputs(0)
    assert_close(run(ours, x, [StateSpan(0, LENGTH, 0, [(LENGTH, 1)])]), reference_output(theirs, x))
    assert all(p[0].abs().max() == 0 for p in ours.state)  # slot 0 read, never written
    assert all(p[1].abs().max() > 0 for p in ours.state)


def test_pieces_with_saves_then_a_resumed_span_match_one_pass(mixers):
    ours, theirs = mixers
    clear(ours)
    x = inputs(1)
    expected = reference_output(theirs, x)
    assert_close(run(ours, x, [StateSpan(0, LENGTH, 0, [(1, 1), (5, 2), (13, 3), (LENGTH, 4)])]), expected)
    before = [p.clone() for p in ours.state]
    # resume after 5 tokens from slot 2, saving after 8 more and at the end
    assert_close(run(ours, x[5:], [StateSpan(0, LENGTH - 5, 2, [(8, 5), (LENGTH - 5, 6)])]), expected[5:])
    for p, b in zip(ours.state, before):
        assert torch.equal(p[:5], b[:5])  # the slot read and the others are untouched
        assert torch.allclose(p[5], b[3], rtol=1e-5, atol=1e-6)  # after 13 tokens, however they were cut
        assert torch.allclose(p[6], b[4], rtol=1e-5, atol=1e-6)


def test_token_by_token_for_two_sequences_at_once_matches_one_pass(mixers):
    ours, theirs = mixers
    clear(ours)
    xa, xb = inputs(2), inputs(3)
    outs = []
    src = (0, 0)  # (a's, b's) slot before the token; each step writes to the other pair
    for t in range(LENGTH):
        dst = (1, 2) if t % 2 == 0 else (3, 4)
        rows = torch.stack([xa[t], xb[t]])
        outs.append(run(ours, rows, [StateSpan(0, 1, src[0], [(1, dst[0])]), StateSpan(1, 1, src[1], [(1, dst[1])])]))
        src = dst
    ours_a, ours_b = torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
    assert_close(ours_a, reference_output(theirs, xa))
    assert_close(ours_b, reference_output(theirs, xb))
    assert all(p[0].abs().max() == 0 for p in ours.state)
    final = [p.clone() for p in ours.state]
    run(ours, xa, [StateSpan(0, LENGTH, 0, [(LENGTH, 7)])])  # the same sequence in one pass: the same state
    for p, f in zip(ours.state, final):
        assert torch.allclose(p[7], f[src[0]], rtol=1e-4, atol=1e-6)


def test_a_verification_that_logs_its_drafts_goes_on_as_the_reference(mixers):
    """A 5-token verification whose states after the drafts are logs (saves 2..5 rooted at save 1,
    as the block manager makes them), then one token from each kept draft's slot: the reference's
    outputs. The torch path (logs_drafts 0) writes whole states and ignores the logs' fields."""
    ours, theirs = mixers
    clear(ours)
    x = inputs(5, 8)
    expected = reference_output(theirs, x)
    run(ours, x[:2], [StateSpan(0, 2, 0, [(2, 1)])])
    assert ours.logs_drafts >= 4 or not ours.in_pool
    got = run(ours, x[2:7], [StateSpan(0, 5, 1, [(k, 1 + k) for k in range(1, 6)], log_after=1)])
    assert_close(got, expected[2:7])
    for j in range(2, 6):  # the state after the verification's first j tokens: slot 1 + j, logged over slot 2
        y = run(ours, x[2 + j:3 + j], [StateSpan(0, 1, 1 + j, [(1, 7)], src_root=2, src_entries=j - 1)])
        assert_close(y, expected[2 + j:3 + j])


def test_the_chunk_length_is_only_a_blocking_choice(tmp_path):
    """A model trained with 256-token chunks runs ours of 64 (layers/mamba2.py CPU_CHUNK): 150 tokens
    are one chunk for transformers, three for us, with the same outputs and state."""
    folder = save_model(mamba2_config(chunk_size=256), tmp_path / "model")
    files = read_hf_folder(folder)
    ours = mamba2_mixer(files.config, 0, WeightSource(files.weights, torch.float32, packed=False))
    ours.state = [torch.zeros(2, *shape) for shape in ours.state_shapes()]
    x = inputs(4, 150)
    assert ours.chunk_size < 150 <= files.config.ssm_chunk_size
    assert_close(run(ours, x, [StateSpan(0, 150, 0, [(150, 1)])]),
                 reference_output(load_reference(folder).backbone.layers[0].mixer, x))
