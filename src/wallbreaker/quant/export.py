"""Writing a quantized model: a wallbreaker-quantized Hugging Face folder, or a GGUF file.

GGUF's Q4_0, Q4_1 and Q8_0 are blocks of 32 weights on the symmetric/asymmetric grids of
`grid.py`, so a model maps onto them only with group size 32 and 4 bits (sym: Q4_0, asym: Q4_1) or
8 bits symmetric (Q8_0), without activation order and with one width for all tensors. RTN and AWQ
end in round-to-nearest, so they hand gguf-py the float weights they rounded (AWQ's scaled ones) and
it quantizes them, bit for bit as llama.cpp does. GPTQ's codes are not RTN's: they are written as
blocks directly (Q4_1's min is stored as float16(−z·s), which differs from GPTQ's z by at most a
float16 rounding).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import InvalidRequestError
from ..formats.families import family
from ..formats.gguf_writer import write_gguf
from ..formats.hf_writer import canonical_to_hf, write_hf_folder
from ..formats.names import llama_permute
from ..formats.quantized_hf import QUANT_METHOD, quantized_state
from ..text.tokenizer import Tokenizer
from ..formats.grid import QuantizedTensor
from .pipeline import QuantizedModel, QuantizeConfig

Q = gguf.GGMLQuantizationType
_GGUF_TYPES = {(4, True): Q.Q4_0, (4, False): Q.Q4_1, (8, True): Q.Q8_0}


def gguf_type(cfg: QuantizeConfig) -> gguf.GGMLQuantizationType:
    """The GGUF block type `cfg` maps onto exactly, or a clear error."""
    if cfg.method == "mixed":
        raise InvalidRequestError("GGUF block formats have one width per file here: write mixed precision to a folder")
    qtype = _GGUF_TYPES.get((int(cfg.bits), cfg.sym))
    if qtype is None or cfg.group_size != 32:
        raise InvalidRequestError(
            f"{int(cfg.bits)}-bit {'symmetric' if cfg.sym else 'asymmetric'} groups of {cfg.group_size} have no GGUF "
            "block type; GGUF takes --group-size 32 with --bits 4 --sym (Q4_0), --bits 4 --no-sym (Q4_1) or "
            "--bits 8 --sym (Q8_0); write a folder for anything else")
    if cfg.act_order:
        raise InvalidRequestError("GGUF blocks are consecutive columns: --act-order needs a folder output")
    return qtype


def export_folder(qm: QuantizedModel, path: str | Path, tokenizer: Tokenizer, chat_template: str | None) -> Path:
    cfg, names = qm.settings, canonical_to_hf(qm.config)
    extra: dict[str, torch.Tensor] = {}
    for name, q in qm.quantized.items():
        extra.update(quantized_state(names[name].removesuffix(".weight"), q))
    qcfg: dict = {"quant_method": QUANT_METHOD, "method": cfg.method, "group_size": cfg.group_size,
                  "sym": cfg.sym, "desc_act": cfg.act_order}
    widths = set(qm.bits_per_tensor.values())
    if len(widths) == 1 and cfg.method != "mixed":
        qcfg["bits"] = widths.pop()
    else:
        qcfg["bits_per_tensor"] = {names[n].removesuffix(".weight"): b for n, b in qm.bits_per_tensor.items()}
        qcfg["average_bits"] = round(qm.average_bits, 4)
    if cfg.method != "rtn":
        qcfg["calibration"] = {"nsamples": cfg.nsamples, "seqlen": cfg.seqlen, "seed": cfg.seed,
                               "file": Path(cfg.calib).name if cfg.calib else "wikitext-2/valid.txt"}
    return write_hf_folder(path, qm.config, qm.tensors, tokenizer, chat_template, extra,
                           {"quantization_config": qcfg})


def export_gguf(qm: QuantizedModel, path: str | Path, tokenizer_metadata: dict, chat_template: str | None) -> Path:
    qtype = gguf_type(qm.settings)
    if qm.settings.method in ("rtn", "awq"):
        if qm.rtn_source is None:
            raise ValueError("quantize_model(..., keep_rtn_source=True) is needed for GGUF output of rtn/awq")
        return write_gguf(path, qm.config, {**qm.tensors, **qm.rtn_source}, tokenizer_metadata,
                          tensor_types=dict.fromkeys(qm.rtn_source, qtype), chat_template=chat_template)
    raw = {name: (_blocks(_disk_rows(name, q, qm), qtype), qtype) for name, q in qm.quantized.items()}
    return write_gguf(path, qm.config, qm.tensors, tokenizer_metadata, chat_template=chat_template, raw_tensors=raw)


def gguf_tokenizer_metadata(metadata: dict) -> dict:
    """The tokenizer keys of a GGUF source's metadata, to carry into the new file."""
    keys = {k: v for k, v in metadata.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}
    if "tokenizer.ggml.tokens" not in keys:
        raise InvalidRequestError("GGUF output needs a GGUF source model (its tokenizer description); "
                                  "write a folder instead")
    return keys


def _disk_rows(name: str, q: QuantizedTensor, qm: QuantizedModel) -> QuantizedTensor:
    """llama.cpp's row order: q/k rows of `llama` files are permuted (see gguf_writer)."""
    c = qm.config
    heads = {"attn_q.weight": c.num_heads, "attn_k.weight": c.num_kv_heads}.get(name.split(".", 2)[-1])
    if not family(c.architecture).rope_permuted or heads is None:
        return q
    zeros = None if q.zeros is None else llama_permute(q.zeros, heads)
    return QuantizedTensor(llama_permute(q.codes, heads), llama_permute(q.scales, heads), zeros, q.bits,
                           q.group_size)


def _blocks(q: QuantizedTensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """[out, in] codes on 32-wide groups -> GGUF blocks [out, in/32 · block bytes] uint8."""
    out, n = q.codes.shape
    codes = q.codes.view(out, n // 32, 32)  # [out, blocks, 32]
    d = q.scales.to(torch.float16).contiguous().view(torch.uint8).view(out, n // 32, 2)
    if qtype == Q.Q8_0:
        body = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        parts = [d, body]
    else:
        body = codes[..., :16] | (codes[..., 16:] << 4)  # low nibbles: the first 16 weights
        parts = [d, body]
        if qtype == Q.Q4_1:
            m = (-q.zeros * q.scales).to(torch.float16).contiguous().view(torch.uint8).view(out, n // 32, 2)
            parts = [d, m, body]
    return torch.cat(parts, dim=-1).reshape(out, -1).numpy()
