"""Gemma 3 with images from GGUF: the text model and the `mmproj` file that llama.cpp's converter
writes (`convert_hf_to_gguf.py` and `--mmproj`), as `LLM(text_gguf, mmproj=...)`, against transformers'
`Gemma3ForConditionalGeneration` on the same weights (the converter stores the projection as F16, so
the reference gets it rounded the same way), float32, on a real photograph."""
from __future__ import annotations

import shutil

import pytest
import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker.errors import InvalidRequestError, ModelFormatError

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
pytest.importorskip("tiny_recurrent")


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter, packaged_model):
    from llamacpp_converter import convert
    from tiny_vision import make_tiny_gemma3_vision
    packaged_model("smollm2")  # its tokenizer is one the converter recognizes
    root = tmp_path_factory.mktemp("tiny_gemma3_vision_gguf")
    folder = make_tiny_gemma3_vision(root / "hf", convertible=True)
    (root / "gguf").mkdir()
    text = convert(llamacpp_converter, folder, "f32", root / "gguf" / "model-f32.gguf")
    mmproj = convert(llamacpp_converter, folder, "f32", root / "gguf" / "mmproj-model-f32.gguf", ("--mmproj",))
    return folder, text, mmproj


@pytest.fixture(scope="module")
def reference(files):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    model = Gemma3ForConditionalGeneration.from_pretrained(files[0], dtype=torch.float32).eval()
    with torch.no_grad():  # as the converter stores it (tensor_force_quant: F16)
        w = model.model.multi_modal_projector.mm_input_projection_weight
        w.copy_(w.half().float())
    return model, AutoProcessor.from_pretrained(files[0])


@pytest.fixture(scope="module")
def llm(files):
    _, text, mmproj = files
    return LLM(text, mmproj=str(mmproj), dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)


def messages(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "Describe the image."}]}]


def hf_inputs(processor, image):
    return processor.apply_chat_template(messages(image), add_generation_prompt=True, tokenize=True,
                                         return_dict=True, return_tensors="pt")


def test_gguf_pair_logits_and_greedy_tokens_match_transformers(llm, reference):
    model, processor = reference
    image = Image.fromarray(skdata.astronaut())
    inputs = hf_inputs(processor, image)
    _, ids, images = llm.encode_chat_images(messages(image))
    assert ids == inputs["input_ids"][0].tolist()
    assert torch.equal(images[0].pixels, inputs["pixel_values"][0])
    with torch.no_grad():
        expected = model(**inputs).logits[0]
        generated = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert (llm.logits(ids, images=images) - expected).abs().max().item() < 1e-4
    out = llm.chat(messages(image), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == generated


def test_gguf_pair_answers_as_the_folder_does(files, llm):
    folder_llm = LLM(files[0], dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)
    image = Image.fromarray(skdata.coffee())
    a = llm.chat(messages(image), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    b = folder_llm.chat(messages(image), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for ra, rb in zip(a.outputs[0].top_logprobs, b.outputs[0].top_logprobs):  # the F16 projection: within 1e-3
        assert [t for t, _ in ra] == [t for t, _ in rb]
        assert max(abs(x - y) for (_, x), (_, y) in zip(ra, rb)) < 1e-3


def test_an_mmproj_beside_the_text_gguf_is_found(files, tmp_path):
    _, text, mmproj = files
    shutil.copy(text, tmp_path / "model.gguf")
    assert LLM(tmp_path / "model.gguf", dtype="float32", kv_cache_memory_gb=0.02).takes_images is False
    shutil.copy(mmproj, tmp_path / "mmproj-model.gguf")
    assert LLM(tmp_path / "model.gguf", dtype="float32", kv_cache_memory_gb=0.02).takes_images is True


def test_wrong_mmproj_files_are_refused(files, tiny_gemma3):
    folder, text, mmproj = files
    with pytest.raises(ModelFormatError, match="not a vision mmproj"):
        LLM(text, mmproj=str(text), dtype="float32", kv_cache_memory_gb=0.02)
    with pytest.raises(InvalidRequestError, match="mmproj goes with a GGUF"):
        LLM(folder, mmproj=str(mmproj), dtype="float32", kv_cache_memory_gb=0.02)
    with pytest.raises((InvalidRequestError, ModelFormatError), match="not this model's|has no <start_of_image>"):
        LLM(tiny_gemma3.gguf_path, mmproj=str(mmproj), dtype="float32", kv_cache_memory_gb=0.02)
