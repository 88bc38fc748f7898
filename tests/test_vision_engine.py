"""The engine with images: the prefix cache keys an image's blocks by its pixels, the encoder runs
once per image, chunked prefill (a small token budget, several requests at once) changes nothing,
and the request's metrics say what the encoder cost."""
from __future__ import annotations

import pytest

from wallbreaker import LLM, SamplingParams
from wallbreaker.engine.client import EngineRequest
from wallbreaker.errors import InvalidRequestError
from wallbreaker.vision.inputs import ImageInput, fit_chunk

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def folder(tiny_gemma3_vision):
    return tiny_gemma3_vision


def photo(name: str):
    return Image.fromarray(getattr(skdata, name)())


def chat(image, text: str = "Describe the image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": image},
                                         {"type": "text", "text": text}]}]


def fresh(folder, **kw) -> LLM:
    return LLM(folder, dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256, kv_block_size=8, **kw)


def assert_same_tops(a, b, tol: float = 1e-4) -> None:
    """The same top tokens at every step, their log-probabilities within `tol`."""
    assert [[t for t, _ in row] for row in a.top_logprobs] == [[t for t, _ in row] for row in b.top_logprobs]
    assert max(abs(x - y) for ra, rb in zip(a.top_logprobs, b.top_logprobs) for (_, x), (_, y) in zip(ra, rb)) < tol


def test_the_same_image_hits_the_prefix_cache_and_a_different_one_never_does(folder):
    llm = fresh(folder)
    first = llm.chat(chat(photo("astronaut")), GREEDY)[0]
    image = llm.encode_chat_images(chat(photo("astronaut")))[2][0]
    assert first.metrics["num_cached_prompt_tokens"] == 0
    # the same placeholder tokens with other pixels: nothing from the image's first block on is reused
    other = llm.chat(chat(photo("coffee")), GREEDY)[0]
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.metrics["num_cached_prompt_tokens"] <= image.offset // 8 * 8
    assert other.outputs[0].top_logprobs != first.outputs[0].top_logprobs
    # the first image again in a new conversation (other text after it): its blocks come from the cache
    again = llm.chat(chat(photo("astronaut"), "What is in this picture?"), GREEDY)[0]
    assert again.metrics["num_cached_prompt_tokens"] >= image.end // 8 * 8 > image.offset
    cold = fresh(folder).chat(chat(photo("astronaut"), "What is in this picture?"), GREEDY)[0]
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_same_tops(again.outputs[0], cold.outputs[0])


def test_an_image_is_encoded_once_and_its_cost_is_in_the_metrics(folder):
    llm = fresh(folder, enable_prefix_caching=False)
    runner = llm.engine.runner
    out = llm.chat(chat(photo("chelsea")), SamplingParams(temperature=0.0, max_tokens=3, n=2))[0]
    assert runner.encoder_stats["images_encoded"] == 1
    assert out.metrics["num_images"] == 1 and out.metrics["image_encode_s"] > 0.0
    again = llm.chat(chat(photo("chelsea")), SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert runner.encoder_stats["images_encoded"] == 1 and runner.encoder_stats["encoder_cache_hits"] >= 1
    assert again.metrics["image_encode_s"] == 0.0


def test_chunked_prefill_and_batching_do_not_change_greedy_output(folder):
    conversations = [chat(photo(n)) for n in ("astronaut", "coffee", "rocket")]
    alone = [fresh(folder, enable_prefix_caching=False).chat(c, GREEDY)[0].outputs[0] for c in conversations]
    small = fresh(folder, max_num_batched_tokens=7, enable_prefix_caching=False)  # an image block is 16 tokens
    together = [o.outputs[0] for o in small.chat(conversations, GREEDY)]
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert_same_tops(a, b)


def test_fit_chunk_never_ends_inside_an_image_block():
    import torch
    image = ImageInput(10, 16, b"x" * 32, torch.zeros(3, 1, 1))
    assert fit_chunk((image,), 0, 5) == 5  # before the block
    assert fit_chunk((image,), 0, 12) == 10  # would end inside: stops before it
    assert fit_chunk((image,), 10, 4) == 16  # starts it: runs to its end
    assert fit_chunk((image,), 13, 2) == 13  # starts inside (the rest of a cached block): to its end
    assert fit_chunk((image,), 0, 26) == 26 and fit_chunk((image,), 0, 40) == 40


def test_a_text_model_refuses_images(tiny_gemma3):
    llm = LLM(tiny_gemma3.hf_dir, dtype="float32", kv_cache_memory_gb=0.02)
    with pytest.raises(InvalidRequestError, match="does not take images"):
        llm.chat(chat(photo("astronaut")))
    ids = llm.encode("hello there")[1]
    with pytest.raises(InvalidRequestError, match="does not take images"):
        llm.engine.add_request(EngineRequest(ids, SamplingParams(), images=(object(),)))
    # text parts alone are joined, as before
    out = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                   SamplingParams(temperature=0.0, max_tokens=3))[0]
    ref = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_text_that_spells_the_image_markers_is_refused(folder):
    llm = fresh(folder)
    with pytest.raises(InvalidRequestError, match="markers|tokens of its own"):
        llm.chat(chat(photo("astronaut"), "and <start_of_image> here"))
    with pytest.raises(InvalidRequestError, match="tokens of its own"):
        llm.chat(chat(photo("astronaut"), "and <image_soft_token> here"))
