"""Gemma 3 with images against transformers' `Gemma3ForConditionalGeneration` on the same tiny random
weights and a real photograph, float32: the prompt's tokens and pixels, the encoder's output, the
logits of every position (teacher-forced, the image's tokens attending to each other both ways),
greedy tokens; and chunked prefill and the prefix cache leaving them unchanged."""
from __future__ import annotations

import pytest
import torch

from vision_models import (assert_greedy_matches, conversation, data_url, float32_llm, photo, processor_inputs,
                           reference_logits)
from wallbreaker import LLM, SamplingParams

pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")


@pytest.fixture(scope="module")
def folder(tiny_gemma3_vision):
    return tiny_gemma3_vision


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def llm(folder):
    return float32_llm(folder, 256)


def hf_inputs(processor, image, text: str = "Describe the image.") -> dict:
    return processor_inputs(processor, conversation(image, text))


def test_prompt_tokens_and_pixels_are_the_processors(llm, reference):
    _, processor = reference
    image = photo()
    expected = hf_inputs(processor, image)
    _, ids, images = llm.encode_chat_images(conversation(image))
    assert ids == expected["input_ids"][0].tolist()
    assert len(images) == 1 and torch.equal(images[0].pixels, expected["pixel_values"][0])
    soft = [i for i, t in enumerate(expected["token_type_ids"][0].tolist()) if t == 1]
    assert (images[0].offset, images[0].end) == (soft[0], soft[-1] + 1) and len(soft) == images[0].length


def test_encoder_and_projector_match_transformers(llm, reference):
    model, processor = reference
    pixels = hf_inputs(processor, photo("chelsea"))["pixel_values"]
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output
    got = llm.vision(pixels)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["astronaut", "coffee"])
def test_teacher_forced_logits_match_transformers(llm, reference, name):
    model, processor = reference
    image = photo(name)
    inputs = hf_inputs(processor, image)
    expected = reference_logits(model, inputs)
    _, ids, images = llm.encode_chat_images(conversation(image))
    got = llm.logits(ids, images=images)
    assert (got - expected).abs().max().item() < 1e-4
    # the bidirectional block matters: a causal-only decoder gives other logits at the image's tokens
    with torch.no_grad():
        causal = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits[0]
    assert (causal - expected).abs().max().item() > 1e-2


def test_greedy_tokens_match_transformers_generate(llm, reference):
    """16 greedy tokens and the first step's top-5 log-probabilities, the image sent as a data URL."""
    model, processor = reference
    image = photo()
    assert_greedy_matches(llm, model, hf_inputs(processor, image),
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
    image = photo("rocket")
    _, ids, images = llm.encode_chat_images(conversation(image))
    whole = llm.logits(ids, images=images)
    chunked = llm.logits(ids, chunk_size=chunk, images=images)
    assert torch.equal(whole, chunked) or (whole - chunked).abs().max().item() < 1e-5


def test_two_images_in_two_turns_match_transformers(llm, reference):
    """Each image its own bidirectional block (never one block across both), in a multi-turn chat."""
    model, processor = reference
    a, b = photo("astronaut"), photo("chelsea")
    hf_messages = [
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": b}]}]
    inputs = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        expected = model(**inputs).logits[0]
    _, ids, images = llm.encode_chat_images(hf_messages)
    assert ids == inputs["input_ids"][0].tolist() and len(images) == 2
    assert all(torch.equal(im.pixels, px) for im, px in zip(images, inputs["pixel_values"]))
    assert (llm.logits(ids, images=images) - expected).abs().max().item() < 1e-4
    assert (llm.logits(ids, chunk_size=9, images=images) - expected).abs().max().item() < 1e-4


def test_the_auto_path_takes_images_too(folder, llm):
    """The packed-kernel path with an image: it runs, its first token is the float32 path's, and its
    encoder's projections run on our kernels within 2% of the float32 encoder's output."""
    auto = LLM(folder, kv_cache_memory_gb=0.05, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    conv = conversation(photo("astronaut"))
    a, b = auto.chat(conv, params)[0].outputs[0], llm.chat(conv, params)[0].outputs[0]
    assert len(a.token_ids) == 4 and a.token_ids[0] == b.token_ids[0]
    # the encoder's projections on our kernels (Q8_0 blocks packed at load), near the float32 encoder
    from wallbreaker.layers.linear import QuantLinear
    assert auto.vision.tower.linears and all(isinstance(m, QuantLinear) for m in auto.vision.tower.linears.values())
    pixels = llm.encode_chat_images(conv)[2][0].pixels[None]
    exact, packed = llm.vision(pixels), auto.vision(pixels)
    assert ((packed - exact).norm() / exact.norm()).item() < 0.02
