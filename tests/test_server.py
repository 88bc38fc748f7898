"""`wallbreaker serve` through the official `openai` client: answers equal the offline `LLM`'s, streams
equal plain answers, and n, stop, seed, logprobs and usage behave as OpenAI documents."""
from __future__ import annotations

import math

import openai
import pytest
from server_process import ServerProcess

from wallbreaker import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Hello, world! How are", "Once upon a time there was"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What's the time?"}]
SEEDED = dict(temperature=0.8, seed=1, max_tokens=24)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    process = ServerProcess(tiny_llama.gguf_path, log_path=tmp_path_factory.mktemp("server") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(tiny_llama.gguf_path, dtype="float32")  # the exact path: answers equal whatever the batch


def _stream_texts(stream) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Text and finish reason per choice index, and every chunk, of a completions or chat stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["model"]


@pytest.mark.slow
def test_greedy_completions_equal_offline_generate(client, offline):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    expected = offline.generate(PROMPTS, params)
    response = client.completions.create(model="model", prompt=PROMPTS, temperature=0.0, max_tokens=20)
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [e.outputs[0].text for e in expected]
    assert [c.finish_reason for c in choices] == [e.outputs[0].finish_reason for e in expected]
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert response.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_token_id_prompt_equals_text_prompt(client, offline):
    _, ids = offline.encode(PROMPTS[0])
    by_ids = client.completions.create(model="default", prompt=ids, temperature=0.0, max_tokens=12)
    by_text = client.completions.create(model="default", prompt=PROMPTS[0], temperature=0.0, max_tokens=12)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_greedy_chat_equals_offline_chat(client, offline):
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=20))[0]
    response = client.chat.completions.create(model="model", messages=MESSAGES, temperature=0.0, max_tokens=20)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_completion_equals_non_streamed(client, offline):
    plain = client.completions.create(model="model", prompt=PROMPTS[1], **SEEDED)
    texts, reasons, _ = _stream_texts(client.completions.create(model="model", prompt=PROMPTS[1], stream=True,
                                                                **SEEDED))
    assert texts == {0: plain.choices[0].text}
    assert reasons == {0: plain.choices[0].finish_reason}
    seeded = SamplingParams(**SEEDED)
    assert plain.choices[0].text == offline.generate(PROMPTS[1], seeded)[0].outputs[0].text


def test_streamed_chat_equals_non_streamed_and_ends_with_usage(client):
    plain = client.chat.completions.create(model="model", messages=MESSAGES, **SEEDED)
    stream = client.chat.completions.create(model="model", messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True}, **SEEDED)
    texts, reasons, chunks = _stream_texts(stream)
    assert texts == {0: plain.choices[0].message.content}
    assert reasons == {0: plain.choices[0].finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_usage_chunk(client):
    plain = client.completions.create(model="model", prompt=PROMPTS, max_tokens=8, temperature=0.0)
    chunks = list(client.completions.create(model="model", prompt=PROMPTS, max_tokens=8, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n2_streams_carry_their_index(client, endpoint):
    def create(**kw):
        if endpoint == "chat":
            return client.chat.completions.create(model="model", messages=MESSAGES, n=2, **SEEDED, **kw)
        return client.completions.create(model="model", prompt=PROMPTS[2], n=2, **SEEDED, **kw)

    plain = create()
    plain_texts = {c.index: (c.message.content if endpoint == "chat" else c.text) for c in plain.choices}
    texts, reasons, _ = _stream_texts(create(stream=True))
    assert sorted(plain_texts) == [0, 1]
    assert texts == plain_texts
    assert set(reasons) == {0, 1}
    assert plain_texts[0] != plain_texts[1], "choices of one seeded request draw different samples"


def test_n2_completions_of_a_batch_are_numbered_prompt_major(client, offline):
    response = client.completions.create(model="model", prompt=PROMPTS[:2], n=2, temperature=0.0, max_tokens=6)
    expected = offline.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6))
    by_index = {c.index: c.text for c in response.choices}
    assert by_index == {0: expected[0].outputs[0].text, 1: expected[0].outputs[0].text,
                        2: expected[1].outputs[0].text, 3: expected[1].outputs[0].text}


def test_stop_string_ends_the_answer(client, offline):
    greedy = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    stop = greedy[len(greedy) // 2: len(greedy) // 2 + 3]
    expected = greedy[: greedy.index(stop)]
    plain = client.completions.create(model="model", prompt=PROMPTS[0], temperature=0.0, max_tokens=24,
                                      stop=[stop, "never appears"])
    assert plain.choices[0].text == expected
    assert plain.choices[0].finish_reason == "stop"
    texts, reasons, _ = _stream_texts(client.completions.create(
        model="model", prompt=PROMPTS[0], temperature=0.0, max_tokens=24, stop=stop, stream=True))
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_seed_gives_the_same_answer_every_time(client):
    first = client.completions.create(model="model", prompt=PROMPTS[2], **SEEDED)
    again = client.completions.create(model="model", prompt=PROMPTS[2], **SEEDED)
    other = client.completions.create(model="model", prompt=PROMPTS[2], **{**SEEDED, "seed": 2})
    assert first.choices[0].text == again.choices[0].text
    assert first.choices[0].text != other.choices[0].text


def test_completion_logprobs_match_offline(client, offline):
    expected = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10, logprobs=2))[0].outputs[0]
    response = client.completions.create(model="model", prompt=PROMPTS[0], temperature=0.0, max_tokens=10, logprobs=2)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(expected.token_ids)
    assert lp.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the chosen token is the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens).startswith(response.choices[0].text[:1])

    chunks = list(client.completions.create(model="model", prompt=PROMPTS[0], temperature=0.0, max_tokens=10,
                                            logprobs=2, stream=True))
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    offsets = [o for c in chunks for ch in c.choices if ch.logprobs for o in ch.logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs_have_top_alternatives_and_bytes(client):
    response = client.chat.completions.create(model="model", messages=MESSAGES, temperature=0.0, max_tokens=8,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)
        assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in entry.top_logprobs)
        if not entry.token.startswith("bytes:"):
            assert bytes(entry.bytes).decode() == entry.token

    chunks = list(client.chat.completions.create(model="model", messages=MESSAGES, temperature=0.0, max_tokens=8,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e.token for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert streamed == [e.token for e in content]
