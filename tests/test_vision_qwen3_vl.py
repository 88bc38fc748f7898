"""Qwen3-VL with images against transformers' `Qwen3VLForConditionalGeneration` on the same tiny
random weights and real photographs, float32: the prompt (expanded as `Qwen3VLProcessor` does), the
encoder's output with its DeepStack features, the logits of every position (interleaved M-RoPE, the
DeepStack features added after the decoder's first layers), 16 greedy tokens, two images, chunked
prefill."""
from __future__ import annotations

import pytest
import torch

from vision_models import (assert_greedy_matches, assert_logits_match, conversation, float32_llm, max_diff, photo,
                           qwen2_vl_inputs, reference_logits)

pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
pytest.importorskip("tiny_recurrent")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, packaged_model):
    from tiny_qwen3_vl import make_tiny_qwen3_vl
    packaged_model("smollm2")
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"))


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration
    from tiny_qwen3_vl import HALF, MAX_PIXELS, MIN_PIXELS
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=16,
                                      image_mean=HALF, image_std=HALF)
    return model, AutoTokenizer.from_pretrained(folder), images


@pytest.fixture(scope="module")
def llm(folder):
    return float32_llm(folder, 512)


def test_prompt_and_encoder_with_deepstack_match_transformers(llm, reference):
    model = reference[0]
    messages = conversation(photo("chelsea"))
    inputs = qwen2_vl_inputs(*reference, messages)
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == inputs["input_ids"][0].tolist() and len(images) == 1
    grid = inputs["image_grid_thw"][0].tolist()
    assert images[0].grid == (grid[1] // 2, grid[2] // 2)
    assert torch.equal(llm.vision.processor.patchify(images[0].pixels)[0], inputs["pixel_values"])
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    expected = torch.cat([out.pooler_output[0], *(d[0] for d in out.deepstack_features)], dim=-1)
    assert len(out.deepstack_features) == 2 and expected.shape[-1] == 3 * 64
    assert max_diff(llm.vision(images[0].pixels[None])[0], expected) < 1e-5


@pytest.mark.parametrize("name", ["astronaut", "rocket"])
def test_teacher_forced_logits_match_transformers(llm, reference, name):
    model = reference[0]
    messages = conversation(photo(name))
    inputs = qwen2_vl_inputs(*reference, messages)
    _, ids, images = llm.encode_chat_images(messages)
    expected = assert_logits_match(llm, model, inputs, images)
    # both matter: without DeepStack's features, or with Qwen2.5-VL's sectioned M-RoPE, other logits
    text = model.model.language_model
    text._deepstack_process = lambda hidden, mask, embeds: hidden
    try:
        assert max_diff(reference_logits(model, inputs), expected) > 1e-3
    finally:
        del text._deepstack_process
    ropes = [layer.attn.rope for layer in llm.engine.runner.model.layers]
    interleaved = ropes[0].axis
    sectioned = torch.cat([torch.full((n,), a) for a, n in enumerate(ropes[0].section)])
    for rope in ropes:
        rope.axis = sectioned
    try:
        assert max_diff(llm.logits(ids, images=images), expected) > 1e-3
    finally:
        for rope in ropes:
            rope.axis = interleaved


def test_greedy_tokens_match_transformers_generate(llm, reference):
    messages = conversation(photo("coffee"))
    assert_greedy_matches(llm, reference[0], qwen2_vl_inputs(*reference, messages), messages)


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_chunked_prefill_gives_the_same_logits(llm, chunk):
    """DeepStack's features reach an image's tokens in whichever chunk they fall."""
    _, ids, images = llm.encode_chat_images(conversation(photo("coffee")))
    whole = llm.logits(ids, images=images)
    assert max_diff(llm.logits(ids, chunk_size=chunk, images=images), whole) < 1e-5


def test_two_images_in_two_turns_match_transformers(llm, reference):
    messages = [
        {"role": "user", "content": [{"type": "image", "image": photo("astronaut")},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                     {"type": "image", "image": photo("camera")}]}]
    inputs = qwen2_vl_inputs(*reference, messages)
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == inputs["input_ids"][0].tolist() and len(images) == 2
    expected = assert_logits_match(llm, reference[0], inputs, images)
    assert max_diff(llm.logits(ids, chunk_size=9, images=images), expected) < 1e-4


def test_the_auto_path_takes_images_too(folder, llm):
    """The packed-kernel path runs the encoder's block projections on our kernels, near float32's."""
    from wallbreaker import LLM, SamplingParams
    from wallbreaker.layers.linear import QuantLinear
    auto = LLM(folder, kv_cache_memory_gb=0.05, max_model_len=512)
    assert auto.vision.tower.linears and all(isinstance(m, QuantLinear) for m in auto.vision.tower.linears.values())
    pixels = llm.encode_chat_images(conversation(photo()))[2][0].pixels[None]
    exact, packed = llm.vision(pixels), auto.vision(pixels)
    assert ((packed - exact).norm() / exact.norm()).item() < 0.02
    out = auto.chat(conversation(photo()), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_the_same_image_in_a_new_conversation_hits_the_prefix_cache(folder, llm):
    """Its blocks come from the cache (DeepStack's features are in the cached K/V), with a cold run's tokens."""
    from wallbreaker import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cached = float32_llm(folder, 512, kv_block_size=8)
    cached.chat(conversation(photo()), params)
    again = cached.chat(conversation(photo(), "What is in this picture?"), params)[0]
    image = cached.encode_chat_images(conversation(photo()))[2][0]
    assert again.metrics["num_cached_prompt_tokens"] >= image.end // 8 * 8
    cold = llm.chat(conversation(photo(), "What is in this picture?"), params)[0]
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
