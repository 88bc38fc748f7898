"""SmolVLM (Idefics3) with images against transformers' `Idefics3ForConditionalGeneration` on the same
tiny random weights and real photographs, float32: the prompt's tokens and tiles, the encoder's
output (SigLIP over each tile, pixel shuffle, projection), the logits of every position
(teacher-forced; the decoder causal over the image's tokens, as transformers' Llama is), greedy
tokens, two images, chunked prefill, the prefix cache, and the OpenAI API."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vision_models import (assert_greedy_matches, conversation, data_url, float32_llm, max_diff, photo,
                           processor_inputs, reference_logits)
from wallbreaker import LLM, SamplingParams

pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")


@pytest.fixture(scope="module")
def folder(tiny_smolvlm):
    return tiny_smolvlm


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration
    model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def llm(folder):
    return float32_llm(folder, 1024)


hf_inputs = processor_inputs


def test_prompt_tokens_and_tiles_are_the_processors(llm, reference):
    _, processor = reference
    messages = conversation(photo())
    expected = hf_inputs(processor, messages)
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == expected["input_ids"][0].tolist()
    tiles = expected["pixel_values"][0]
    assert len(images) == tiles.shape[0] == 10  # 3x3 tiles and the global image, one run of <image> each
    assert all(torch.equal(im.pixels, px) for im, px in zip(images, tiles))
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    positions = [i for i, t in enumerate(ids) if t == image_id]
    assert [p for im in images for p in range(im.offset, im.end)] == positions
    assert [im.tile for im in images] == list(range(10)) and not any(im.bidirectional for im in images)


def test_encoder_and_connector_match_transformers(llm, reference):
    model, processor = reference
    inputs = hf_inputs(processor, conversation(photo("chelsea")))
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"],
                                                  inputs["pixel_attention_mask"]).pooler_output[0]
    got = llm.vision(inputs["pixel_values"][0]).reshape(-1, expected.shape[-1])
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["astronaut", "coffee"])
def test_teacher_forced_logits_match_transformers(llm, reference, name):
    model, processor = reference
    messages = conversation(photo(name))
    inputs = hf_inputs(processor, messages)
    expected = reference_logits(model, inputs)
    _, ids, images = llm.encode_chat_images(messages)
    assert max_diff(llm.logits(ids, images=images), expected) < 1e-4
    # the mask matters: image tokens attending to each other both ways (Gemma 3's rule) give other logits
    both_ways = [dataclasses.replace(im, bidirectional=True) for im in images]
    assert (llm.logits(ids, images=both_ways) - expected).abs().max().item() > 1e-3


def test_greedy_tokens_match_transformers_generate(llm, reference):
    """16 greedy tokens and the first step's top-5 log-probabilities, the image sent as a data URL."""
    model, processor = reference
    image = photo()
    assert_greedy_matches(llm, model, hf_inputs(processor, conversation(image)),
                          conversation({"type": "image_url", "image_url": {"url": data_url(image)}}))
    got = llm.chat(conversation(image), SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert got.metrics["num_images"] == 1 and got.metrics["image_encode_s"] >= 0.0


def test_an_image_changes_the_output(llm):  # the tests above can fail: the image is read
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    a = llm.chat(conversation(photo("astronaut")), params)[0].outputs[0]
    b = llm.chat(conversation(photo("coffee")), params)[0].outputs[0]
    assert a.top_logprobs[0] != b.top_logprobs[0]


@pytest.mark.parametrize("chunk", [1, 5, 13, 40])
def test_chunked_prefill_gives_the_same_logits(llm, chunk):
    _, ids, images = llm.encode_chat_images(conversation(photo("rocket")))
    whole = llm.logits(ids, images=images)
    chunked = llm.logits(ids, chunk_size=chunk, images=images)
    assert torch.equal(whole, chunked) or (whole - chunked).abs().max().item() < 1e-5


def test_two_images_in_two_turns_match_transformers(llm, reference):
    model, processor = reference
    a, b = photo("astronaut"), photo("camera")  # a grey one, of another shape: other tiles
    messages = [
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": b}]}]
    inputs = hf_inputs(processor, messages)
    with torch.no_grad():
        expected = model(**inputs).logits[0]
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == inputs["input_ids"][0].tolist()
    assert len(images) == inputs["pixel_values"].shape[1]
    assert all(torch.equal(im.pixels, px) for im, px in zip(images, inputs["pixel_values"][0]))
    assert (llm.logits(ids, images=images) - expected).abs().max().item() < 1e-4
    assert (llm.logits(ids, chunk_size=9, images=images) - expected).abs().max().item() < 1e-4
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert llm.chat(messages, params)[0].metrics["num_images"] == 2


def test_the_same_image_hits_the_prefix_and_encoder_caches(folder):
    llm = float32_llm(folder, 1024, kv_block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    first = llm.chat(conversation(photo()), params)[0]
    encoded = llm.engine.runner.encoder_stats["images_encoded"]
    assert first.metrics["num_cached_prompt_tokens"] == 0 and encoded == 10
    again = llm.chat(conversation(photo(), "What is in this picture?"), params)[0]
    last = llm.encode_chat_images(conversation(photo()))[2][-1]
    assert again.metrics["num_cached_prompt_tokens"] >= last.end // 8 * 8
    assert llm.engine.runner.encoder_stats["images_encoded"] == encoded  # every tile from the caches
    cold = float32_llm(folder, 1024, kv_block_size=8)
    expected = cold.chat(conversation(photo(), "What is in this picture?"), params)[0]
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    other = llm.chat(conversation(photo("coffee")), params)[0]
    assert other.metrics["num_cached_prompt_tokens"] <= last.offset and other.outputs[0].top_logprobs != \
        first.outputs[0].top_logprobs


def test_the_auto_path_takes_images_too(folder, llm):
    auto = LLM(folder, kv_cache_memory_gb=0.05, max_model_len=1024)
    conv = conversation(photo("astronaut"))
    out = auto.chat(conv, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4
    from wallbreaker.layers.linear import QuantLinear
    assert auto.vision.tower.linears and all(isinstance(m, QuantLinear) for m in auto.vision.tower.linears.values())
    pixels = llm.encode_chat_images(conv)[2][0].pixels[None]
    exact, packed = llm.vision(pixels), auto.vision(pixels)
    assert ((packed - exact).norm() / exact.norm()).item() < 0.02


def test_openai_client_gets_llm_chats_text(folder, llm):
    openai = pytest.importorskip("openai")
    from server_apps import make_app, running_server
    from server_process import free_port

    url = data_url(photo("coffee"))
    messages = conversation({"type": "image_url", "image_url": {"url": url}})
    expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    with running_server(make_app(folder, max_model_len=1024, port=free_port())) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="m", temperature=0, max_tokens=8, messages=messages,
                                                extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == expected


def test_a_smolvlm2_folder_matches_its_transformers_class(tmp_path):
    """model_type `smolvlm` (SmolVLM2's `SmolVLMForConditionalGeneration`): the same reader, against
    that class on the prompt and tiles that Idefics3's processor makes (checked equal above)."""
    from tiny_smolvlm import make_tiny_smolvlm
    from transformers import SmolVLMForConditionalGeneration

    folder = make_tiny_smolvlm(tmp_path / "smolvlm2", seed=1, family="SmolVLM")
    model = SmolVLMForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = float32_llm(folder, 1024)
    _, ids, images = llm.encode_chat_images(conversation(photo("coffee")))
    pixels = torch.stack([im.pixels for im in images])[None]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    assert (llm.logits(ids, images=images) - expected).abs().max().item() < 1e-4


def test_the_encoder_cache_keeps_to_its_byte_budget(folder):
    # without the prefix cache, so that the second request needs every tile's vectors again
    llm = float32_llm(folder, 1024, enable_prefix_caching=False)
    runner = llm.engine.runner
    tile_bytes = 16 * 64 * 4  # a tile's 16 vectors of the decoder's 64 floats
    runner.encoder_cache_bytes = 3 * tile_bytes
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.chat(conversation(photo()), params)[0]
    assert len(runner.encoder_cache) == 3 and sum(t.nbytes for t in runner.encoder_cache.values()) <= 3 * tile_bytes
    again = llm.chat(conversation(photo()), params)[0]
    # ten tiles in order through a cache of three: each was evicted before it was needed again
    assert runner.encoder_stats["images_encoded"] == 20 and len(runner.encoder_cache) == 3
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
