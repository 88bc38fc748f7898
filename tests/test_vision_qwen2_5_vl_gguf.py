"""Qwen2.5-VL with images from GGUF: the text model (`qwen2vl`, its M-RoPE sections in
`rope.dimension_sections`) and the `mmproj` (projector type `qwen2.5vl_merger`) that llama.cpp's
converter writes, as `LLM(text_gguf, mmproj=...)`, against transformers'
`Qwen2_5_VLForConditionalGeneration` on the same weights (F32 throughout), float32, on real
photographs; and the same answers as the HF folder. The folder is made with what the mmproj leaves
to clip.cpp's defaults (windows of 112 pixels, 8 to 4096 image tokens), so both preprocess alike."""
from __future__ import annotations

import shutil

import pytest

from vision_models import (assert_greedy_matches, assert_logits_match, assert_same_answers, conversation,
                           convert_pair, float32_llm, photo, qwen2_vl_inputs)
from wallbreaker.errors import InvalidRequestError, UnsupportedModelError

pytest.importorskip("tiny_recurrent")
MAX_LEN = 512  # a 512x512 photograph is 18x18 = 324 image tokens at clip.cpp's bounds


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter, packaged_model):
    from tiny_qwen2_5_vl import make_tiny_qwen2_5_vl
    from wallbreaker.vision.qwen2_5_vl_mmproj import MAX_TOKENS, MIN_TOKENS, WINDOW
    packaged_model("smollm2")  # its tokenizer is one the converter recognizes
    root = tmp_path_factory.mktemp("tiny_qwen2_5_vl_gguf")
    folder = make_tiny_qwen2_5_vl(root / "hf", window_size=WINDOW, min_pixels=MIN_TOKENS * 28 * 28,
                                  max_pixels=MAX_TOKENS * 28 * 28)
    text, mmproj = convert_pair(llamacpp_converter, folder, root / "gguf")
    return folder, text, mmproj


@pytest.fixture(scope="module")
def reference(files):
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
    from tiny_qwen2_5_vl import CLIP_MEAN, CLIP_STD
    from wallbreaker.vision.qwen2_5_vl_mmproj import MAX_TOKENS, MIN_TOKENS
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(files[0], dtype=torch.float32).eval()
    size = {"shortest_edge": MIN_TOKENS * 28 * 28, "longest_edge": MAX_TOKENS * 28 * 28}
    images = Qwen2VLImageProcessorPil(size=size, image_mean=CLIP_MEAN, image_std=CLIP_STD)
    return model, AutoTokenizer.from_pretrained(files[0]), images


@pytest.fixture(scope="module")
def llm(files):
    _, text, mmproj = files
    return float32_llm(text, MAX_LEN, mmproj=str(mmproj))


@pytest.mark.parametrize("name", ["astronaut", "rocket"])
def test_gguf_pair_logits_match_transformers(llm, reference, name):
    messages = conversation(photo(name))
    inputs = qwen2_vl_inputs(*reference, messages)
    _, ids, images = llm.encode_chat_images(messages)
    assert ids == inputs["input_ids"][0].tolist() and len(images) == 1
    grid = inputs["image_grid_thw"][0].tolist()
    assert images[0].grid == (grid[1] // 2, grid[2] // 2)
    assert_logits_match(llm, reference[0], inputs, images)


def test_gguf_pair_greedy_tokens_match_transformers_generate(llm, reference):
    messages = conversation(photo("coffee"))
    assert_greedy_matches(llm, reference[0], qwen2_vl_inputs(*reference, messages), messages)


def test_gguf_pair_answers_as_the_folder_does(files, llm):
    assert_same_answers(llm, float32_llm(files[0], MAX_LEN), conversation(photo("chelsea")))


def test_an_mmproj_beside_the_text_gguf_is_found(files, tmp_path):
    _, text, mmproj = files
    shutil.copy(text, tmp_path / "model.gguf")
    assert float32_llm(tmp_path / "model.gguf", MAX_LEN, kv_cache_memory_gb=0.02).takes_images is False
    shutil.copy(mmproj, tmp_path / "mmproj-model.gguf")
    assert float32_llm(tmp_path / "model.gguf", MAX_LEN, kv_cache_memory_gb=0.02).takes_images is True


def test_an_mmproj_of_another_family_is_refused(files, tiny_gemma3):
    _, text, mmproj = files
    with pytest.raises(InvalidRequestError, match="goes with qwen2vl text models, not gemma3"):
        float32_llm(tiny_gemma3.gguf_path, MAX_LEN, mmproj=str(mmproj), kv_cache_memory_gb=0.02)


@pytest.mark.parametrize("sections", [[2, 3, 2, 1], [2, 3], "2,3,3"])
def test_mrope_sections_other_than_three_are_refused(sections):
    """Qwen2-VL and 2.5-VL pad the sections to four with a 0; a fourth that is not 0 changes the math."""
    from types import SimpleNamespace
    from wallbreaker.formats.llama import qwen2vl_gguf_fields
    keys = SimpleNamespace(name="m.gguf", a="qwen2vl.", raw=lambda key: sections)
    assert qwen2vl_gguf_fields(SimpleNamespace(name="m.gguf", a="qwen2vl.", raw=lambda key: [2, 3, 3, 0])) == \
        {"mrope_section": (2, 3, 3)}
    with pytest.raises(UnsupportedModelError, match="qwen2vl.rope.dimension_sections"):
        qwen2vl_gguf_fields(keys)
