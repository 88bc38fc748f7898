"""A tiny random-weight Gemma 3 vision model (`Gemma3ForConditionalGeneration`), built by transformers.

The folder is what a real one holds: config.json with text_config and vision_config, the weights,
a tokenizer with Gemma's special tokens (`<start_of_image>`, `<image_soft_token>`, `<end_of_image>`),
Gemma 3's chat template, and the processor's files (`Gemma3Processor` with the PIL image processor,
as transformers picks it without torchvision), all written by `save_pretrained`.

Sizes: a 64x64 image in 8x8 patches (64 patches), pooled 2x2 to 16 soft tokens per image; the
decoder is tests/tiny_models.py's Gemma 3 (sliding window shorter than an image's block, so that
the window and the image's bidirectional block both bind).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tiny_models import _CORPUS, SPLIT_REGEXES

SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
           "<end_of_image>", "<image_soft_token>")
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 64, 8, 16


@dataclass(frozen=True)
class Gemma3Shape:
    """The sizes of a Gemma 3 vision model: the tiny one the tests use by default; `GEMMA3_4B` is
    google/gemma-3-4b-it's (for benchmarks/vision.py, with random weights, SmolLM2's vocabulary)."""

    text: dict = field(default_factory=lambda: dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                    num_key_value_heads=2, head_dim=16, sliding_window=12))
    layers: int = 0  # 0: the tests' own pattern (6 when convertible); else this many, every sixth global
    vision: dict = field(default_factory=lambda: dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                      num_attention_heads=2))
    image_size: int = IMAGE_SIZE
    patch: int = PATCH
    tokens_per_image: int = TOKENS_PER_IMAGE
    tiny: bool = True  # False: bfloat16 weights at transformers' initialization, as a large model is built


GEMMA3_4B = Gemma3Shape(
    text=dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
              sliding_window=1024),
    layers=34, vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16),
    image_size=896, patch=14, tokens_per_image=256, tiny=False)

# Gemma 3's chat template (google/gemma-3-4b-it): an image part becomes <start_of_image>, which the
# processor expands.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(SPLIT_REGEXES["llama-bpe"]), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, min_frequency=2, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS + "\n\n\n\n\nDescribe the image. What is in this picture?\n"] * 4,
                            trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return tok


def _smollm2_with_gemma_tokens() -> Tokenizer:
    """SmolLM2's tokenizer (one llama.cpp's converter recognizes) with Gemma's special tokens added."""
    from tiny_recurrent import smollm2_tokenizer
    from tokenizers import AddedToken

    tok = Tokenizer.from_str(smollm2_tokenizer().backend_tokenizer.to_str())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    return tok


def make_tiny_gemma3_vision(out: Path, seed: int = 0, *, convertible: bool = False,
                            shape: Gemma3Shape = Gemma3Shape()) -> Path:
    """The folder of a tiny Gemma 3 vision model under `out`; returns it. `convertible`: with SmolLM2's
    tokenizer (plus Gemma's special tokens) and the tensor names of Google's releases
    (`language_model.model.*`, `vision_tower.vision_model.*`), as llama.cpp's converter reads them.
    `shape`: its sizes."""
    import transformers as tf
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _smollm2_with_gemma_tokens() if convertible else _tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    # llama.cpp's Gemma 3 has no keys for the layer pattern, the local RoPE base or the attention scale:
    # it takes every sixth layer as global, 10000 and 1/sqrt(head_dim); a convertible model keeps to them
    if shape.layers:
        layers = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(shape.layers)]
    elif convertible:
        layers = ["sliding_attention"] * 5 + ["full_attention"]
    else:
        layers = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    head_dim = shape.text["head_dim"]
    text = tf.Gemma3TextConfig(
        vocab_size=tok.get_vocab_size(), **shape.text, num_hidden_layers=len(layers),
        max_position_embeddings=512 if shape.tiny else 131072, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_local_base_freq=10000.0 if convertible else 20000.0,
        query_pre_attn_scalar=head_dim if convertible else 2 * head_dim, layer_types=layers,
        hidden_activation="gelu_pytorch_tanh", initializer_range=0.08 if shape.tiny else 0.02,
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"])
    vision = tf.SiglipVisionConfig(**shape.vision, image_size=shape.image_size, patch_size=shape.patch,
                                   layer_norm_eps=1e-6, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=shape.tokens_per_image,
                             boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                             image_token_index=ids["<image_soft_token>"],
                             initializer_range=0.08 if shape.tiny else 0.02)
    torch.manual_seed(seed)
    if not shape.tiny:  # billions of weights: bfloat16 from the start, transformers' own initialization
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = tf.Gemma3ForConditionalGeneration(config).eval()
        finally:
            torch.set_default_dtype(previous)
    else:
        model = tf.Gemma3ForConditionalGeneration(config).float().eval()
    if shape.tiny:  # weights large enough for peaked logits, norms off their neutral values
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("language_model.norm.weight"):
                    p.copy_(1.5 + 0.2 * torch.randn_like(p))
                elif "norm" in name and name.endswith("weight"):
                    p.copy_((1.0 if "vision_tower" in name else 0.0) + 0.2 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.normal_(0.0, 0.1)
                elif name.endswith("embed_tokens.weight"):
                    p.normal_(0.0, 0.1)
                elif "vision_tower" in name and p.dim() >= 2:
                    p.normal_(0.0, 0.15)
                elif name.endswith("mm_input_projection_weight"):
                    p.normal_(0.0, 0.3)
                elif p.dim() >= 2:
                    p.normal_(0.0, 0.08)
    model.save_pretrained(out, max_shard_size="64GB")
    del model
    if convertible:
        from safetensors.torch import load_file, save_file
        tensors = load_file(out / "model.safetensors")
        save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
                   for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    fast.chat_template = GEMMA3_CHAT_TEMPLATE
    images = Gemma3ImageProcessorPil(size={"height": shape.image_size, "width": shape.image_size}, image_mean=[0.5] * 3,
                                     image_std=[0.5] * 3, rescale_factor=1 / 255, resample=2)
    processor = Gemma3Processor(image_processor=images, tokenizer=fast, chat_template=GEMMA3_CHAT_TEMPLATE,
                                image_seq_length=shape.tokens_per_image)
    processor.save_pretrained(out)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc.setdefault("add_bos_token", True)
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    return out
