"""RWKV's World tokenizer: greedy longest match over the bytes of its vocabulary, as BlinkDL's
`TRIE_TOKENIZER` (PyPI `rwkv`) and llama.cpp's `llm_tokenizer_rwkv` encode.

Written here because the tokenizers library has no such model: its WordPiece matches greedily but
only within pre-tokenized words, trying every end from the word's last character (quadratic in a
word's length), and RWKV's tokens are raw bytes that may cross any boundary a pre-tokenizer draws.

Its vocabulary comes from llama.cpp's GGUF (`tokenizer.ggml.model` "rwkv": each token's bytes written
as Python escapes, `repr(token)[2:-1]`, after "<s>" at id 0) or from the `rwkv_vocab_v20230424.txt`
that fla-hub's folders ship (a line per token: id, a Python str or bytes literal, its length).
"""
from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken

from ..errors import InvalidRequestError, ModelFormatError, UnsupportedModelError

VOCAB_FILE = "rwkv_vocab_v20230424.txt"
TURN_END = "\\n\\n"  # llama.cpp's converter makes "\n\n" end a turn (its end-of-turn token)
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.S)
_SPECIAL_ESCAPES = {b"t": b"\t", b"n": b"\n", b"r": b"\r"}


def unescape(token: str) -> bytes:
    """A GGUF token's bytes: llama.cpp's `llama_unescape_rwkv_token` (\\t, \\n, \\r, \\xNN; any other
    escaped character stands for itself)."""
    def one(m: re.Match) -> bytes:
        code = m.group(1)
        if code[:1] == b"x" and len(code) == 3:
            return bytes([int(code[1:], 16)])
        return _SPECIAL_ESCAPES.get(code, code)
    return _ESCAPE.sub(one, token.encode("utf-8"))


@dataclass
class _Encoding:
    ids: list[int]


class ByteTrie:
    """The `tokenizers.Tokenizer` methods wallbreaker's Tokenizer uses, over a byte vocabulary.
    `texts[i]` is token i as its vocabulary spells it; `control` the ids matched whole before the
    trie runs (special tokens: "<s>")."""

    def __init__(self, texts: list[str], spellings: list[bytes], control: Sequence[int]) -> None:
        self.texts = texts
        self.spellings = spellings
        self.ids = {t: i for i, t in enumerate(texts)}
        self.control = {texts[i]: i for i in control}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.control, key=len, reverse=True))
                                 + ")") if self.control else None
        self.root: dict = {}
        for i, spelled in enumerate(spellings):
            if i in control or not spelled:
                continue
            node = self.root
            for byte in spelled:
                node = node.setdefault(byte, {})
            node.setdefault(None, i)  # the first id of a spelling wins, as in llama.cpp's trie

    def _match(self, data: bytes) -> list[int]:
        out, at, n = [], 0, len(data)
        while at < n:
            node, best, end, pos = self.root, None, at, at
            while pos < n and (node := node.get(data[pos])) is not None:
                pos += 1
                if None in node:
                    best, end = node[None], pos
            if best is None:
                raise InvalidRequestError(f"the text has a byte ({data[at]:#04x}) that no token of this vocabulary spells")
            out.append(best)
            at = end
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        pieces = self._split.split(text) if self._split is not None else [text]
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                ids.append(self.control[piece])
            elif piece:
                ids.extend(self._match(piece.encode("utf-8")))
        return _Encoding(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        skipped = set(self.control.values()) if skip_special_tokens else set()
        return b"".join(self.spellings[i] for i in ids if i not in skipped).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str | None:
        return self.texts[i] if 0 <= i < len(self.texts) else None

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return dict(self.ids)

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return {i: AddedToken(t, special=True) for t, i in self.control.items()}

    def to_str(self) -> str:
        raise UnsupportedModelError("RWKV's World tokenizer has no tokenizer.json form")


def from_gguf_tokens(tokens: list[str], types: list[int], control_type: int) -> ByteTrie:
    return ByteTrie(tokens, [unescape(t) for t in tokens], [i for i, k in enumerate(types) if k == control_type])


def from_vocab_file(path: Path) -> ByteTrie:
    """The folder's vocabulary file, with "<s>" at id 0 as llama.cpp's converter adds it."""
    spellings: dict[int, bytes] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            head, _, rest = line.partition(" ")
            literal, _, length = rest.rpartition(" ")
            value = ast.literal_eval(literal)
            spelled = value.encode("utf-8") if isinstance(value, str) else value
            if not isinstance(spelled, bytes) or len(spelled) != int(length):
                raise ValueError("its length does not match")
            spellings[int(head)] = spelled
        except (ValueError, SyntaxError) as e:
            raise ModelFormatError(f"{path}: line {n} is not `id literal length` ({e})") from None
    size = max(spellings, default=0) + 1
    texts = ["<s>"] + [repr(spellings.get(i, b""))[2:-1] for i in range(1, size)]
    return ByteTrie(texts, [b"<s>"] + [spellings.get(i, b"") for i in range(1, size)], [0])
