"""Qwen2.5-VL with images against transformers' `Qwen2_5_VLForConditionalGeneration` on the same tiny
random weights and real photographs, float32: the prompt (expanded as `Qwen2_5_VLProcessor` does),
the encoder's output, the logits of every position under the decoder's M-RoPE (3D positions for an
image's tokens, the text after it resuming past the image's larger side), greedy tokens, two
images, chunked prefill."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vision_models import (assert_greedy_matches, conversation, data_url, float32_llm, photo, qwen2_vl_inputs,
                           reference_logits)
from wallbreaker import LLM, SamplingParams

pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
pytest.importorskip("tiny_recurrent")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, packaged_model):
    from tiny_qwen2_5_vl import make_tiny_qwen2_5_vl
    packaged_model("smollm2")
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
    from tiny_qwen2_5_vl import CLIP_MEAN, CLIP_STD, MAX_PIXELS
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": MAX_PIXELS},
                                      image_mean=CLIP_MEAN, image_std=CLIP_STD)
    return model, AutoTokenizer.from_pretrained(folder), images


@pytest.fixture(scope="module")
def llm(folder):
    return float32_llm(folder, 512)


def hf_inputs(reference, messages) -> dict:
    return qwen2_vl_inputs(*reference, messages)


def test_prompt_and_encoder_match_transformers(llm, reference):
    model = reference[0]
    messages = conversation(photo("chelsea"))
    inputs = hf_inputs(reference, messages)
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == inputs["input_ids"][0].tolist() and len(images) == 1
    grid = inputs["image_grid_thw"][0].tolist()
    assert images[0].grid == (grid[1] // 2, grid[2] // 2) and images[0].length == grid[1] * grid[2] // 4
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
    got = llm.vision(images[0].pixels[None])[0]
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["astronaut", "rocket"])
def test_teacher_forced_logits_match_transformers(llm, reference, name):
    model = reference[0]
    messages = conversation(photo(name))
    expected = reference_logits(model, hf_inputs(reference, messages))
    _, ids, images = llm.encode_chat_images(messages)
    got = llm.logits(ids, images=images)
    assert (got - expected).abs().max().item() < 1e-4
    # M-RoPE matters: the image's tokens at plain positions give other logits
    plain = [dataclasses.replace(im, grid=None) for im in images]
    assert (llm.logits(ids, images=plain) - expected).abs().max().item() > 1e-3


def test_greedy_tokens_match_transformers_generate(llm, reference):
    """16 greedy tokens and the first step's top-5 log-probabilities."""
    messages = conversation(photo())
    assert_greedy_matches(llm, reference[0], hf_inputs(reference, messages), messages)


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_chunked_prefill_gives_the_same_logits(llm, chunk):
    _, ids, images = llm.encode_chat_images(conversation(photo("coffee")))
    whole = llm.logits(ids, images=images)
    assert (llm.logits(ids, chunk_size=chunk, images=images) - whole).abs().max().item() < 1e-5


def test_two_images_in_two_turns_match_transformers(llm, reference):
    model = reference[0]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": photo("astronaut")},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                     {"type": "image", "image": photo("camera")}]}]
    inputs = hf_inputs(reference, messages)
    expected = reference_logits(model, inputs)
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == inputs["input_ids"][0].tolist() and len(images) == 2
    assert (llm.logits(ids, images=images) - expected).abs().max().item() < 1e-4
    assert (llm.logits(ids, chunk_size=9, images=images) - expected).abs().max().item() < 1e-4


def test_the_auto_path_and_the_prefix_cache_take_images_too(folder, llm):
    """The packed-kernel path runs the encoder's projections on our kernels, near the float32 ones; the
    same image in a new conversation comes from the prefix cache, with the cold run's tokens."""
    from wallbreaker.layers.linear import QuantLinear
    auto = LLM(folder, kv_cache_memory_gb=0.05, max_model_len=512)
    assert auto.vision.tower.linears and all(isinstance(m, QuantLinear) for m in auto.vision.tower.linears.values())
    pixels = llm.encode_chat_images(conversation(photo()))[2][0].pixels[None]
    exact, packed = llm.vision(pixels), auto.vision(pixels)
    assert ((packed - exact).norm() / exact.norm()).item() < 0.02
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cached = float32_llm(folder, 512, kv_block_size=8)
    cached.chat(conversation(photo()), params)
    again = cached.chat(conversation(photo(), "What is in this picture?"), params)[0]
    image = cached.encode_chat_images(conversation(photo()))[2][0]
    assert again.metrics["num_cached_prompt_tokens"] >= image.end // 8 * 8
    cold = llm.chat(conversation(photo(), "What is in this picture?"), params)[0]
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_openai_client_gets_llm_chats_text(folder, llm):
    openai = pytest.importorskip("openai")
    from server_apps import make_app, running_server
    from server_process import free_port

    url = data_url(photo("coffee"))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe the image."}]}]
    expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    with running_server(make_app(folder, max_model_len=512, port=free_port())) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="m", temperature=0, max_tokens=8, messages=messages,
                                                extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == expected
