"""A multimodal checkpoint (Gemma 3's `Gemma3ForConditionalGeneration`) holds its decoder under a
prefix, beside the vision tower and projector: the text reader takes the decoder's tensors under
the text model's names and leaves the others to the vision loader (wallbreaker.vision)."""
from __future__ import annotations

# (prefix, what it stands for in a text-only checkpoint): transformers 5 saves `language_model.model.*`,
# 4.5x `model.language_model.*`; some older exports keep the head as `language_model.lm_head.*`.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def text_tensor_name(hf_name: str) -> str | None:
    """The text model's name for a tensor of a multimodal checkpoint; None for the vision side's."""
    if hf_name.startswith(_VISION_PREFIXES):
        return None
    for prefix, plain in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix):]
    return hf_name


def is_multimodal(hf: dict) -> bool:
    """A config of a vision-language model whose decoder wallbreaker reads (Gemma 3's)."""
    return hf.get("model_type") == "gemma3" and isinstance(hf.get("text_config"), dict)
