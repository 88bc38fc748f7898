"""Image bytes in, a Pillow image out: base64 data URLs, bare base64 (Ollama), raw bytes, PIL images.

Nothing reaches the network: an http(s) URL is refused with a message saying what to send instead.
Pillow decodes; the orientation in a JPEG's EXIF is applied as transformers' `load_image` applies
it, so that a phone photograph is upright. An image's size is read from its header and checked
before any pixel is decoded (a decompression bomb never allocates its pixels).
"""
from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

from ..errors import InvalidRequestError

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # width * height, checked from the header before decoding
MAX_IMAGE_BYTES = 32 * 1024 * 1024  # of the encoded file


def load_image(source: Any, param: str | None = None):
    """A decoded, upright `PIL.Image.Image` from `source`: bytes, a `data:image/...;base64,` URL, bare
    base64 text, or a PIL image. Raises InvalidRequestError (naming `param`) for anything else."""
    from PIL import Image, ImageOps

    if isinstance(source, Image.Image):
        image = source
    else:
        image = _open(_image_bytes(source, param), param)
    try:
        return ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise InvalidRequestError(f"the image cannot be decoded: {_one_line(e)}", param) from None


def _image_bytes(source: Any, param: str | None) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str):
        text = source.strip()
        lower = text[:16].lower()
        if lower.startswith(("http://", "https://")):
            raise InvalidRequestError("image URLs are not fetched (this server does not reach the network); "
                                      "send the image inline as a data URL (data:image/png;base64,...)", param)
        if lower.startswith("data:"):
            header, sep, text = text.partition(",")
            if not sep or not header.lower().endswith(";base64"):
                raise InvalidRequestError("an image data URL must be base64-encoded "
                                          "(data:image/<type>;base64,<data>)", param)
            if not header[5:].lower().startswith("image/"):
                raise InvalidRequestError(f"a data URL of type {header[5:].split(';')[0]!r} is not an image", param)
        if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise InvalidRequestError(f"the image is larger than {MAX_IMAGE_BYTES} bytes", param)
        try:
            data = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError("the image is not valid base64", param) from None
    else:
        raise InvalidRequestError(f"an image must be bytes, a base64 data URL or a PIL image, "
                                  f"not {type(source).__name__}", param)
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"the image is larger than {MAX_IMAGE_BYTES} bytes", param)
    if not data:
        raise InvalidRequestError("the image is empty", param)
    return data


def _open(data: bytes, param: str | None):
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(f"the image is {width}x{height} pixels, more than the limit of "
                                          f"{MAX_IMAGE_PIXELS} pixels", param)
            if getattr(image, "is_animated", False):  # the model would see one frame of many: said, not guessed
                raise InvalidRequestError("animated images are not supported (the model reads one still image); "
                                          "send a single frame", param)
            image.load()
    except InvalidRequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InvalidRequestError(f"the image is too large to decode: {_one_line(e)}", param) from None
    except Image.UnidentifiedImageError:
        raise InvalidRequestError("the data is not an image format this server reads "
                                  "(PNG, JPEG, GIF, WebP, BMP, ...)", param) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt files
        raise InvalidRequestError(f"the image cannot be decoded: {_one_line(e)}", param) from None
    return image


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."
