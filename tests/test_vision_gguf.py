"""Gemma 3 with images from GGUF: the text model and the `mmproj` file that llama.cpp's converter
writes (`convert_hf_to_gguf.py` and `--mmproj`), as `LLM(text_gguf, mmproj=...)`, against transformers'
`Gemma3ForConditionalGeneration` on the same weights (the converter stores the projection as F16, so
the reference gets it rounded the same way), float32, on a real photograph."""
from __future__ import annotations

import shutil

import pytest
import torch

from vision_models import (assert_greedy_matches, assert_logits_match, assert_same_answers, conversation,
                           convert_pair, float32_llm, photo, processor_inputs)
from wallbreaker.errors import InvalidRequestError, ModelFormatError

pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
pytest.importorskip("tiny_recurrent")


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter, packaged_model):
    from tiny_vision import make_tiny_gemma3_vision
    packaged_model("smollm2")  # its tokenizer is one the converter recognizes
    root = tmp_path_factory.mktemp("tiny_gemma3_vision_gguf")
    folder = make_tiny_gemma3_vision(root / "hf", convertible=True)
    text, mmproj = convert_pair(llamacpp_converter, folder, root / "gguf")
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
    return float32_llm(text, 256, mmproj=str(mmproj))


def test_gguf_pair_logits_and_greedy_tokens_match_transformers(llm, reference):
    model, processor = reference
    messages = conversation(photo())
    inputs = processor_inputs(processor, messages)
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == inputs["input_ids"][0].tolist()
    assert torch.equal(images[0].pixels, inputs["pixel_values"][0])
    assert_logits_match(llm, model, inputs, images)
    assert_greedy_matches(llm, model, inputs, messages)


def test_gguf_pair_answers_as_the_folder_does(files, llm):  # the F16 projection: within 1e-3
    assert_same_answers(llm, float32_llm(files[0], 256), conversation(photo("coffee")))


def test_an_mmproj_beside_the_text_gguf_is_found(files, tmp_path):
    _, text, mmproj = files
    shutil.copy(text, tmp_path / "model.gguf")
    assert float32_llm(tmp_path / "model.gguf", 256, kv_cache_memory_gb=0.02).takes_images is False
    shutil.copy(mmproj, tmp_path / "mmproj-model.gguf")
    assert float32_llm(tmp_path / "model.gguf", 256, kv_cache_memory_gb=0.02).takes_images is True


def test_wrong_mmproj_files_are_refused(files, tiny_gemma3):
    folder, text, mmproj = files
    with pytest.raises(ModelFormatError, match="not a vision mmproj"):
        float32_llm(text, 256, mmproj=str(text), kv_cache_memory_gb=0.02)
    with pytest.raises(InvalidRequestError, match="mmproj goes with a GGUF"):
        float32_llm(folder, 256, mmproj=str(mmproj), kv_cache_memory_gb=0.02)
    with pytest.raises((InvalidRequestError, ModelFormatError), match="not this model's|has no <start_of_image>"):
        float32_llm(tiny_gemma3.gguf_path, 256, mmproj=str(mmproj), kv_cache_memory_gb=0.02)
