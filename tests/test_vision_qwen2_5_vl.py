"""Qwen2.5-VL with images against transformers' `Qwen2_5_VLForConditionalGeneration` on the same tiny
random weights and real photographs, float32: the prompt (expanded as `Qwen2_5_VLProcessor` does),
the encoder's output, the logits of every position under the decoder's M-RoPE (3D positions for an
image's tokens, the text after it resuming past the image's larger side), greedy tokens, two
images, chunked prefill."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from wallbreaker import LLM, SamplingParams

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
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
    return LLM(folder, dtype="float32", kv_cache_memory_gb=0.05, max_model_len=512)


def photo(name: str = "astronaut"):
    return Image.fromarray(getattr(skdata, name)())


def conversation(image, text: str = "Describe the image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def hf_inputs(reference, messages) -> dict:
    """What `Qwen2_5_VLProcessor.apply_chat_template` gives: the template's text, each <|image_pad|>
    repeated once per merged block of its image, tokenized; the reference image processor's patches."""
    model, tokenizer, processor = reference
    images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
    pixels = processor(images=images, return_tensors="pt")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = text.split("<|image_pad|>")
    counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
    text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    types = (ids == model.config.image_token_id).int()
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
            "mm_token_type_ids": types}


def logits_of(model, inputs) -> torch.Tensor:
    model.model.rope_deltas = None
    with torch.no_grad():
        return model(**inputs).logits[0]


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
    expected = logits_of(model, hf_inputs(reference, messages))
    _, ids, images = llm.encode_chat_images(messages)
    got = llm.logits(ids, images=images)
    assert (got - expected).abs().max().item() < 1e-4
    # M-RoPE matters: the image's tokens at plain positions give other logits
    plain = [dataclasses.replace(im, grid=None) for im in images]
    assert (llm.logits(ids, images=plain) - expected).abs().max().item() > 1e-3


def test_greedy_tokens_match_transformers_generate(llm, reference):
    model = reference[0]
    messages = conversation(photo())
    inputs = hf_inputs(reference, messages)
    model.model.rope_deltas = None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    got = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert len(expected) == 12 and got.outputs[0].token_ids == expected


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
                                     {"type": "image", "image": Image.fromarray(skdata.camera())}]}]
    inputs = hf_inputs(reference, messages)
    expected = logits_of(model, inputs)
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
    cached = LLM(folder, dtype="float32", kv_cache_memory_gb=0.05, max_model_len=512, kv_block_size=8)
    cached.chat(conversation(photo()), params)
    again = cached.chat(conversation(photo(), "What is in this picture?"), params)[0]
    image = cached.encode_chat_images(conversation(photo()))[2][0]
    assert again.metrics["num_cached_prompt_tokens"] >= image.end // 8 * 8
    cold = llm.chat(conversation(photo(), "What is in this picture?"), params)[0]
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_openai_client_gets_llm_chats_text(folder, llm):
    openai = pytest.importorskip("openai")
    import base64
    import io
    from server_apps import make_app, running_server
    from server_process import free_port

    buf = io.BytesIO()
    photo("coffee").save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe the image."}]}]
    expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    with running_server(make_app(folder, max_model_len=512, port=free_port())) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="m", temperature=0, max_tokens=8, messages=messages,
                                                extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == expected
