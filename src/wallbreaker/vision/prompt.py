"""A conversation with images -> the prompt's text, its token ids and its images, as transformers'
processors' `apply_chat_template` builds them (Gemma 3's, Idefics3's): image parts reach the chat
template as `{"type": "image"}` (Gemma's writes <start_of_image> for each, SmolVLM's <image>), each
marker is replaced by the image's full token sequence (the family's `expand`), and the text is
tokenized whole. Each run of image tokens (an image, or a SmolVLM tile) becomes one ImageInput.

Image parts come in the shapes the APIs and the Python API use: OpenAI's `{"type": "image_url",
"image_url": {"url": "data:..."}}`, the Responses API's `{"type": "input_image", "image_url": ...}`,
and `{"type": "image", "image": <PIL image | bytes | data URL>}`."""
from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError
from .gemma3 import Gemma3Vision
from .idefics3 import Idefics3Vision
from .images import load_image
from .inputs import ImageInput, pixel_digest

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
TEXT_PART_TYPES = ("text", "input_text")
MAX_IMAGES_PER_PROMPT = 16


def has_images(messages: Any) -> bool:
    """Whether a conversation has an image part anywhere."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
        for m in messages)


def has_parts(messages) -> bool:
    """Whether any message's content is a list of parts."""
    return isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                              for m in messages)


def joined_text_parts(messages):
    """Content given as a list of text parts, joined into the string a text model's template reads."""
    if not has_parts(messages):
        return messages
    out = []
    for n, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") in ("text", "input_text")
                        and isinstance(part.get("text"), str)):
                    raise InvalidRequestError(f"messages[{n}].content[{k}] must be a text part", param="messages")
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        out.append(m)
    return out


def image_source(part: dict, where: str) -> Any:
    """What a part's image is given as: bytes, a data URL or base64 text, or a PIL image."""
    kind = part.get("type")
    if kind == "image":
        source = part.get("image", part.get("url"))
    else:
        source = part.get("image_url")
        if isinstance(source, dict):
            source = source.get("url")
    if source is None:
        raise InvalidRequestError(f"{where}: an {kind} part needs its image", param=where)
    return source


def chat_prompt(vision: "Gemma3Vision | Idefics3Vision", template, tokenizer, messages: list[dict],
                add_generation_prompt: bool = True,
                **template_kwargs: Any) -> tuple[str, list[int], list[ImageInput]]:
    """(text, token ids, images) of a conversation; InvalidRequestError naming the part at fault."""
    if not isinstance(messages, list):
        raise InvalidRequestError("messages must be a list of {role, content} objects")
    count = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
                for p in m["content"] if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES)
    if count > MAX_IMAGES_PER_PROMPT:  # before any is decoded
        raise InvalidRequestError(f"more than {MAX_IMAGES_PER_PROMPT} images in one request ({count})",
                                  param="messages")
    pil_images = []
    rendered = []
    for n, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                where = f"messages[{n}].content[{k}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in IMAGE_PART_TYPES:
                    if len(pil_images) >= MAX_IMAGES_PER_PROMPT:
                        raise InvalidRequestError(f"{where}: more than {MAX_IMAGES_PER_PROMPT} images in one "
                                                  f"request", param="messages")
                    pil_images.append(load_image(image_source(part, where), param=where))
                    parts.append({"type": "image"})
                elif kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise InvalidRequestError(f"{where}: a content part must be text or an image "
                                              f"({', '.join(TEXT_PART_TYPES + IMAGE_PART_TYPES)}), got {kind!r}",
                                              param="messages")
            message = {**message, "content": parts}
        rendered.append(message)
    text = template.render(rendered, add_generation_prompt=add_generation_prompt, **template_kwargs)
    marker = vision.marker
    pieces = text.split(marker)
    if len(pieces) - 1 != len(pil_images):
        raise InvalidRequestError(f"the prompt has {len(pieces) - 1} {marker} markers for "
                                  f"{len(pil_images)} images (the chat template writes one per image part; the "
                                  f"text itself must not contain it)", param="messages")
    expanded = [vision.expand(image) for image in pil_images]  # (its text, the pixels of each of its runs)
    text = pieces[0] + "".join(sequence + piece for (sequence, _), piece in zip(expanded, pieces[1:]))
    bos = tokenizer.bos_token
    ids = tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
    runs = image_runs(ids, vision.image_id)
    tiles = [(k, pixels) for _, all_pixels in expanded for k, pixels in enumerate(all_pixels)]
    tokens_of = getattr(vision, "tokens_of", lambda pixels: vision.run_length)  # Qwen2.5-VL's vary by image
    grid_of = getattr(vision, "grid_of", lambda pixels: None)  # M-RoPE positions (Qwen2.5-VL)
    if len(runs) != len(tiles) or any(length != tokens_of(pixels) for (_, length), (_, pixels) in zip(runs, tiles)):
        raise InvalidRequestError(f"the prompt's text holds {tokenizer.id_to_token(vision.image_id)} tokens of its own; "
                                  f"it must not", param="messages")
    images = [ImageInput(offset, length, pixel_digest(pixels), pixels, vision.bidirectional, k, grid_of(pixels))
              for (offset, length), (k, pixels) in zip(runs, tiles)]
    return text, ids, images


def image_runs(ids: list[int], image_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `image_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != image_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
