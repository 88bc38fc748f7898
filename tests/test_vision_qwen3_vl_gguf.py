"""Qwen3-VL with images from GGUF: the text model (`qwen3vl`: interleaved M-RoPE sections,
`n_deepstack_layers`) and the `mmproj` (projector type `qwen3vl_merger`, with its DeepStack mergers)
that llama.cpp's converter writes, as `LLM(text_gguf, mmproj=...)`, against transformers'
`Qwen3VLForConditionalGeneration` on the same weights (F32 throughout), float32, on real
photographs; and the same answers as the HF folder, made with clip.cpp's bounds (8 to 4096 image
tokens) so that both preprocess alike."""
from __future__ import annotations

import pytest

from vision_models import (assert_greedy_matches, assert_logits_match, assert_same_answers, conversation,
                           convert_pair, float32_llm, photo, qwen2_vl_inputs)
from wallbreaker.errors import InvalidRequestError

pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
pytest.importorskip("tiny_recurrent")
MAX_LEN = 512  # a 512x512 photograph is 16x16 = 256 image tokens at clip.cpp's bounds
UNIT = 32 * 32  # pixels of a merged block


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter, packaged_model):
    from tiny_qwen3_vl import make_tiny_qwen3_vl
    from wallbreaker.vision.qwen2_5_vl_mmproj import MAX_TOKENS, MIN_TOKENS
    packaged_model("smollm2")  # its tokenizer is one the converter recognizes
    root = tmp_path_factory.mktemp("tiny_qwen3_vl_gguf")
    folder = make_tiny_qwen3_vl(root / "hf", min_pixels=MIN_TOKENS * UNIT, max_pixels=MAX_TOKENS * UNIT)
    return (folder, *convert_pair(llamacpp_converter, folder, root / "gguf"))


@pytest.fixture(scope="module")
def reference(files):
    import torch
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration
    from tiny_qwen3_vl import HALF
    from wallbreaker.vision.qwen2_5_vl_mmproj import MAX_TOKENS, MIN_TOKENS
    model = Qwen3VLForConditionalGeneration.from_pretrained(files[0], dtype=torch.float32).eval()
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_TOKENS * UNIT, "longest_edge": MAX_TOKENS * UNIT},
                                      patch_size=16, image_mean=HALF, image_std=HALF)
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
    assert llm.model_config.mrope_interleaved and len(llm.vision.tower.cfg.deepstack_visual_indexes) == 2
    assert_logits_match(llm, reference[0], inputs, images)


def test_gguf_pair_greedy_tokens_match_transformers_generate(llm, reference):
    messages = conversation(photo("coffee"))
    assert_greedy_matches(llm, reference[0], qwen2_vl_inputs(*reference, messages), messages)


def test_gguf_pair_answers_as_the_folder_does(files, llm):
    assert_same_answers(llm, float32_llm(files[0], MAX_LEN), conversation(photo("chelsea")))


def test_an_mmproj_of_another_family_is_refused(files, tiny_gemma3):
    with pytest.raises(InvalidRequestError, match="qwen3vl_merger projector goes with qwen3vl text models, not gemma3"):
        float32_llm(tiny_gemma3.gguf_path, MAX_LEN, mmproj=str(files[2]), kv_cache_memory_gb=0.02)
