"""RWKV-7 (models/rwkv7.py) end to end against BlinkDL's PyPI `rwkv` (its x070 model, CPU, float32, pure
PyTorch) on the same random weights, from fla-hub's Hugging Face layout and from llama.cpp's converter's
GGUF of it; its WKV update in C++ (`_C.wkv7_step`, each kernel level) against BlinkDL's formula; and
the engine's behaviours on its states (batching, chunked prefill, n-gram speculation, the prefix
cache, preemption, a saved session, the disk tier) giving the tokens of each request alone."""
from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from llamacpp_converter import convert
from tiny_recurrent import GREEDY, GREEDY_TOKENS, PROMPTS, TEXT, TIE, holds_only_checkpoints, make_llm
from tiny_rwkv7 import HEAD, HIDDEN, blinkdl_reference, save_tiny_rwkv7, with_tokenizer_of
from wallbreaker import _C, LLM, SamplingParams
from wallbreaker.formats.packaged import packaged_model_path

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_rwkv7(tmp_path_factory.mktemp("rwkv7"))


@pytest.fixture(scope="module")
def folder(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def reference(tiny):
    return blinkdl_reference(tiny[1])


@pytest.fixture(scope="module")
def gguf_f32(folder, llamacpp_converter):
    """The converter's GGUF, with SmolLM2's tokenizer keys in place of its RWKV World ones."""
    converted = convert(llamacpp_converter, folder, "f32", folder.parent / "rwkv7-f32.gguf")
    return with_tokenizer_of(converted, packaged_model_path("smollm2"), folder.parent / "rwkv7-f32-smollm2.gguf")


def rwkv_llm(path, **options) -> LLM:
    """max_model_len: without attention the block table only keys the prefix cache (as Mamba's)."""
    return make_llm(path, **{"max_model_len": 2048, **options})


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    logits, _ = reference.forward(list(ids), None, full_output=True)
    return logits.float()


def assert_greedy_is_the_references(reference, prompt: list[int], ours: list[int]) -> None:
    """`ours` is BlinkDL's greedy continuation (its state carried token to token), up to a tie."""
    logits, state = reference.forward(list(prompt), None)
    for i, token in enumerate(ours):
        top = torch.topk(logits.float(), 2)
        if token != int(top.indices[0]):
            assert float(top.values[0] - top.values[1]) < TIE and token == int(top.indices[1]), \
                f"token {i}: ours {token}, rwkv's {int(top.indices[0])} (not a tie)"
            return
        logits, state = reference.forward([token], state)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_matches_blinkdl_rwkv(request, folder, reference, source):
    """Teacher-forced logits over 60 tokens to 1e-4 of their range, and 12 greedy tokens after each prompt."""
    llm = rwkv_llm(request.getfixturevalue("gguf_f32") if source == "gguf" else folder)
    assert llm.model_config.architecture == "rwkv7" and llm.model_config.num_attention_layers == 0
    ids = llm.tokenizer.encode(TEXT)[:60]
    expected = reference_logits(reference, ids)
    assert ((llm.logits(ids) - expected).abs().max() / (expected.max() - expected.min())).item() < 1e-4
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    for p, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)):
        assert len(out.outputs[0].token_ids) == GREEDY_TOKENS
        assert_greedy_is_the_references(reference, p, out.outputs[0].token_ids)


def test_gguf_config_is_the_folders(folder, gguf_f32):
    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.formats.hf_model import read_hf_folder
    hf, gg = read_hf_folder(folder).config, read_gguf_model(gguf_f32).config
    assert gg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)  # a float32 epsilon in the GGUF
    assert dataclasses.replace(gg, rms_norm_eps=hf.rms_norm_eps, bos_token_id=hf.bos_token_id,
                               eos_token_ids=hf.eos_token_ids) == hf


def test_our_gguf_writer_round_trip_matches_blinkdl_rwkv(tmp_path, folder, gguf_f32, reference):
    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.formats.gguf_writer import write_gguf
    from wallbreaker.formats.hf_model import read_hf_folder
    from wallbreaker.quant.export import gguf_tokenizer_metadata
    files = read_hf_folder(folder)
    tokenizer = gguf_tokenizer_metadata(read_gguf_model(gguf_f32).metadata)
    path = write_gguf(tmp_path / "ours.gguf", files.config, {n: r.load() for n, r in files.weights.items()}, tokenizer)
    llm = rwkv_llm(path)
    ids = llm.tokenizer.encode(TEXT)[:40]
    expected = reference_logits(reference, ids)
    assert ((llm.logits(ids) - expected).abs().max() / (expected.max() - expected.min())).item() < 1e-4


def test_refuses_what_it_does_not_run(tmp_path, folder, gguf_f32):
    import json
    import shutil

    from wallbreaker.errors import UnsupportedModelError
    bad = tmp_path / "hf"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "wkv_has_gate": False}))
    with pytest.raises(UnsupportedModelError, match="wkv_has_gate"):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps({**config, "value_dim": [32, 32]}))
    with pytest.raises(UnsupportedModelError, match="value_dim"):
        LLM(str(bad))
    with pytest.raises(Exception, match="tensor parallelism"):
        LLM(str(folder), tensor_parallel_size=2)


def test_the_converters_world_tokenizer_encodes_as_blinkdls(folder, gguf_f32):
    """The converter's own GGUF (its RWKV World vocabulary: the folder's vocabulary file, "<s>" first)
    loads, and encodes as BlinkDL's TRIE_TOKENIZER on that file."""
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.text.rwkv_world import VOCAB_FILE
    ours = read_gguf_model(gguf_f32.parent / "rwkv7-f32.gguf").tokenizer
    text = "The quick brown fox, 中文, emoji 🚀\n\n\tand code: x = f(y) ** 2"
    assert ours.encode(text) == TRIE_TOKENIZER(str(folder / VOCAB_FILE)).encode(text)
    assert ours.decode(ours.encode(text)) == text


# -- the C++ WKV update ---------------------------------------------------------------------------
@pytest.fixture(params=["generic", "avx2", "avx512"])
def kernel_level(request):
    before = _C.isa()
    try:
        _C.set_isa(request.param)
    except Exception:
        pytest.skip(f"this CPU has no {request.param} level")
    yield request.param
    _C.set_isa(before)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("head", [32, 20])  # 20: the vector loop and the scalar tail
def test_wkv7_step_matches_blinkdl_update_and_writes_out_of_place(kernel_level, steps, head):
    """BlinkDL's form (RWKV_x070_TMix_seq): S = S * w + S @ ((-kk)^T (kk a)) + v^T k; y = S r."""
    torch.manual_seed(0)
    src, dst = [1, 4, 1], {1: [[2], [5], [7]], 3: [[2, -1, 3], [5, 6, 8], [-1, -1, 7]]}[steps]
    batch, heads, slots = 3, 2, 10
    pool = torch.randn(slots, heads, head, head) * 0.3
    before = pool.clone()
    r, k, v = (torch.randn(batch, steps, heads, head) for _ in range(3))
    w = torch.exp(-0.606531 * torch.rand(batch, steps, heads, head))
    kk = torch.nn.functional.normalize(torch.randn(batch, steps, heads, head), dim=-1)
    a = torch.rand(batch, steps, heads, head)
    y = _C.wkv7_step(pool, torch.tensor(src), torch.tensor(dst), r, w, k, v, -kk, kk * a)
    state = before[src].clone()
    for t in range(steps):
        ab = (-kk[:, t])[..., :, None] @ (kk[:, t] * a[:, t])[..., None, :]
        state = state * w[:, t, :, None, :] + state @ ab + v[:, t, :, :, None] @ k[:, t, :, None, :]
        torch.testing.assert_close(y[:, t], (state @ r[:, t, :, :, None])[..., 0], rtol=1e-5, atol=1e-5)
        for b in range(batch):
            if dst[b][t] >= 0:
                torch.testing.assert_close(pool[dst[b][t]], state[b], rtol=1e-5, atol=1e-5)
    keep = [s for s in range(slots) if s not in {d for row in dst for d in row}]
    assert torch.equal(pool[keep], before[keep])


def test_wkv7_torch_step_is_the_cpp_one():
    """The PyTorch step (prompt spans longer than the C++ op takes) is the C++ update."""
    from wallbreaker.layers.rwkv7 import WKV7
    torch.manual_seed(1)
    heads, n = HIDDEN // HEAD, HEAD
    pool = torch.randn(3, heads, n, n) * 0.3
    inputs = [torch.randn(2, heads, n) for _ in range(6)]
    inputs[1] = torch.rand(2, heads, n)
    y, (s,) = WKV7.step(tuple(inputs), [pool[[1, 1]]])
    y_cpp = _C.wkv7_step(pool, torch.tensor([1, 1]), torch.tensor([[-1], [2]]),
                         *(x[:, None].contiguous() for x in inputs))
    torch.testing.assert_close(y_cpp[:, 0], y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[2], s[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head", [32, 20])  # 20: a row of 60, the vector loop's scalar tail
@pytest.mark.parametrize("first_layer", [True, False])
def test_rwkv7_mix_and_out_are_the_pytorch_formulas(kernel_level, head, first_layer):
    """The C++ elementwise ops around the WKV update against the PyTorch formulas they replaced
    (layers/rwkv7.py's docstring); layer 0 keeps its own value, the others mix in v_first."""
    F = torch.nn.functional
    torch.manual_seed(0)
    rows, heads = 5, 3
    C = heads * head
    k, v, w_low, a_low, v_low, v_first, y, r, g = (torch.randn(rows, C) for _ in range(9))
    w0, a0, v0, k_k, k_a, ln_w, ln_b, r_k = (torch.randn(C) for _ in range(8))
    residual = (None, None, None) if first_layer else (v_low, v_first, v0)
    got = _C.rwkv7_mix(k, v, w_low, a_low, *residual[:2], w0, a0, residual[2], k_k, k_a, head)
    a = torch.sigmoid(a0 + a_low)
    kk = F.normalize((k * k_k).view(rows, heads, head), dim=-1, eps=1e-12).view(rows, C)
    mixed = v if first_layer else v + (v_first - v) * torch.sigmoid(v0 + v_low)
    want = (torch.exp(-0.606531 * torch.sigmoid(w0 + w_low)), k * (1 + (a - 1) * k_a), mixed, -kk, kk * a)
    for name, x, expected in zip(("decay", "k", "v", "a", "b"), got, want):
        torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5, msg=name)
    out = _C.rwkv7_out(y, r, k, v, g, ln_w, ln_b, r_k, head, 64e-5)
    bonus = (r * k * r_k).view(rows, heads, head).sum(-1, keepdim=True) * v.view(rows, heads, head)
    expected = (F.group_norm(y, heads, ln_w, ln_b, 64e-5) + bonus.view(rows, C)) * g
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# -- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def make(folder):
    return functools.partial(rwkv_llm, folder)


@pytest.fixture(scope="module")
def plain(make) -> LLM:
    return make(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    """PROMPTS, a long one (TEXT twice), and five of repeated motifs (so that n-grams propose)."""
    rng = random.Random(0)
    motifs = []
    for _ in range(5):
        motif = [rng.randrange(3, 2000) for _ in range(rng.randint(2, 5))]
        motifs.append((motif * 12)[:rng.randint(3, 40)])
    return [plain.tokenizer.encode(p) for p in PROMPTS] + [plain.tokenizer.encode(TEXT * 2)] + motifs


@pytest.fixture(scope="module")
def few(plain) -> SamplingParams:
    """Greedy among four tokens: the random model's free choice rarely repeats itself; among four it
    repeats enough that n-grams are sometimes right and sometimes wrong."""
    return dataclasses.replace(GREEDY, allowed_token_ids=plain.tokenizer.encode(" the quick brown fox"))


@pytest.fixture(scope="module")
def expected(plain, prompts, few) -> list[list[int]]:
    """Each prompt's tokens, greedy among `few`, as a request alone."""
    return [greedy_of(plain, [p], few)[0] for p in prompts]


def greedy_of(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_chunked_prefill_gives_the_logits_of_one_pass(make):
    """Chunks of 1 and 7 (C++ on the pool) and 17 (the PyTorch form from a saved state)."""
    llm = make(kv_block_size=BLOCK)
    ids = llm.tokenizer.encode(TEXT * 2)
    full = llm.logits(ids)
    for chunk in (1, 7, 17):
        assert (llm.logits(ids, chunk_size=chunk) - full).abs().max().item() < 1e-4, chunk


def test_batched_chunked_and_speculative_give_the_tokens_of_each_prompt_alone(make, prompts, few, expected):
    """All at once; 7 tokens a step; with n-gram drafts (accepted and rejected: the state after the
    last accepted one kept, the rest dropped)."""
    assert greedy_of(make(), prompts, few) == expected
    assert greedy_of(make(max_num_batched_tokens=7), prompts, few) == expected
    llm = make(speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False)
    assert greedy_of(llm, prompts, few) == expected
    stats = llm.stats()
    assert 0 < stats["spec_accepted"] < stats["spec_proposed"] and holds_only_checkpoints(llm)


def test_a_cached_prefix_and_preemption_keep_the_greedy_tokens(make, plain, prompts, few, expected):
    """The long prompt again starts from the prefix cache's state checkpoint; the prompts twice, up to
    4 at a time in the bytes of 6 states, are preempted and recomputed."""
    llm = make(kv_block_size=BLOCK)
    first, again = (llm.generate([{"prompt_token_ids": prompts[2]}], few)[0] for _ in range(2))
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[2]
    assert again.metrics["num_cached_prompt_tokens"] > 0
    per_state = plain.stats()["state_bytes_per_sequence"]
    small = make(max_num_seqs=4, kv_block_size=BLOCK, kv_cache_memory_gb=6 * per_state / 2**30)
    assert greedy_of(small, prompts * 2, few) == expected * 2
    assert small.stats()["num_preemptions"] > 0 and holds_only_checkpoints(small)


def test_a_saved_session_and_the_disk_tier_carry_the_state_into_another_engine(make, plain, prompts, few, tmp_path):
    """The long prompt's state, kept at its last block boundary, saved as a session and written to the
    disk tier, starts its extension in a new engine with the tokens of one computed from scratch."""
    long = prompts[2]
    extended = long + plain.tokenizer.encode(" And what keeps a state per sequence?")
    want = greedy_of(plain, [extended], few)[0]
    session, disk = dict(kv_cache_disk_dir=str(tmp_path / "s")), dict(kv_cache_disk_dir=str(tmp_path / "d"),
                                                                      kv_cache_disk_gb=0.1)
    info = make(kv_block_size=BLOCK, **session).save_prefix({"prompt_token_ids": long}, "chat")
    restorer = make(kv_block_size=BLOCK, **session)
    assert restorer.load_prefix("chat").num_tokens == info.num_tokens > 0
    writer = make(kv_block_size=BLOCK, **disk)
    writer.generate([{"prompt_token_ids": long}], few)
    writer.shutdown()
    reader = make(kv_block_size=BLOCK, **disk)
    for llm in (restorer, reader):
        out = llm.generate([{"prompt_token_ids": extended}], few)[0]
        assert out.outputs[0].token_ids == want and out.metrics["num_cached_prompt_tokens"] > 0
    assert reader.stats()["kv_disk_states_read"] == 1
