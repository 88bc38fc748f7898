"""SmolVLM with images from GGUF: the text model and the `mmproj` file that llama.cpp's converter
writes (`convert_hf_to_gguf.py`, and `--mmproj`: projector type `idefics3`), as
`LLM(text_gguf, mmproj=...)`, against transformers' `Idefics3ForConditionalGeneration` on the same
weights (F32 throughout), float32, on real photographs; and the same answers as the HF folder."""
from __future__ import annotations

import shutil

import pytest
import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker.errors import InvalidRequestError

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
pytest.importorskip("tiny_recurrent")


@pytest.fixture(scope="module")
def files(tmp_path_factory, llamacpp_converter, packaged_model, tiny_smolvlm):
    from llamacpp_converter import convert
    packaged_model("smollm2")  # its tokenizer is the one SmolVLM's extends
    root = tmp_path_factory.mktemp("tiny_smolvlm_gguf")
    text = convert(llamacpp_converter, tiny_smolvlm, "f32", root / "model-f32.gguf")
    mmproj = convert(llamacpp_converter, tiny_smolvlm, "f32", root / "mmproj-model-f32.gguf", ("--mmproj",))
    return tiny_smolvlm, text, mmproj


@pytest.fixture(scope="module")
def reference(files):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration
    model = Idefics3ForConditionalGeneration.from_pretrained(files[0], dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(files[0])


@pytest.fixture(scope="module")
def llm(files):
    _, text, mmproj = files
    return LLM(text, mmproj=str(mmproj), dtype="float32", kv_cache_memory_gb=0.05, max_model_len=1024)


def messages(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "Describe the image."}]}]


@pytest.mark.parametrize("name", ["astronaut", "camera"])
def test_gguf_pair_logits_and_greedy_tokens_match_transformers(llm, reference, name):
    model, processor = reference
    image = Image.fromarray(getattr(skdata, name)())
    inputs = processor.apply_chat_template(messages(image), add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    _, ids, images = llm.encode_chat_images(messages(image))
    assert ids == inputs["input_ids"][0].tolist()
    assert len(images) == inputs["pixel_values"].shape[1]
    assert all(torch.equal(im.pixels, px) for im, px in zip(images, inputs["pixel_values"][0]))
    with torch.no_grad():
        expected = model(**inputs).logits[0]
        generated = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert (llm.logits(ids, images=images) - expected).abs().max().item() < 1e-4
    out = llm.chat(messages(image), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert len(generated) == 12 and out.outputs[0].token_ids == generated


def test_gguf_pair_answers_as_the_folder_does(files, llm):
    folder_llm = LLM(files[0], dtype="float32", kv_cache_memory_gb=0.05, max_model_len=1024)
    image = Image.fromarray(skdata.coffee())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    a, b = llm.chat(messages(image), params)[0], folder_llm.chat(messages(image), params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for ra, rb in zip(a.outputs[0].top_logprobs, b.outputs[0].top_logprobs):
        assert [t for t, _ in ra] == [t for t, _ in rb]
        assert max(abs(x - y) for (_, x), (_, y) in zip(ra, rb)) < 1e-3


def test_an_mmproj_beside_the_text_gguf_is_found(files, tmp_path):
    _, text, mmproj = files
    shutil.copy(text, tmp_path / "model.gguf")
    shutil.copy(mmproj, tmp_path / "mmproj-model.gguf")
    assert LLM(tmp_path / "model.gguf", dtype="float32", kv_cache_memory_gb=0.02).takes_images is True


def test_an_mmproj_of_another_family_is_refused(files, tiny_gemma3):
    _, text, mmproj = files
    with pytest.raises(InvalidRequestError, match="idefics3 projector goes with llama text models, not gemma3"):
        LLM(tiny_gemma3.gguf_path, mmproj=str(mmproj), dtype="float32", kv_cache_memory_gb=0.02)
