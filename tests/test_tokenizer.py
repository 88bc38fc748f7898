"""Tokenizers from GGUF metadata against transformers' tokenizers built from the same files.

transformers' GGUF tokenizers agree token for token with llama.cpp's, with one exception handled
below: transformers does not know the "smollm" pre-tokenizer and splits with GPT-2's regex, while
llama.cpp, like SmolLM2's own tokenizer.json, first cuts every digit off on its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from wallbreaker.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from wallbreaker.formats.packaged import PACKAGED_MODELS, packaged_model_path
from wallbreaker.text.tokenizer import Tokenizer

TEXTS = [
    "",
    " ",
    "Hello world",
    " leading space",
    "def add(a, b):\n\tif a:\n\t\treturn a + b  # sum\n    pass\n\n\n",
    "class Foo:\n    def __init__(self):\n        self.x = {'k': [1, 2]}\r\n",
    "日本語のテキストです。中文句子，标点！한국어 문장",
    "emoji 🤖🎉 👍🏽 👨‍👩‍👧 ✨",
    "café naïve Ångström façade résumé Ελληνικά кириллица",
    "e\u0301 combining, \u00a0nbsp\u2009thin space\u200bzero width",
    "   many   spaces   ",
    "\n\n\nnewlines\n \n\t\n",
    "x  1 and x   12 b",
    "1234567 3.14159 -42 1e10 0x1F 2024-01-31",
    "I'm sure you're right, WE'LL see; they'd've said 'S'",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "text<|endoftext|>more <tool_call>{\"a\": 1}</tool_call>",
    "<bos>not at start <eos> and <0x41> and \u2581\u2581 literally",
    "<s>strike</s> <table><tr><td>1</td></tr></table>",
    "ends with spaces and newline  \n",
    "a" * 300 + " " + "ab" * 150,
]

_SMOLLM2_OWN_PRE_TOKENIZER = pre_tokenizers.Sequence(
    [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
)


@dataclass
class Pair:
    name: str
    metadata: dict[str, Any]
    ours: Tokenizer
    ref: Any  # transformers tokenizer


def read_metadata(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general."))}


def model_path(alias: str) -> Path:
    try:
        return packaged_model_path(alias)
    except ModelNotFoundError:
        pytest.skip(f"{alias} is not installed; install with: {PACKAGED_MODELS[alias].install_command}")


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5-coder-0.5b", "gemma3-270m"])
def pair(request: pytest.FixtureRequest) -> Pair:
    from transformers import AutoTokenizer

    path = model_path(request.param)
    metadata = read_metadata(path)
    ours = Tokenizer.from_gguf_metadata(metadata)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if metadata.get("tokenizer.ggml.pre") == "smollm":
        ref.backend_tokenizer.pre_tokenizer = _SMOLLM2_OWN_PRE_TOKENIZER
    return Pair(request.param, metadata, ours, ref)


@pytest.mark.real_model
def test_encode_matches_transformers(pair: Pair) -> None:
    wrong = [
        (text, special, ours, theirs)
        for text in TEXTS
        for special in (True, False)
        if (ours := pair.ours.encode(text, add_special_tokens=special))
        != (theirs := pair.ref.encode(text, add_special_tokens=special))
    ]
    assert not wrong


@pytest.mark.real_model
def test_decode_matches_transformers(pair: Pair) -> None:
    for text in TEXTS:
        ids = pair.ref.encode(text)
        for skip in (True, False):
            assert pair.ours.decode(ids, skip_special_tokens=skip) == pair.ref.decode(ids, skip_special_tokens=skip)
        round_trip = pair.ours.decode(pair.ours.encode(text, add_special_tokens=False), skip_special_tokens=False)
        assert round_trip == pair.ref.decode(pair.ref.encode(text, add_special_tokens=False), skip_special_tokens=False)
        if "\u2581" not in text:  # SentencePiece reads a literal "▁" as a space
            assert round_trip == text


@pytest.mark.real_model
def test_token_bytes_spell_the_text(pair: Pair) -> None:
    for text in TEXTS:
        ids = pair.ours.encode(text, add_special_tokens=False)
        spelled = b"".join(pair.ours.token_bytes(i) for i in ids)
        assert spelled == pair.ours.decode(ids, skip_special_tokens=False).encode()


EXPECTED_SPECIALS = {  # bos, eos, add_bos, stop tokens (llama.cpp's end-of-generation set)
    "smollm2": ("<|im_start|>", "<|im_end|>", False, {"<|endoftext|>", "<|im_end|>", "<reponame>"}),
    "qwen2.5-coder-0.5b": ("<|endoftext|>", "<|im_end|>", False,
                           {"<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}),
    "gemma3-270m": ("<bos>", "<eos>", True, {"<eos>", "<end_of_turn>"}),
}


@pytest.mark.real_model
def test_special_tokens(pair: Pair) -> None:
    bos, eos, add_bos, stops = EXPECTED_SPECIALS[pair.name]
    ours = pair.ours
    assert (ours.bos_token, ours.eos_token, ours.add_bos) == (bos, eos, add_bos)
    assert (ours.bos_token_id, ours.eos_token_id) == (pair.ref.bos_token_id, pair.ref.eos_token_id)
    assert {ours.id_to_token(i) for i in ours.stop_token_ids} == stops
    assert ours.vocab_size == len(pair.metadata["tokenizer.ggml.tokens"]) == len(pair.ref)
    plain = ours.encode("hi", add_special_tokens=False)
    assert ours.encode("hi") == ([ours.bos_token_id, *plain] if add_bos else plain)


@pytest.mark.real_model
def test_smollm2_splits_digits_like_llama_cpp() -> None:
    tok = Tokenizer.from_gguf_metadata(read_metadata(model_path("smollm2")))
    pieces = [tok.id_to_token(i) for i in tok.encode("x  1 a 23")]
    assert pieces == ["x", "ĠĠ", "1", "Ġa", "Ġ", "2", "3"]  # GPT-2's regex alone: "x", "Ġ", "Ġ", "1", ...


# --- A tiny byte-level BPE, trained here and written out as GGUF metadata ----------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'm here, you're there; it's 2024!",
    "def main():\n    for i in range(10):\n\t\tprint(i * 1234)\n",
    "Café, naïve façade — 日本語 and 中文 with emoji 🤖🎉 and 3.14159.",
    "    indented    text\n\n\nwith   many   spaces and tabs\t\t.",
]
SAMPLES = [*CORPUS, "", " ", "<|im_start|>user\nquick fox<|im_end|>\n", "unseen: Ωμέγα ∑ 🦊 99999", "  x  1  "]

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(*regexes: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> the HF pre-tokenizer such a tokenizer.json would have
    "default": lambda: _split_then_bytes(r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: _SMOLLM2_OWN_PRE_TOKENIZER,
    "qwen2": lambda: _split_then_bytes(QWEN2_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(LLAMA3_SPLIT),
}


def train_byte_level(pre: str) -> Backend:
    backend = Backend(models.BPE(ignore_merges=pre == "llama-bpe"))
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def as_gguf_metadata(backend: Backend, pre: str, **extra: Any) -> dict[str, Any]:
    model = json.loads(backend.to_str())["model"]
    tokens = [backend.id_to_token(i) for i in range(backend.get_vocab_size())]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in model["merges"]],
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        **extra,
    }


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_tiny_byte_level_round_trip(pre: str) -> None:
    trained = train_byte_level(pre)
    tok = Tokenizer.from_gguf_metadata(as_gguf_metadata(trained, pre))
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == trained.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>hi", add_special_tokens=False)[0] == trained.token_to_id("<|im_start|>")
    assert tok.decode(tok.encode("<|im_start|>hi")) == "hi"
    assert tok.stop_token_ids == {trained.token_to_id("<|endoftext|>"), trained.token_to_id("<|im_end|>")}


def test_tiny_add_bos_and_user_defined_tokens() -> None:
    trained = train_byte_level("gpt-2")
    meta = as_gguf_metadata(trained, "gpt-2", **{"tokenizer.ggml.add_bos_token": True})
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<think>"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 4]
    tok = Tokenizer.from_gguf_metadata(meta)
    think = len(meta["tokenizer.ggml.tokens"]) - 1
    assert tok.vocab_size == think + 1
    ids = tok.encode("<think>ok")
    assert ids[:2] == [tok.bos_token_id, think]
    assert tok.decode(ids) == "<think>ok"  # user-defined tokens are text, not skipped
    assert tok.encode("", add_special_tokens=False) == []


def sentencepiece_metadata(add_space_prefix: bool) -> dict[str, Any]:
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "\u2581", "a", "b", "c", "ab", "\u2581a", "\u2581ab", "abc", "\u2581abc"]
    types = [2, 3, 3, *[6] * 256, *[1] * 9]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


@pytest.mark.parametrize("prefix", [False, True])
def test_tiny_sentencepiece(prefix: bool) -> None:
    tok = Tokenizer.from_gguf_metadata(sentencepiece_metadata(prefix))
    ids = tok.encode("abc ab€")
    assert ids[0] == 1 and tok.add_bos
    expected = ["\u2581abc"] if prefix else ["abc"]
    expected += ["\u2581ab", "<0xE2>", "<0x82>", "<0xAC>"]  # "€" is not in the vocabulary: its UTF-8 bytes
    assert [tok.id_to_token(i) for i in ids[1:]] == expected
    assert tok.decode(ids) == "abc ab€"
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == ("abc ab€" if not prefix else " abc ab€").encode()
    assert tok.stop_token_ids == {2}


def test_hf_folder(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    trained = train_byte_level("qwen2")
    trained.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    trained.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,  # tokenizer.json wins
        "bos_token": "<|endoftext|>", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
    }))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 0}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.bos_token, tok.eos_token, tok.add_bos) == ("<|endoftext|>", "<|im_end|>", True)
    assert tok.stop_token_ids == {0, 2}
    for text in SAMPLES:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)


def test_hf_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_unknown_tokenizer_model() -> None:
    meta = as_gguf_metadata(train_byte_level("gpt-2"), "gpt-2", **{"tokenizer.ggml.model": "ugm"})
    with pytest.raises(UnsupportedModelError, match="'ugm'") as info:
        Tokenizer.from_gguf_metadata(meta)
    assert "\n" not in str(info.value)


def test_unknown_pre_tokenizer_and_missing_vocabulary() -> None:
    meta = as_gguf_metadata(train_byte_level("gpt-2"), "no-such-pre")
    with pytest.raises(UnsupportedModelError, match="'no-such-pre'"):
        Tokenizer.from_gguf_metadata(meta)
    with pytest.raises(ModelFormatError, match="tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
