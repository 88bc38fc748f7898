"""A tiny random-weight Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`), built by transformers.

The folder holds config.json (text_config: a Qwen2 decoder with M-RoPE sections; vision_config: the
windowed encoder), the weights, SmolLM2's tokenizer with Qwen's vision tokens added and a Qwen2.5-VL
chat template (image parts only), and `preprocessor_config.json` for `Qwen2VLImageProcessor` with a
small pixel budget (at most 36 merged blocks, i.e. image tokens, a photograph). transformers'
`Qwen2_5_VLProcessor` needs torchvision (its video processor), so tests expand the prompt as it does:
each `<|image_pad|>` the template writes becomes grid_h * grid_w / 4 of them."""
from __future__ import annotations

import json
from pathlib import Path

import torch

ADDED = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MAX_PIXELS = 28 * 28 * 36
VISION = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3])
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Qwen2.5-VL-Instruct's chat template, its image parts (videos left out)
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def randomize(model, is_norm_scale) -> None:
    """Weights large enough for peaked logits, the norms' scales (`is_norm_scale(name)`) off their
    neutral 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_norm_scale(name):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "visual" in name:
                p.normal_(0.0, 0.1 if p.dim() == 1 else 0.15)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)


def make_tiny_qwen2_5_vl(out: Path, seed: int = 0, window_size: int = 56, min_pixels: int = 56 * 56,
                         max_pixels: int = MAX_PIXELS) -> Path:
    """`window_size` and the pixel bounds as llama.cpp's clip.cpp takes them (112, 8 and 4096 merged
    blocks) make a folder whose GGUF pair preprocesses and encodes as the folder does."""
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
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    vision = {**VISION, "window_size": window_size, "out_hidden_size": 64}
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                 image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                                 vision_start_token_id=ids["<|vision_start|>"],
                                 vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    randomize(model, lambda name: "norm" in name or "ln_q" in name)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": min_pixels, "max_pixels": max_pixels,
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "resample": 3, "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True}, indent=2))
    return out
