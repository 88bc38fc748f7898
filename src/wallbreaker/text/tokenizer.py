"""Tokenizers that encode and decode exactly as the model's own.

A GGUF file carries no `tokenizer.json`, only llama.cpp's description of one (vocabulary, merges,
token types, the name of a pre-tokenizer). `Tokenizer.from_gguf_metadata` rebuilds a `tokenizers`
pipeline from it that splits text with llama.cpp's regexes and merges as transformers' GGUF loader
does; `Tokenizer.from_hf_folder` loads a Hugging Face folder's `tokenizer.json` as is.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from wallbreaker.config import short_repr
from wallbreaker.errors import ModelFormatError, UnsupportedModelError, WallbreakerError

from . import rwkv_world

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regexes llama.cpp (llama-vocab.cpp) splits text with, applied in turn.
_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4"), (_GPT2_SPLIT,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", _GPT2_SPLIT),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4"),
        (_LLAMA3_SPLIT,),
    ),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), (_GPT4O_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
}
# Pre-tokenizers whose words are looked up whole before any merge (Llama 3's `ignore_merges`).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "jina-v5-nano", "tekken"}
_ADDS_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
             "jina-v5-nano", "tekken", "chameleon"}
_GEMMA_ARCHITECTURES = {"gemma", "gemma2", "gemma3"}

# llama.cpp's end-of-generation tokens, found by their text (llama-vocab.cpp, `special_eog_ids`).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle pad / repo / file-separator tokens: llama.cpp stops on these too, since a code
# model that emits one has left the file it was asked to complete.
_FIM_EOG_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
})
_EOG_ID_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id", "fim_pad_token_id", "fim_rep_token_id",
                "fim_sep_token_id")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Characters sliced while deriving SentencePiece merges, per character of the vocabulary (plus a
# base): real vocabularies need a few dozen at most (about half their average token length).
_MERGE_WORK_PER_CHARACTER = 256
_MERGE_WORK_BASE = 1 << 24


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` (or RWKV's World tokenizer, text/rwkv_world.py, which offers the
    same methods); encodes and decodes exactly as the model's own."""

    def __init__(
        self,
        backend: Backend | rwkv_world.ByteTrie,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        add_eos: bool = False,
        stop_token_ids: Iterable[int] = (),
        byte_level: bool,
        vocab_size: int | None = None,
        post_processor_ids: Iterable[int] = (),
        fim_token_ids: Mapping[str, int] | None = None,
    ) -> None:
        self._backend = backend
        self._byte_level = byte_level
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        if vocab_size is None:
            vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        # The ids of the tokenizer are 0..vocab_size - 1 (a GGUF's token count, else the largest id + 1):
        # an embedding may have more rows (a padded vocabulary), which no text stands for.
        self.vocab_size: int = vocab_size
        # Ids the Hugging Face post-processor would add (TemplateProcessing's special tokens...).
        self.post_processor_ids: frozenset[int] = frozenset(post_processor_ids)
        # fill-in-the-middle tokens a GGUF names ("pre", "suf", "mid", "rep", "sep"; text/fim.py)
        self.fim_token_ids: dict[str, int] = dict(fim_token_ids or {})
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.add_eos = add_eos and eos_token_id is not None
        stops = set(stop_token_ids)
        if eos_token_id is not None:
            stops.add(eos_token_id)
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self.bos_token: str | None = self.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token: str | None = self.id_to_token(eos_token_id) if eos_token_id is not None else None

    @property
    def backend(self) -> Backend:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text are always matched whole;
        `add_special_tokens` only decides whether BOS (and EOS, if the model asks) are added."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)
            if self.add_eos:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._backend.id_to_token(i) if 0 <= i < self.vocab_size else None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes token `i` stands for, so streamed output can be cut on UTF-8 boundaries.
        An added (special or user-defined) token is its literal text."""
        token = self.id_to_token(i)
        if token is None:
            raise IndexError(f"token id {i} is outside the vocabulary of {self.vocab_size}")
        if isinstance(self._backend, rwkv_world.ByteTrie):
            return self._backend.spellings[i]
        if i in self._added_ids:
            return token.encode()
        if self._byte_level:
            table = _unicode_to_bytes()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode()
        if m := _BYTE_TOKEN.fullmatch(token):
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    def save_hf(self, path: Path | str, chat_template: str | None = None) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` into folder `path` so that
        `from_hf_folder` reads back a tokenizer that encodes as this one. BOS/EOS addition moves into
        the post-processor, which is what decides it for a Hugging Face folder."""
        from tokenizers import processors

        path = Path(path)
        backend = Backend.from_str(self._backend.to_str())
        if self.add_bos or self.add_eos:
            specials = [(t, i) for t, i, on in ((self.bos_token, self.bos_token_id, self.add_bos),
                                                (self.eos_token, self.eos_token_id, self.add_eos)) if on]
            bos = f"{self.bos_token} " if self.add_bos else ""
            eos = f" {self.eos_token}" if self.add_eos else ""
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}$A{eos}", pair=f"{bos}$A{eos} {bos}$B:1{eos}", special_tokens=specials)
        backend.save(str(path / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
        }
        if chat_template is not None:
            config["chat_template"] = chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer llama.cpp builds from these keys. Any key of the wrong kind, or a
        vocabulary the tokenizers library refuses, is a one-line ModelFormatError naming the key."""
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFormatError("GGUF metadata has no tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or set(map(type, tokens)) != {str}:  # map(type): fast on 150k tokens
            raise ModelFormatError(f"tokenizer.ggml.tokens must be an array of strings, got {short_repr(tokens)}")
        types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if not isinstance(types, list) or not set(map(type, types)) <= {int, bool}:
            raise ModelFormatError(f"tokenizer.ggml.token_type must be an array of integers, got {short_repr(types)}")
        if len(types) != len(tokens):
            raise ModelFormatError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")

        pre = metadata.get("tokenizer.ggml.pre") or "default"
        if not isinstance(pre, str):
            raise ModelFormatError(f"tokenizer.ggml.pre must be a string, got {short_repr(pre)}")
        try:
            if model == "gpt2":
                backend = _byte_level_backend(metadata, tokens, types, pre)
                add_bos_default, default_bos, default_eos = pre in _ADDS_BOS, None, None
            elif model == "llama":
                backend = _sentencepiece_backend(metadata, tokens, types)
                add_bos_default, default_bos, default_eos = True, 1, 2
            elif model == "rwkv":
                backend = rwkv_world.from_gguf_tokens(tokens, types, CONTROL)
                add_bos_default, default_bos, default_eos = False, None, None
            else:
                raise UnsupportedModelError(
                    f"tokenizer model {short_repr(model)} is not supported (supported: 'gpt2', 'llama', 'rwkv')"
                )
        except WallbreakerError:
            raise
        except Exception as e:  # the tokenizers library raises a bare Exception for merges of unknown tokens
            where = _first_invalid_utf8(metadata, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
            if where is not None:
                raise ModelFormatError(f"{where} is not valid UTF-8") from e
            raise ModelFormatError(f"tokenizer.ggml.*: the tokenizers library refuses this vocabulary: {_one_line(e)}") from e

        def token_id(key: str, default: int | None = None) -> int | None:
            """The id under `key`; None where llama.cpp would ignore it (outside the vocabulary)."""
            value = metadata.get(f"tokenizer.ggml.{key}", default)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ModelFormatError(f"tokenizer.ggml.{key} must be an integer token id, got {short_repr(value)}")
            return value if value is not None and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos_token_id", default_bos), token_id("eos_token_id", default_eos)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
        if add_bos and bos is None:
            raise ModelFormatError("tokenizer.ggml.add_bos_token is true but there is no bos_token_id")
        explicit = [i for k in _EOG_ID_KEYS if (i := token_id(k)) is not None]
        typed = "tokenizer.ggml.token_type" in metadata
        control = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL or not typed}
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos=add_bos,
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            stop_token_ids=end_of_generation_ids(control, explicit),
            byte_level=model == "gpt2",
            vocab_size=len(tokens),
            fim_token_ids=_fim_token_ids(token_id),
        )

    @classmethod
    def _rwkv_world_folder(cls, path: Path) -> Tokenizer:
        """RWKV's World tokenizer from a folder's vocabulary file (fla-hub's, whose own tokenizer is
        remote code), as llama.cpp's converter puts it into a GGUF: BOS and EOS "<s>", neither added,
        and "\\n\\n" also ending a turn."""
        backend = rwkv_world.from_vocab_file(path / rwkv_world.VOCAB_FILE)
        turn_end = backend.token_to_id(rwkv_world.TURN_END)
        return cls(backend, bos_token_id=0, eos_token_id=0, add_bos=False, byte_level=False,
                   stop_token_ids=() if turn_end is None else (turn_end,), vocab_size=len(backend.texts))

    @classmethod
    def from_hf_folder(cls, path: Path | str) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file() and (path / rwkv_world.VOCAB_FILE).is_file():
            return cls._rwkv_world_folder(path)
        if not file.is_file():
            raise ModelFormatError(f"{path} has no tokenizer.json")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:
            raise ModelFormatError(f"{file} is not a valid tokenizer.json: {e}") from e
        tok_cfg = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
        model_cfg = _read_json(path / "config.json")
        gen_cfg = _read_json(path / "generation_config.json")

        def named_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(text) if isinstance(text, str) else None

        config_eos = [*_id_list(model_cfg.get("eos_token_id")), *_id_list(gen_cfg.get("eos_token_id"))]
        eos = named_id(tok_cfg.get("eos_token"))
        if eos is None and config_eos:
            eos = config_eos[0]
        bos = named_id(tok_cfg.get("bos_token"))
        if bos is None:
            bos = next(iter(_id_list(model_cfg.get("bos_token_id"))), None)

        # As in transformers 5, tokenizer.json's post-processor, not tokenizer_config.json's
        # add_bos_token, decides what encoding adds.
        try:
            with_specials = backend.encode("", add_special_tokens=True).ids
        except Exception as e:
            raise ModelFormatError(f"{file}: its post-processor fails: {_one_line(e)}") from e
        add_bos = bos is not None and with_specials[:1] == [bos]
        add_eos = eos is not None and with_specials[-1:] == [eos] and len(with_specials) > int(add_bos)
        state = json.loads(backend.to_str())
        decoder = state.get("decoder")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos=add_bos,
            add_eos=add_eos,
            stop_token_ids=end_of_generation_ids(
                {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}, config_eos
            ),
            byte_level='"ByteLevel"' in json.dumps(decoder),
            post_processor_ids=_post_processor_ids(state.get("post_processor")),
        )


def _fim_token_ids(token_id: Callable[[str], int | None]) -> dict[str, int]:
    """The FIM token ids under GGUF's keys (the current ones, then CodeLlama's older names)."""
    keys = {"pre": ("fim_pre_token_id", "prefix_token_id"), "suf": ("fim_suf_token_id", "suffix_token_id"),
            "mid": ("fim_mid_token_id", "middle_token_id"), "rep": ("fim_rep_token_id",),
            "sep": ("fim_sep_token_id",)}
    found = {}
    for kind, names in keys.items():
        ids = [i for name in names if (i := token_id(name)) is not None]
        if ids:
            found[kind] = ids[0]
    return found


def check_token_ids(tokenizer: Tokenizer, rows: int, source: str, embedding: str) -> None:
    """Refuse a tokenizer that can produce an id the embedding has no row for (llama.cpp refuses
    these files too); a padded embedding, with rows no token stands for, is fine."""
    if tokenizer.vocab_size > rows:
        raise ModelFormatError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but {embedding} has "
                               f"only {rows} rows")
    named = [("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id),
             *(("end-of-generation token id", i) for i in sorted(tokenizer.stop_token_ids)),
             *(("the post-processor's token id", i) for i in sorted(tokenizer.post_processor_ids))]
    for what, i in named:
        if i is not None and not 0 <= i < rows:
            raise ModelFormatError(f"{source}: {what} {i} is outside the {rows} rows of {embedding}")


def _post_processor_ids(node: Any) -> set[int]:
    """Every token id a serialized post-processor adds: TemplateProcessing's `special_tokens`
    ids, BertProcessing/RobertaProcessing's `cls`/`sep` pairs, within Sequences too."""
    ids: set[int] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "ids" and isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
            elif key in ("cls", "sep") and isinstance(value, list) and len(value) == 2 and isinstance(value[1], int):
                ids.add(value[1])
            else:
                ids |= _post_processor_ids(value)
    elif isinstance(node, list):
        for value in node:
            ids |= _post_processor_ids(value)
    return ids


def _first_invalid_utf8(metadata: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    """`key[i]` of the first string that is not valid UTF-8 (gguf_file keeps such bytes as surrogates)."""
    for key in keys:
        for i, text in enumerate(metadata.get(key) or ()):
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return f"{key}[{i}]"
    return None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def end_of_generation_ids(token_to_id: Mapping[str, int], explicit: Iterable[int] = ()) -> set[int]:
    """llama.cpp's end-of-generation set: the ids given, plus end-of-turn and FIM separator tokens
    found by their text, less `<|end|>` where gpt-oss style `<|return|>`/`<|call|>` end turns instead.

    `token_to_id` should hold only the vocabulary's control (special) tokens. llama.cpp also takes
    text tokens with these spellings, like Qwen's plain `</s>` and Gemma's HTML tag `</s>`, and so
    stops in the middle of HTML.
    """
    found = {text: i for text, i in token_to_id.items() if text in _EOG_TEXTS or text in _FIM_EOG_TEXTS}
    ids = set(found.values()) | set(explicit)
    if "<|end|>" in found and ({"<|return|>", "<|call|>"} <= found.keys() or {"<|calls|>", "<|flush|>"} <= found.keys()):
        ids.discard(found["<|end|>"])
    if "</s>" in found and "<|tool_response>" in found:
        ids.discard(found["</s>"])
    return ids


def _byte_level_backend(metadata: Mapping[str, Any], tokens: list[str], types: list[int], pre: str) -> Backend:
    splits = _PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        raise UnsupportedModelError(f"byte-level pre-tokenizer {pre!r} is not supported")
    alphabet = _unicode_to_bytes().keys()
    spelling = _bytes_to_unicode()

    def spelled(token: str, kind: int) -> str:
        if kind in (CONTROL, USER_DEFINED) or all(c in alphabet for c in token):
            return token
        return "".join(spelling[b] for b in token.encode("utf-8", "surrogateescape"))

    vocab = {spelled(t, k): i for i, (t, k) in enumerate(zip(tokens, types))}
    merges = _parse_merges(metadata.get("tokenizer.ggml.merges"))
    if merges is None:
        raise ModelFormatError("byte-level GGUF tokenizer has no tokenizer.ggml.merges")
    backend = Backend(BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                          fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES))
    if splits == (_GPT2_SPLIT,):
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, types, vocab)
    return backend


def _sentencepiece_backend(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> Backend:
    """SentencePiece BPE with byte fallback, built like transformers' GGUF loader builds it.

    Gemma files spell their whitespace-run tokens with real spaces, and their scores do not follow
    the merge order while the file order does; transformers renames the one and ranks by the other.
    """
    gemma = metadata.get("general.architecture") in _GEMMA_ARCHITECTURES
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens] if gemma else tokens
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = _parse_merges(metadata.get("tokenizer.ggml.merges"))
    if merges is None:
        if gemma:
            ranks = {t: -i for i, t in enumerate(spelled)}
        else:
            scores = metadata.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != len(tokens):
                raise ModelFormatError("SentencePiece GGUF tokenizer has neither merges nor one score per token")
            if not all(isinstance(x, (int, float)) for x in scores):
                raise ModelFormatError(f"tokenizer.ggml.scores must be an array of numbers, got {short_repr(scores)}")
            ranks = dict(zip(tokens, (float(x) for x in scores)))
        merges = _merges_from_vocab(vocab, ranks)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = spelled[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(spelled) else "<unk>"
    backend = Backend(BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True,
                          unk_token=unk if unk in vocab else None))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if metadata.get("tokenizer.ggml.add_space_prefix", not gemma):
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence(steps)
    _add_special_tokens(backend, tokens, types, vocab)
    return backend


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int], vocab: Mapping[str, int]) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so that
    both are matched whole in the text, as llama.cpp does, instead of being cut into pieces."""
    control = [AddedToken(t, normalized=False, special=True)
               for t, k in zip(tokens, types) if k == CONTROL and t in vocab]
    user = [AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _parse_merges(merges: Any) -> list[tuple[str, str]] | None:
    if merges is None:
        return None
    if not isinstance(merges, list) or not set(map(type, merges)) <= {str}:
        raise ModelFormatError(f"tokenizer.ggml.merges must be an array of strings, got {short_repr(merges)}")
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelFormatError(f"tokenizer.ggml.merges: malformed merge {short_repr(merge)}")
        pairs.append((merge[:cut], merge[cut + 1:]))
    return pairs


def _merges_from_vocab(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best-ranked token first; the order
    transformers' `generate_merges` gives, so that both tokenizers merge alike.

    A split point k is only tried where some vocabulary token is k long and some is n - k long,
    so a token far longer than the others costs one pass over the distinct token lengths, not
    n slices of n characters (a 1 MB token took hours). The merges hold the vocabulary's own
    strings, and the slicing work is bounded by a multiple of the vocabulary's size."""
    lengths = sorted({len(t) for t in vocab})
    have_length = set(lengths)
    canonical = {t: t for t in vocab}
    budget = _MERGE_WORK_PER_CHARACTER * sum(map(len, vocab)) + _MERGE_WORK_BASE
    merges: list[tuple[str, str, float]] = []
    for token, rank in ranks.items():
        n = len(token)
        local = []
        for k in lengths:
            if k >= n:
                break
            if n - k not in have_length:
                continue
            budget -= k
            left = canonical.get(token[:k])
            if left is None:
                continue
            budget -= n - k
            right = canonical.get(token[k:])
            if right is not None:
                local.append((left, right, rank))
        if budget < 0:
            raise ModelFormatError(
                "tokenizer.ggml.tokens: deriving SentencePiece merges from this vocabulary needs more than "
                f"{_MERGE_WORK_PER_CHARACTER} steps per character of its tokens; no real vocabulary overlaps that much")
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from e
    return value if isinstance(value, dict) else {}


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
