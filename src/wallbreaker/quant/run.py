"""`wallbreaker quantize`: load a model in float32, quantize it, write a folder or a GGUF file."""
from __future__ import annotations

import os
from pathlib import Path

from .pipeline import QuantizedModel, QuantizeConfig, quantize_model


def is_gguf_path(out: str | os.PathLike) -> bool:
    return str(out).lower().endswith(".gguf")


def quantize_to(model: str | os.PathLike | None, out: str | os.PathLike, cfg: QuantizeConfig,
                progress: bool = True) -> QuantizedModel:
    from ..llm import LLM
    from .export import export_folder, export_gguf, gguf_tokenizer_metadata, gguf_type

    gguf_out = is_gguf_path(out)
    if gguf_out:
        gguf_type(cfg)  # fail before the work, not after
    llm = LLM(model, dtype="float32", max_num_seqs=1, kv_cache_memory_gb=0.01)
    tokenizer_metadata = gguf_tokenizer_metadata(llm.files.metadata) if gguf_out else None
    qm = quantize_model(llm, cfg, progress=progress, keep_rtn_source=gguf_out)
    template = llm.chat_template.source
    if gguf_out:
        export_gguf(qm, Path(out), tokenizer_metadata, template)
    else:
        export_folder(qm, Path(out), llm.tokenizer, template)
    return qm
