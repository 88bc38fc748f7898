"""A multimodal checkpoint (Gemma 3's `Gemma3ForConditionalGeneration`, SmolVLM's
`Idefics3ForConditionalGeneration`) holds its decoder under a
prefix, beside the vision tower and projector: the text reader takes the decoder's tensors under
the text model's names and leaves the others to the vision loader (wallbreaker.vision)."""
from __future__ import annotations

# (prefix, what it stands for in a text-only checkpoint): transformers 5 saves `language_model.model.*`,
# 4.5x `model.language_model.*`; some older exports keep the head as `language_model.lm_head.*`.
# Idefics3 / SmolVLM keep their Llama decoder as `model.text_model.*`.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("model.text_model.", "model."))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.",
                    "model.vision_model.", "model.connector.", "model.visual.", "visual.")
# model_type -> the decoder's model_type, for the vision-language configs whose decoder is text_config
_DECODERS = {"gemma3": "gemma3_text", "idefics3": "llama", "smolvlm": "llama", "qwen2_5_vl": "qwen2",
             "qwen3_vl": "qwen3"}


def text_tensor_name(hf_name: str) -> str | None:
    """The text model's name for a tensor of a multimodal checkpoint; None for the vision side's."""
    if hf_name.startswith(_VISION_PREFIXES):
        return None
    for prefix, plain in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix):]
    return hf_name


def is_multimodal(hf: dict) -> bool:
    """A config of a vision-language model whose decoder wallbreaker reads (Gemma 3's, SmolVLM's)."""
    model_type = hf.get("model_type")
    return isinstance(model_type, str) and model_type in _DECODERS and isinstance(hf.get("text_config"), dict)


def decoder_config(hf: dict) -> dict:
    """The decoder's config of a vision-language model's (its text_config, under its own model_type)."""
    text = hf["text_config"]
    if hf.get("model_type") != "gemma3" and "tie_word_embeddings" in hf:
        text = {**text, "tie_word_embeddings": hf["tie_word_embeddings"]}  # Idefics3 ties at the top level
    return {**text, "model_type": _DECODERS[hf["model_type"]]}


def is_vision_tensor(hf_name: str) -> bool:
    return hf_name.startswith(_VISION_PREFIXES)
