"""A model stored in a block type our kernels do not run (IQ4_NL, MXFP4) loads: on the float32 path
exactly as its dequantized weights, on the auto path requantized to Q8_0 at load."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from wallbreaker import LLM
from wallbreaker.formats.dequant import dequantize
from wallbreaker.formats.gguf_writer import write_gguf
from wallbreaker.formats.names import is_norm

Q = gguf.GGMLQuantizationType
TEXT = "A paged cache keeps keys and values in fixed blocks, so that many sequences can share one pool."


def iq4_nl(x: np.ndarray) -> np.ndarray:
    """Nearest-value IQ4_NL blocks of x [rows, cols] (gguf.quants has no IQ4_NL quantizer): per 32
    weights a float16 scale, then 16 bytes whose low nibbles are weights 0..15 and high 16..31."""
    values = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    blocks = x.reshape(-1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True) / 127.0).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)
    codes = np.abs(blocks[..., None] / safe[..., None] - values).argmin(-1).astype(np.uint8)
    packed = codes[:, :16] | (codes[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8), packed], axis=1).reshape(x.shape[0], -1)


ENCODERS = {Q.IQ4_NL: iq4_nl, Q.MXFP4: lambda x: gguf.quants.quantize(x, Q.MXFP4)}


@pytest.fixture(scope="module", params=list(ENCODERS), ids=lambda t: t.name)
def stored(request, tiny_qwen3, tmp_path_factory):
    """(this type's GGUF, an F32 GGUF of its dequantized weights) of the tiny Qwen3."""
    qtype, tiny = request.param, tiny_qwen3
    tensors = tiny.canonical_tensors()
    raw, exact = {}, dict(tensors)
    for name, t in tensors.items():
        if t.dim() == 2 and not is_norm(name):
            blocks = ENCODERS[qtype](t.numpy().astype(np.float32))
            raw[name] = (blocks, qtype)
            exact[name] = dequantize(blocks, qtype, tuple(t.shape))
    folder = tmp_path_factory.mktemp(qtype.name)
    packed = write_gguf(folder / "packed.gguf", tiny.config, {n: t for n, t in tensors.items() if n not in raw},
                        tiny.tokenizer_metadata, raw_tensors=raw, chat_template=tiny.chat_template)
    return packed, write_gguf(folder / "exact.gguf", tiny.config, exact, tiny.tokenizer_metadata,
                              chat_template=tiny.chat_template)


def test_float32_path_is_the_dequantized_weights(stored):
    packed, exact = stored
    torch.testing.assert_close(LLM(packed, dtype="float32").logits(TEXT), LLM(exact, dtype="float32").logits(TEXT),
                               rtol=0, atol=0)


def test_auto_path_requantizes_to_a_kernel_format_and_stays_close(stored, request):
    """Q8_0 at load; MXFP4's values, which Q5_0 holds exactly, as Q5_0 (kernels/blocks.py)."""
    packed, _ = stored
    qtype = request.node.callspec.params["stored"]
    reference = torch.log_softmax(LLM(packed, dtype="float32").logits(TEXT), -1)
    llm = LLM(packed, dtype="auto")
    assert llm.model.layers[0].attn.qkv.qtypes == [int(Q.Q5_0 if qtype == Q.MXFP4 else Q.Q8_0)] * 3
    kl = (reference.exp() * (reference - torch.log_softmax(llm.logits(TEXT), -1))).sum(-1).mean()
    assert kl.item() < 5e-3  # 8-bit activations and bfloat16 K/V, as on every auto path
