"""Batch-invariant mode (`batch_invariant=True`, models/base.py `set_batch_invariant`): a token's
logits do not depend on what else its step computes. A prompt whose prefix comes from the cache (RAM
or disk) gives the logits of the same prompt computed cold, bit for bit, as does any chunking of
the prompt and any neighbour in the batch; on the float32 path and on the packed path."""
from __future__ import annotations

import gguf
import pytest
import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker import kernels as qk
from wallbreaker.layers.linear import Linear, QuantLinear

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
DOCUMENT = [(7 * i + 3) % 200 + 3 for i in range(150)]
QUESTION = [(11 * i + 5) % 150 + 20 for i in range(19)]


def test_a_float_linear_row_is_the_same_alone_and_among_many():
    """PyTorch's float matmul blocks by the number of rows: a row among 600 and the same row among
    18 differ in their last bits at these shapes. The batch-invariant layer must not."""
    torch.manual_seed(0)
    layer = Linear(torch.randn(1536, 576), torch.randn(1536))
    layer.batch_invariant = True
    x = torch.randn(600, 576)
    whole = layer(x)
    for rows in (slice(582, 600), slice(599, 600), slice(0, 1), slice(100, 163)):
        assert torch.equal(layer(x[rows]), whole[rows])


def test_a_quantized_linear_row_is_the_same_alone_and_among_many():
    """Without the mode, 32 rows or more take the dense path where the CPU has one (AMX)."""
    torch.manual_seed(0)
    qtype = gguf.GGMLQuantizationType.Q8_0
    raw = torch.from_numpy(gguf.quantize(torch.randn(256, 512).numpy(), qtype))
    layer = QuantLinear([(qk.pack_rows(raw, qtype), int(qtype))], 512)
    layer.batch_invariant = True
    x = torch.randn(80, 512)
    whole = layer(x)
    for rows in (slice(62, 80), slice(79, 80), slice(0, 40)):
        assert torch.equal(layer(x[rows]), whole[rows])


def first_logits(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor], list[dict]]:
    """Greedy tokens of each prompt, the logits each sampled first, and each request's metrics."""
    captured: dict[int, torch.Tensor] = {}
    runner = llm.engine.runner
    plain = runner.run_step

    def spy(batch, all_logits=False):
        seqs, logits, pooled = plain(batch, all_logits)
        for i, seq in enumerate(seqs):
            captured.setdefault(seq.seq_id, logits[i].clone())
        return seqs, logits, pooled
    runner.run_step = spy
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finally:
        runner.run_step = plain
    firsts = [captured[k] for k in sorted(captured)]
    return [o.outputs[0].token_ids for o in outs], firsts, [o.metrics for o in outs]


def make(path, **kw) -> LLM:
    kw.setdefault("kv_block_size", 16)
    return LLM(str(path), batch_invariant=True, kv_cache_memory_gb=0.02, max_model_len=512, **kw)


@pytest.fixture(params=["float32", "auto"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(params=["llama", "qwen2"])
def model(request, tiny_of, dtype):
    tiny = tiny_of(request.param)
    return tiny.gguf_path if dtype == "float32" else tiny.quantized_gguf(gguf.GGMLQuantizationType.Q8_0)


def test_a_reused_prefix_gives_the_cold_logits_bit_for_bit(model, dtype):
    prompt = DOCUMENT + QUESTION
    cold_tokens, cold, _ = first_logits(make(model, dtype=dtype, enable_prefix_caching=False), [prompt])
    warm_llm = make(model, dtype=dtype)
    first_logits(warm_llm, [DOCUMENT])
    warm_tokens, warm, (metrics,) = first_logits(warm_llm, [prompt])
    assert metrics["num_cached_prompt_tokens"] == len(DOCUMENT) // 16 * 16
    assert (warm_tokens, warm[0].tolist()) == (cold_tokens, cold[0].tolist())


@pytest.mark.parametrize("chunk", [7, 33, 64])
def test_any_chunking_and_any_neighbour_give_the_same_logits(model, dtype, chunk):
    prompt = DOCUMENT + QUESTION
    _, (alone,), _ = first_logits(make(model, dtype=dtype, enable_prefix_caching=False), [prompt])
    llm = make(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=chunk)
    _, (_, chunked), _ = first_logits(llm, [QUESTION * 3, prompt])
    assert torch.equal(chunked, alone)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_pages_read_back_from_disk_give_the_cold_logits(tiny_qwen2, tmp_path, kv_dtype):
    prompt = DOCUMENT + QUESTION
    options = dict(dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=1.0)
    cold_tokens, cold, _ = first_logits(make(tiny_qwen2.gguf_path, dtype="float32", kv_cache_dtype=kv_dtype,
                                             enable_prefix_caching=False), [prompt])
    first = make(tiny_qwen2.gguf_path, **options)
    first_logits(first, [DOCUMENT])
    first.shutdown()  # its blocks are on disk
    warm_llm = make(tiny_qwen2.gguf_path, **options)
    warm_tokens, warm, _ = first_logits(warm_llm, [prompt])
    assert warm_llm.stats()["kv_disk_hits"] >= len(DOCUMENT) // 16
    assert (warm_tokens, warm[0].tolist()) == (cold_tokens, cold[0].tolist())


def test_an_encoder_loads_with_the_default(tmp_path):
    """An encoder computes each input whole: the mode (on by default) leaves it as it is."""
    pytest.importorskip("transformers")
    from tiny_pooling_models import make_tiny_bert
    llm = LLM(str(make_tiny_bert(tmp_path, cross_encoder=False)))
    assert llm.config.batch_invariant and len(llm.embed(["a b c"])[0]) > 0
