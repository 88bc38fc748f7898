"""What the vision tests share: real photographs (scikit-image's), the conversations and data URLs
that carry them, a float32 `LLM`, and the comparisons against transformers' model on the same
weights (issue 50's acceptance: teacher-forced logits within 1e-4, 16 greedy tokens equal to its
`generate`, the first step's top-5 log-probabilities within 1e-3; two of our own models, e.g. a
folder and its GGUF pair, give the same tokens and top-5 log-probabilities within 1e-3).

The tiny models themselves are built by tests/tiny_vision.py (Gemma 3), tiny_smolvlm.py and
tiny_qwen2_5_vl.py; the reference's inputs come from the family's transformers processor."""
from __future__ import annotations

import base64
import io

import pytest
import torch

from wallbreaker import LLM, SamplingParams

GREEDY_TOKENS = 16
LOGITS_TOL = 1e-4  # float32 against float32
LOGPROBS_TOL = 1e-3


def photo(name: str = "astronaut"):
    """A scikit-image photograph as a PIL image (skips without scikit-image)."""
    image = pytest.importorskip("PIL.Image")
    skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")
    return image.fromarray(getattr(skdata, name)())


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def conversation(image, text: str = "Describe the image.") -> list[dict]:
    """One user turn: `image` (a PIL image, or a content part as given) then `text`."""
    part = image if isinstance(image, dict) else {"type": "image", "image": image}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def float32_llm(path, max_model_len: int, **kwargs) -> LLM:
    """The exact path (float32 torch throughout) with a small KV cache."""
    return LLM(path, dtype="float32", kv_cache_memory_gb=kwargs.pop("kv_cache_memory_gb", 0.05),
               max_model_len=max_model_len, **kwargs)


def processor_inputs(processor, messages: list[dict]) -> dict:
    """The reference's inputs for `messages`: the processor's chat template, tokens and pixels."""
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


def _fresh(model) -> None:
    """Qwen2.5-VL keeps the last prompt's M-RoPE offset between calls; each call here starts anew."""
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None


def reference_logits(model, inputs: dict) -> torch.Tensor:
    """transformers' [prompt length, vocab] logits of one prompt."""
    _fresh(model)
    with torch.no_grad():
        return model(**inputs).logits[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def assert_logits_match(llm: LLM, model, inputs: dict, images, tol: float = LOGITS_TOL) -> torch.Tensor:
    """Every position's logits within `tol` of transformers' (the prompt's ids are `inputs`'); the
    reference's logits."""
    expected = reference_logits(model, inputs)
    got = llm.logits(inputs["input_ids"][0].tolist(), images=images)
    assert max_diff(got, expected) < tol
    return expected


def assert_greedy_matches(llm: LLM, model, inputs: dict, messages: list[dict], tokens: int = GREEDY_TOKENS) -> None:
    """`llm.chat(messages)`'s greedy tokens are transformers' `generate` on `inputs` (the same prompt),
    and its first step's top-5 log-probabilities are within 1e-3 of the reference's, in its order."""
    _fresh(model)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    expected = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    top = torch.log_softmax(out.logits[0][0].double(), dim=-1).topk(5)
    got = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=5))[0]
    assert len(expected) == tokens and got.outputs[0].token_ids == expected
    first = got.outputs[0].top_logprobs[0]
    assert [t for t, _ in first] == top.indices.tolist()
    assert max(abs(lp - ref) for (_, lp), ref in zip(first, top.values.tolist())) < LOGPROBS_TOL


def assert_same_answers(a: LLM, b: LLM, messages: list[dict], tokens: int = 8) -> None:
    """Two of our models of the same weights (a folder and its GGUF pair) give the same greedy tokens
    and, at every step, the same top-5 tokens with log-probabilities within 1e-3."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    x, y = a.chat(messages, params)[0].outputs[0], b.chat(messages, params)[0].outputs[0]
    assert x.token_ids == y.token_ids
    for rx, ry in zip(x.top_logprobs, y.top_logprobs):
        assert [t for t, _ in rx] == [t for t, _ in ry]
        assert max(abs(p - q) for (_, p), (_, q) in zip(rx, ry)) < LOGPROBS_TOL


def qwen2_vl_inputs(model, tokenizer, image_processor, messages: list[dict]) -> dict:
    """What `Qwen2_5_VLProcessor.apply_chat_template` gives (it needs torchvision, for its video
    processor, so this does its work): the template's text, each <|image_pad|> repeated once per merged
    block of its image, tokenized; `image_processor`'s patches and grids."""
    images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
    pixels = image_processor(images=images, return_tensors="pt")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = text.split("<|image_pad|>")
    counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
    text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
            "mm_token_type_ids": (ids == model.config.image_token_id).int()}


def convert_pair(converter, folder, out) -> tuple:
    """llama.cpp's converter on `folder`: the F32 text GGUF and its mmproj in the folder `out`."""
    from llamacpp_converter import convert
    out.mkdir(parents=True, exist_ok=True)
    return (convert(converter, folder, "f32", out / "model-f32.gguf"),
            convert(converter, folder, "f32", out / "mmproj-model-f32.gguf", ("--mmproj",)))
