"""RWKV's World tokenizer (text/rwkv_world.py) against BlinkDL's own, PyPI `rwkv`'s TRIE_TOKENIZER, on
its vocabulary file as fla-hub's folders ship it; the GGUF form (llama.cpp's converter's) is checked
in tests/test_rwkv7.py on the converter's own file."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n\treturn x ** 2  # square\n\n\n",
         "中文分词测试，RWKV 的世界词表。日本語も。", "emoji 🚀🌍 and accents: café naïve", "\x00\x01 bytes \x7f",
         "  leading spaces\r\n and \\ backslashes \\x41 'single' \"double\" \\n", "<s>a start token, then text"]


@pytest.fixture(scope="module")
def vocabulary() -> Path:
    rwkv = pytest.importorskip("rwkv")
    return Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"


@pytest.fixture(scope="module")
def blinkdl(vocabulary):
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
    return TRIE_TOKENIZER(str(vocabulary))


@pytest.fixture(scope="module")
def ours(vocabulary, tmp_path_factory):
    from wallbreaker.text.tokenizer import Tokenizer
    folder = tmp_path_factory.mktemp("rwkv_world")
    shutil.copy(vocabulary, folder)
    return Tokenizer.from_hf_folder(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_a_folders_vocabulary_encodes_as_blinkdls(ours, blinkdl, text):
    ids = ours.encode(text, add_special_tokens=False)
    if text.startswith("<s>"):  # a special token written in the text is matched whole, as llama.cpp's does
        assert ids[0] == 0
        ids, text = ids[1:], text[3:]
    assert ids == blinkdl.encode(text)
    assert ours.decode(ids) == text
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()


def test_a_long_text_encodes_as_blinkdls(ours, blinkdl):
    text = "".join(TEXTS[:4]) * 200
    assert ours.encode(text, add_special_tokens=False) == blinkdl.encode(text)


def test_the_turn_ends_and_nothing_is_added(ours):
    assert ours.encode("Hi") == ours.encode("Hi", add_special_tokens=False)
    assert {0, ours.token_to_id("\\n\\n")} <= ours.stop_token_ids
    assert ours.vocab_size == 65530


def test_a_broken_vocabulary_line_is_a_clear_error(tmp_path):
    from wallbreaker.errors import ModelFormatError
    from wallbreaker.text.tokenizer import Tokenizer
    (tmp_path / "rwkv_vocab_v20230424.txt").write_text("1 '\\x00' 1\n2 'ab 5\n", encoding="utf-8")
    with pytest.raises(ModelFormatError, match="line 2"):
        Tokenizer.from_hf_folder(tmp_path)
