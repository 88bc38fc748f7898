"""What Ollama's `/api/tags`, `/api/show` and `/api/ps` say about the model served: its name with
Ollama's tag, its file's size, modification time and SHA-256, its family, parameter count and
quantization, and the facts of its shape under `model_info` (clients read the context length there,
and pick models by the `tools` capability)."""
from __future__ import annotations

import hashlib
import re
import threading
from datetime import datetime, timezone
from pathlib import Path

from ..llm import LLM
from .state import ServerState


def listed_name(state: ServerState) -> str:
    """The model as Ollama lists it: its name with the one tag served."""
    return f"{state.model_name}:latest"


_digests: dict[Path, str] = {}
_digest_lock = threading.Lock()


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def digest(path: Path) -> str:
    """The SHA-256 of the model's bytes (a folder's files in name order), computed once a process."""
    with _digest_lock:
        if path not in _digests:
            h = hashlib.sha256()
            for f in _files(path):
                with open(f, "rb") as stream:
                    while chunk := stream.read(1 << 24):
                        h.update(chunk)
            _digests[path] = h.hexdigest()
        return _digests[path]


def remember_digest(path: Path, sha256: str) -> None:
    """A file's SHA-256 known already (a packaged model's, checked when it was assembled): not hashed again."""
    with _digest_lock:
        _digests.setdefault(path, sha256)


def parameter_count(llm: LLM) -> int:
    """The parameters of the model's shape (its weights may be packed, so not counted off the tensors)."""
    c = llm.model_config
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    width = c.expert_intermediate_size or c.intermediate_size if c.num_experts else c.intermediate_size
    mlp = 3 * c.hidden_size * width * max(c.num_experts, 1)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_layers * (attention + mlp)


_QUANT = re.compile(r"(?i)(?:^|[-_.])(i?q\d(?:_k)?(?:_[a-z0-9]+)?|bf16|f16|f32)$")


def model_entry(state: ServerState) -> dict:
    """The model as Ollama's /api/tags lists one."""
    llm, path = state.llm, state.llm.model_path
    files = _files(path)
    count = parameter_count(llm)
    quant = _QUANT.search(path.stem if path.is_file() else path.name)
    listed = listed_name(state)
    modified = datetime.fromtimestamp(max(f.stat().st_mtime for f in files), timezone.utc)
    return {"name": listed, "model": listed, "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "size": sum(f.stat().st_size for f in files), "digest": digest(path),
            "details": {"parent_model": "", "format": "gguf" if path.suffix == ".gguf" else "safetensors",
                        "family": llm.model_config.architecture, "families": [llm.model_config.architecture],
                        "parameter_size": f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.2f}M",
                        "quantization_level": quant.group(1).upper() if quant else "unknown"}}


def running_entry(state: ServerState) -> dict:
    """The model as /api/ps lists one: loaded until the server stops, its weights and KV pool in memory."""
    entry = model_entry(state)
    entry.pop("modified_at")
    entry.update(size=state.llm.weight_bytes + state.llm.kv_cache.nbytes, size_vram=0, expires_at=None,
                 context_length=state.llm.max_model_len)
    return entry


def show_body(state: ServerState) -> dict:
    llm, c = state.llm, state.llm.model_config
    arch = c.architecture
    info = {"general.architecture": arch, "general.parameter_count": parameter_count(llm),
            f"{arch}.context_length": llm.max_model_len, f"{arch}.embedding_length": c.hidden_size,
            f"{arch}.block_count": c.num_layers, f"{arch}.feed_forward_length": c.intermediate_size,
            f"{arch}.attention.head_count": c.num_heads, f"{arch}.attention.head_count_kv": c.num_kv_heads,
            f"{arch}.vocab_size": c.vocab_size}
    entry = model_entry(state)
    return {"license": "", "modelfile": f"# served by wallbreaker\nFROM {llm.model_path}\n", "parameters": "",
            "template": llm.chat_template.source, "details": entry["details"], "model_info": info,
            "capabilities": ["completion", "tools"] + (["vision"] if llm.takes_images else []),
            "modified_at": entry["modified_at"]}
