"""A tiny random-weight SmolVLM, as SmolVLM-256M-Instruct is saved (`Idefics3ForConditionalGeneration`,
model_type `idefics3`), built by transformers.

The folder is what a real one holds: config.json with text_config (Llama) and vision_config, the
weights, SmolLM2's tokenizer with SmolVLM's added tokens (`<fake_token_around_image>`, `<image>`,
`<global-img>`, `<end_of_utterance>`, `<row_i_col_j>`), SmolVLM's chat template, and the
processor's files (`Idefics3Processor`, as SmolVLM-256M's, with the PIL image processor), all written by `save_pretrained`.

Sizes: tiles of 32x32 pixels in 4x4 patches (64 patches), pixel-shuffled by 2 to 16 image tokens a
tile; an image is first resized to a longest edge of 96, so a photograph becomes up to 3x3 tiles
plus the global image.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

TILE, PATCH, SCALE, LONGEST = 32, 4, 2, 96
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // SCALE ** 2
ADDED = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct): an image part becomes <image>, which
# the processor expands into the image's tiles.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


@dataclass(frozen=True)
class SmolVLMShape:
    """The sizes of a SmolVLM: the tiny one the tests use by default; `SMOLVLM_256M` is
    HuggingFaceTB/SmolVLM-256M-Instruct's (for benchmarks/vision.py, with random weights)."""

    text: dict = field(default_factory=lambda: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    vision: dict = field(default_factory=lambda: dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                      num_attention_heads=2))
    tile: int = TILE
    patch: int = PATCH
    scale: int = SCALE
    longest: int = LONGEST

    @property
    def tokens_per_tile(self) -> int:
        return (self.tile // self.patch) ** 2 // self.scale ** 2


SMOLVLM_256M = SmolVLMShape(
    text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, head_dim=64),
    vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
    tile=512, patch=16, scale=4, longest=2048)


def make_tiny_smolvlm(out: Path, seed: int = 0, family: str = "Idefics3", shape: SmolVLMShape = SmolVLMShape()) -> Path:
    """The folder of a tiny SmolVLM under `out`; returns it. `family` "SmolVLM": saved as SmolVLM2's
    are (`SmolVLMForConditionalGeneration`, model_type `smolvlm`); the processor stays Idefics3's
    (SmolVLM's needs `num2words`), the same preprocessing and prompt. `shape`: its sizes."""
    import transformers as tf
    from tiny_recurrent import smollm2_tokenizer
    from tokenizers import AddedToken

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = smollm2_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in ADDED]})
    tok.chat_template = SMOLVLM_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in ADDED}
    text = tf.LlamaConfig(vocab_size=len(tok), **shape.text, max_position_embeddings=max(1024, 8 * shape.longest),
                          rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    vision = getattr(tf, f"{family}VisionConfig")(**shape.vision, image_size=shape.tile, patch_size=shape.patch,
                                                  layer_norm_eps=1e-6)
    config = getattr(tf, f"{family}Config")(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                            scale_factor=shape.scale, image_token_id=ids["<image>"],
                                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(tf, f"{family}ForConditionalGeneration")(config).float().eval()
    with torch.no_grad():  # weights large enough for peaked logits, norms off their neutral values
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "vision_model" in name and p.dim() >= 2:
                p.normal_(0.0, 0.15)
            elif "connector" in name:
                p.normal_(0.0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    # as SmolVLM-256M's config.json names its decoder (llama.cpp's converter reads the text model by it)
    saved = json.loads((out / "config.json").read_text())
    saved["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    images = tf.Idefics3ImageProcessorPil(size={"longest_edge": shape.longest},
                                         max_image_size={"longest_edge": shape.tile}, do_image_splitting=True)
    processor = tf.Idefics3Processor(image_processor=images, tokenizer=tok, chat_template=SMOLVLM_CHAT_TEMPLATE,
                                     image_seq_len=shape.tokens_per_tile)
    processor.save_pretrained(out)
    return out
