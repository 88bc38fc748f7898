"""A tiny random-weight Qwen3-VL (`Qwen3VLForConditionalGeneration`), built by transformers.

As tests/tiny_qwen2_5_vl.py's Qwen2.5-VL (SmolLM2's tokenizer with Qwen's vision tokens, the chat
template's image parts), with Qwen3-VL's parts: a Qwen3 decoder (q/k RMSNorm) with interleaved M-RoPE
sections, a vision encoder of 16-pixel patches with a learned 4x4 table of position embeddings
(resampled to every image's grid), and DeepStack mergers after blocks 0 and 2 (their features added
after the decoder's first two layers). `preprocessor_config.json`: `Qwen2VLImageProcessor` at
patch 16, mean and std 0.5, at most 36 image tokens."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_qwen2_5_vl import ADDED, QWEN2_5_VL_CHAT_TEMPLATE, randomize

UNIT = 32  # pixels of a merged block's side: patch 16, merge 2
MAX_PIXELS = UNIT * UNIT * 36
MIN_PIXELS = UNIT * UNIT * 4
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 2],
              hidden_act="gelu_pytorch_tanh")
HALF = [0.5, 0.5, 0.5]


def make_tiny_qwen3_vl(out: Path, seed: int = 0, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> Path:
    """The pixel bounds as llama.cpp's clip.cpp takes them (8 and 4096 merged blocks) make a folder whose
    GGUF pair preprocesses as the folder does."""
    import transformers as tf
    from tiny_recurrent import smollm2_tokenizer
    from tokenizers import AddedToken

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = smollm2_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in ADDED]})
    tok.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in ADDED}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, head_dim=16,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    config = tf.Qwen3VLConfig(text_config=text, vision_config={**VISION, "out_hidden_size": 64},
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Qwen3VLForConditionalGeneration(config).float().eval()
    randomize(model, lambda name: "norm" in name and name.endswith("weight"))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": min_pixels, "max_pixels": max_pixels,
        "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": HALF, "image_std": HALF,
        "resample": 3, "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True}, indent=2))
    return out
