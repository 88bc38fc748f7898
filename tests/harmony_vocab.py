"""o200k_base.tiktoken, the vocabulary openai-harmony (gpt-oss's format) loads, made without the network.

openai-harmony downloads the file from openaipublic.blob.core.windows.net on first use, which CI cannot
reach. npm's `tiktoken` package (dqbd's JS/WASM bindings) ships the same ranks as JSON; this writes them
in the `.tiktoken` form (one `base64-token rank` line per token, in rank order) and keeps the file only
if its SHA-256 is the one tiktoken publishes for o200k_base (`tiktoken_ext/openai_public.py`), so the
reference is OpenAI's file byte for byte, not ours. `.ci/run` runs it after installing the npm package:

    npm install --prefix $WALLBREAKER_CLIENTS_DIR/npm tiktoken && python3 tests/harmony_vocab.py
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from client_install import clients_dir

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
INSTALL = f"npm install --prefix {clients_dir() / 'npm'} tiktoken && python3 tests/harmony_vocab.py"


def vocab_folder() -> Path:
    return clients_dir() / "tiktoken"


def encodings_base() -> str | None:
    """The folder to give openai-harmony as TIKTOKEN_ENCODINGS_BASE, or None where the file is absent."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return os.environ["TIKTOKEN_ENCODINGS_BASE"]
    return str(vocab_folder()) if (vocab_folder() / "o200k_base.tiktoken").exists() else None


def tiktoken_text(ranks_json: dict) -> bytes:
    """npm tiktoken's `bpe_ranks`: lines of `<tag> <first rank> <base64 token> ...`, ranks consecutive."""
    lines = []
    for line in ranks_json["bpe_ranks"].split("\n"):
        if not line:
            continue
        _, first, *tokens = line.split(" ")
        lines += [f"{token} {int(first) + i}\n" for i, token in enumerate(tokens)]
    return "".join(lines).encode()


def main() -> int:
    source = clients_dir() / "npm" / "node_modules" / "tiktoken" / "encoders" / "o200k_base.json"
    if not source.exists():
        print(f"{source} is missing; install it with: {INSTALL}", file=sys.stderr)
        return 1
    text = tiktoken_text(json.loads(source.read_text()))
    digest = hashlib.sha256(text).hexdigest()
    if digest != O200K_SHA256:
        print(f"o200k_base from {source} has SHA-256 {digest}, not OpenAI's {O200K_SHA256}", file=sys.stderr)
        return 1
    vocab_folder().mkdir(parents=True, exist_ok=True)
    (vocab_folder() / "o200k_base.tiktoken").write_bytes(text)
    print(f"wrote {vocab_folder() / 'o200k_base.tiktoken'} (SHA-256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
