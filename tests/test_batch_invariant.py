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
from wallbreaker.layers.linear import Linear, PromptRows, QuantLinear

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


@pytest.fixture(params=[False, True], ids=["tiles", "dense"])
def dense(request, monkeypatch) -> bool:
    """The dense bfloat16 prefill path off, and on wherever the CPU can run it (not only with AMX):
    WALLBREAKER_DENSE_PREFILL (kernels/__init__.py `dense_path`)."""
    if request.param and not (qk._C.dense_supported() and qk.isa() == "avx512"):
        pytest.skip("the dense path needs AVX-512 BF16 and the avx512 kernel level")
    monkeypatch.setenv("WALLBREAKER_DENSE_PREFILL", "1" if request.param else "0")
    monkeypatch.setattr(qk, "_dense", None)
    assert qk.dense_path() == request.param or qk.isa() != "avx512"
    return request.param


def test_prompt_and_generated_rows_are_the_same_in_any_call(dense):
    """A step's generated rows come first, its prompt rows last (`PromptRows.start`): each row gets
    its path's bits whatever the call holds, alone, among a few, or among 700 (two dense calls)."""
    torch.manual_seed(0)
    qtype = gguf.GGMLQuantizationType.Q8_0
    raw = torch.from_numpy(gguf.quantize(torch.randn(1024, 896).numpy(), qtype))  # oneDNN's blocking varies with M here
    layer = QuantLinear([(qk.pack_rows(raw, qtype), int(qtype))], 896)
    layer.batch_invariant, layer.prompt_rows = True, PromptRows()

    def step(x: torch.Tensor, generated: int) -> torch.Tensor:
        layer.prompt_rows.start = generated
        return layer(x)
    x = torch.randn(700, 896)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # oneDNN's kernel for 33-500 rows differs from 600's at 2 threads, not at 1
    try:
        whole = step(x, 100)  # 100 generated rows, 600 prompt rows
        assert torch.equal(step(x[:1], 1), whole[:1])
        assert torch.equal(step(x[40:60], 20), whole[40:60])
        assert torch.equal(step(x[650:657], 0), whole[650:657])
        assert torch.equal(step(x[99:134], 1), whole[99:134])
        assert torch.equal(step(x[100:], 0), whole[100:])
        if dense:  # the paths differ: a row's path must not depend on its call
            assert not torch.equal(step(x[100:101], 1), whole[100:101])
        torch.set_num_threads(1)  # the engine may give a step fewer threads (engine/threads.py)
        with torch.inference_mode():
            assert torch.equal(step(x, 100), whole)
    finally:
        torch.set_num_threads(threads)


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


def test_a_reused_prefix_gives_the_cold_logits_bit_for_bit(model, dtype, dense):
    prompt = DOCUMENT + QUESTION
    cold_tokens, cold, _ = first_logits(make(model, dtype=dtype, enable_prefix_caching=False), [prompt])
    warm_llm = make(model, dtype=dtype)
    first_logits(warm_llm, [DOCUMENT])
    warm_tokens, warm, (metrics,) = first_logits(warm_llm, [prompt])
    assert metrics["num_cached_prompt_tokens"] == len(DOCUMENT) // 16 * 16
    assert (warm_tokens, warm[0].tolist()) == (cold_tokens, cold[0].tolist())


@pytest.mark.parametrize("chunk", [7, 33, 64])
def test_any_chunking_and_any_neighbour_give_the_same_logits(model, dtype, chunk, dense):
    prompt = DOCUMENT + QUESTION
    _, (alone,), _ = first_logits(make(model, dtype=dtype, enable_prefix_caching=False), [prompt])
    llm = make(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=chunk)
    _, (_, chunked), _ = first_logits(llm, [QUESTION * 3, prompt])
    assert torch.equal(chunked, alone)


def test_a_short_prompt_takes_the_decode_path_and_its_blocks_serve_no_longer_prompt(model, dtype, dense, tmp_path):
    """A prompt of at most SHORT_PROMPT tokens is computed on the decode path: a longer prompt that
    starts with it finds none of its blocks (they would hold other bits than its own prefill), and
    gets the cold logits; a short prefix saved as a session is computed on the prefill path, so the
    longer prompt does reuse it."""
    from wallbreaker.layers.linear import SHORT_PROMPT
    short, long_prompt = DOCUMENT[:SHORT_PROMPT - 8], DOCUMENT[:SHORT_PROMPT - 8] + QUESTION * 3
    _, (cold,), _ = first_logits(make(model, dtype=dtype, enable_prefix_caching=False), [long_prompt])
    llm = make(model, dtype=dtype, kv_cache_disk_dir=str(tmp_path))
    first_logits(llm, [short])
    _, (warm,), (metrics,) = first_logits(llm, [long_prompt])
    assert metrics["num_cached_prompt_tokens"] == 0 and torch.equal(warm, cold)
    saver = make(model, dtype=dtype, kv_cache_disk_dir=str(tmp_path))
    saver.save_prefix({"prompt_token_ids": short}, "short")
    _, (restored,), (metrics,) = first_logits(saver, [long_prompt])
    assert metrics["num_cached_prompt_tokens"] == len(short) // 16 * 16 and torch.equal(restored, cold)


def test_a_context_past_one_key_block_gives_the_same_logits_cached_and_chunked(packaged_model, dense):
    """A prompt of ~1,200 tokens spans three of SDPA's 512-key blocks, so each 64-query call reads
    the blocks up to its own queries: cold in one step, after a cached prefix and in chunks of 64
    beside another prompt, the same bits (SmolLM2: the tiny models' context is 512)."""
    model = packaged_model("smollm2")
    long_prompt = DOCUMENT * 8 + QUESTION
    kw = dict(batch_invariant=True, kv_block_size=16, kv_cache_memory_gb=0.1, max_model_len=2048)
    cold_tokens, (cold,), _ = first_logits(LLM(str(model), enable_prefix_caching=False,
                                               max_num_batched_tokens=2048, **kw), [long_prompt])
    warm_llm = LLM(str(model), **kw)
    first_logits(warm_llm, [DOCUMENT * 7])
    warm_tokens, (warm,), (metrics,) = first_logits(warm_llm, [long_prompt])
    assert metrics["num_cached_prompt_tokens"] == len(DOCUMENT) * 7 // 16 * 16
    _, (_, chunked), _ = first_logits(LLM(str(model), enable_prefix_caching=False, max_num_batched_tokens=64, **kw),
                                      [QUESTION * 3, long_prompt])
    assert warm_tokens == cold_tokens
    assert torch.equal(warm, cold) and torch.equal(chunked, cold)


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


# -- the default options on real models: same request, same tokens ---------------------------------
# Issue 48's acceptance: greedy 32 tokens for ten prompts a model, the same whatever else the engine
# does, each scenario against the plainest run: one request at a time, no prefix cache.
REAL_MODELS = ["smollm2", "qwen2.5-coder-0.5b", "gemma3-270m"]
TEXTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n    if n < 2:\n        return 1\n",
    "Question: What is the capital of France?\nAnswer: The capital of France is Paris.\n"
    "Question: What is the capital of Italy?\nAnswer:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "<html>\n<head>\n  <title>My page</title>\n</head>\n<body>\n  <ul>\n    <li>",
    "Translate to French: The weather is lovely today, and the children are playing in the park.\nFrench:",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    '{"name": "Ada Lovelace", "born": 1815, "known_for": [',
    "User: How do I make a cup of tea?\nAssistant: Boil water, then",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY",
]
OTHERS = ["Hello", "List the planets of the solar system in order from the sun:",
          "import numpy as np\nimport torch\n\n", "A haiku about autumn:"]
GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)


def token_ids(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their log-probabilities (equal floats: equal logits rows, in
    practice, where equal tokens alone could hide a difference in the last bits)."""
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, GREEDY32)]


@pytest.fixture(scope="module", params=REAL_MODELS)
def real(request, packaged_model) -> tuple:
    """(the model's path, its default LLM, the plain tokens of each of TEXTS)."""
    path = packaged_model(request.param)
    plain = LLM(str(path), enable_prefix_caching=False)
    expected = [token_ids(plain, [t])[0] for t in TEXTS]
    plain.shutdown()
    return path, LLM(str(path)), expected


def test_the_same_request_three_times_gives_the_same_tokens(real):
    """The second and third hit the prefix cache (every full block of the prompt)."""
    _, llm, expected = real
    hits = llm.stats()["prefix_cache_hits"]
    for text, want in zip(TEXTS, expected):
        assert [token_ids(llm, [text])[0] for _ in range(3)] == [want] * 3
    assert llm.stats()["prefix_cache_hits"] > hits


def test_a_batch_of_eight_gives_each_its_tokens_alone(real):
    """Two batches of eight: five of TEXTS among three others, in changing places."""
    _, llm, expected = real
    for first in (0, 5):
        texts = TEXTS[first:first + 5]
        got = token_ids(llm, [OTHERS[0]] + texts[:2] + [OTHERS[1]] + texts[2:] + [OTHERS[2]])
        assert got[1:3] + got[4:7] == expected[first:first + 5]


def test_a_prefix_hit_of_any_length_and_a_reply_after_an_answer(real):
    """Prompts that share 1 to 5 blocks with earlier ones, and a prompt made of an earlier prompt,
    its answer and more (the answer's blocks were generated tokens: they are not reused as prompt)."""
    path, llm, _ = real
    base = llm.tokenizer.encode(TEXTS[1] + TEXTS[2] + TEXTS[3])
    answer = token_ids(llm, [{"prompt_token_ids": base[:40]}])[0][0]
    prompts = [base[:n] for n in (17, 33, 50, 79)] + [base[:40] + answer + base[40:60]]
    warm = [token_ids(llm, [{"prompt_token_ids": p}])[0] for p in prompts]
    cold = LLM(str(path), enable_prefix_caching=False)
    assert warm == token_ids(cold, [{"prompt_token_ids": p} for p in prompts])


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_gives_the_same_tokens(real, chunk):
    path, _, expected = real
    assert token_ids(LLM(str(path), max_num_batched_tokens=chunk), TEXTS) == expected


def test_ngram_speculation_gives_the_same_tokens(real):
    path, _, expected = real
    llm = LLM(str(path), speculative_method="ngram")
    assert token_ids(llm, TEXTS) == expected
    assert llm.stats()["spec_proposed"] > 0


def test_preemption_gives_the_same_tokens(real):
    """A pool of 8 blocks a sequence for 8 sequences that need up to 7 each: some are preempted and
    recomputed, their generated tokens among them."""
    from wallbreaker.kv.cache import bytes_per_block
    path, llm, expected = real
    block = bytes_per_block(llm.model_config, 16, torch.bfloat16)
    small = LLM(str(path), kv_cache_memory_gb=24 * block / 2**30, max_model_len=128)
    assert token_ids(small, TEXTS + TEXTS) == expected + expected
    assert small.stats()["num_preemptions"] > 0


def test_the_server_streams_the_answer_it_sends_whole(packaged_model):
    """Through the server: the same chat request, whole and then streamed (its prompt now in the
    prefix cache), gives the same text (issue 48's first finding)."""
    import json
    from fastapi.testclient import TestClient
    from wallbreaker.server.app import build_app
    with TestClient(build_app(LLM(str(packaged_model("smollm2")))), base_url="http://localhost") as client:
        for text in TEXTS:
            body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 32, "temperature": 0}
            whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                          if line.startswith("data: {")]
            assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == whole
