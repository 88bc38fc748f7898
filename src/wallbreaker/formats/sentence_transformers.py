"""sentence-transformers' pipeline description beside a model folder (`modules.json`, the Pooling
module's `config.json`, a `Normalize` module, `sentence_bert_config.json`) -> how we pool.

A folder without `modules.json` has no pooling config: such a model only generates (a BERT
without one is mean-pooled, as sentence-transformers itself does for a bare BERT)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelFormatError, UnsupportedModelError
from ..config import PoolingConfig

_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


def _json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: unreadable: {e}") from None


def read_pooling_config(path: Path, default: str | None = "mean") -> tuple[PoolingConfig | None, int | None]:
    """(pooling, max_seq_length) of the folder. Without modules.json: `default` pooling (None: none)."""
    st_config = path / "sentence_bert_config.json"
    max_len = _json(st_config).get("max_seq_length") if st_config.is_file() else None
    if max_len is not None and not (isinstance(max_len, int) and max_len > 0):
        raise ModelFormatError(f"{st_config}: max_seq_length must be a positive integer")
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return (PoolingConfig(default) if default else None), max_len
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise ModelFormatError(f"{modules_file}: not a list of modules")
    method, normalize = default, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""
        if kind not in _KNOWN_MODULES:
            raise UnsupportedModelError(f"{modules_file}: module {kind or module!r} is not supported "
                                        f"(supported: {', '.join(_KNOWN_MODULES)})")
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            method = _pooling_mode(path / str(module.get("path", "")) / "config.json")
    if method is None:
        return None, max_len
    return PoolingConfig(method, normalize=normalize), max_len


def _pooling_mode(file: Path) -> str:
    config = _json(file) if file.is_file() else {}
    if not isinstance(config, dict):
        raise ModelFormatError(f"{file}: not a JSON object")
    if "pooling_mode" in config:  # sentence-transformers >= 3 also writes the mode by name
        named = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(config["pooling_mode"])
        if named is None:
            raise UnsupportedModelError(f"{file}: pooling_mode {config['pooling_mode']!r} is not supported")
        return named
    for key in _UNSUPPORTED_MODES:
        if config.get(key):
            raise UnsupportedModelError(f"{file}: {key} is not supported (mean, cls, last token only)")
    chosen = [mode for key, mode in _MODES.items() if config.get(key)]
    if len(chosen) != 1:
        raise UnsupportedModelError(f"{file}: exactly one of {', '.join(_MODES)} must be set, got {len(chosen)}")
    return chosen[0]
