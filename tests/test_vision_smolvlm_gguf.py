"""SmolVLM with images from GGUF: the text model and the `mmproj` file that llama.cpp's converter
writes (`convert_hf_to_gguf.py`, and `--mmproj`: projector type `idefics3`), as
`LLM(text_gguf, mmproj=...)`, against transformers' `Idefics3ForConditionalGeneration` on the same
weights (F32 throughout), float32, on real photographs; and the same answers as the HF folder."""
from __future__ import annotations

import shutil

import pytest
import torch

from vision_models import (assert_greedy_matches, assert_logits_match, assert_same_answers, conversation,
                           convert_pair, float32_llm, photo, processor_inputs)
from wallbreaker.errors import InvalidRequestError

pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
pytest.importorskip("tiny_recurrent")


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter, packaged_model, tiny_smolvlm):
    packaged_model("smollm2")  # its tokenizer is the one SmolVLM's extends
    root = tmp_path_factory.mktemp("tiny_smolvlm_gguf")
    text, mmproj = convert_pair(llamacpp_converter, tiny_smolvlm, root)
    return tiny_smolvlm, text, mmproj


@pytest.fixture(scope="module")
def reference(files):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration
    model = Idefics3ForConditionalGeneration.from_pretrained(files[0], dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(files[0])


@pytest.fixture(scope="module")
def llm(files):
    _, text, mmproj = files
    return float32_llm(text, 1024, mmproj=str(mmproj))


@pytest.mark.parametrize("name", ["astronaut", "camera"])
def test_gguf_pair_logits_and_greedy_tokens_match_transformers(llm, reference, name):
    model, processor = reference
    messages = conversation(photo(name))
    inputs = processor_inputs(processor, messages)
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == inputs["input_ids"][0].tolist()
    assert len(images) == inputs["pixel_values"].shape[1]
    assert all(torch.equal(im.pixels, px) for im, px in zip(images, inputs["pixel_values"][0]))
    assert_logits_match(llm, model, inputs, images)
    assert_greedy_matches(llm, model, inputs, messages)


def test_gguf_pair_answers_as_the_folder_does(files, llm):
    assert_same_answers(llm, float32_llm(files[0], 1024), conversation(photo("coffee")))


def test_an_mmproj_beside_the_text_gguf_is_found(files, tmp_path):
    _, text, mmproj = files
    shutil.copy(text, tmp_path / "model.gguf")
    shutil.copy(mmproj, tmp_path / "mmproj-model.gguf")
    assert float32_llm(tmp_path / "model.gguf", 1024, kv_cache_memory_gb=0.02).takes_images is True


def test_an_mmproj_of_another_family_is_refused(files, tiny_gemma3):
    _, text, mmproj = files
    with pytest.raises(InvalidRequestError, match="idefics3 projector goes with llama text models, not gemma3"):
        float32_llm(tiny_gemma3.gguf_path, 1024, mmproj=str(mmproj), kv_cache_memory_gb=0.02)
