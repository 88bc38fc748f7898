import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from wallbreaker.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Stop here: END of story. The end.",
    "日本語のテキストです。中文文本很好。",
    "Emoji 😀🎉👍🏽 and more 😀😀 🇯🇵",
    "naïve café façade — “quoted”",
    "abcd abcd abcd",
]
PIECES = ["The", " quick", " fox", " END", " end", ".", " ", "\n", "日本語", "中文", "😀", "🎉", "👍🏽",
          "🇯🇵", "café", " naïve", "—", "“x”", "é", "ab", "abc", "STOP", "<eos>"]


class ByteBPE:
    """A tiny byte-level BPE, trained here so the tests need no downloaded tokenizer."""

    def __init__(self) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<eos>"], show_progress=False)
        tok.train_from_iterator(CORPUS * 10, trainer)
        self.tok = tok
        self.eos = tok.token_to_id("<eos>")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> ByteBPE:
    return ByteBPE()


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def reference(full: str, stop: list[str], include: bool) -> tuple[str, bool]:
    """decode(all) cut at the stop string that completes first (ties: the longest)."""
    for end in range(1, len(full) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if full[:end].endswith(s):
                return (full[:end] if include else full[: end - len(s)]), True
    return full, False


def test_tokenizer_splits_characters_across_tokens(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1 and any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_equals_full_decode(tok, seed, skip_special):
    rng = random.Random(seed)
    prompt = tok.encode(random_text(rng, 4))
    if seed % 2:
        ids = tok.encode(random_text(rng, 30))
    else:  # arbitrary ids: lone bytes, broken UTF-8, special tokens
        ids = [rng.randrange(tok.tok.get_vocab_size()) for _ in range(60)]
    detok = IncrementalDetokenizer(tok, prompt, stop=[], skip_special_tokens=skip_special)
    emitted = ""
    for t in ids:
        chunk = detok.push(t)
        if seed % 2:
            assert "\ufffd" not in chunk
        emitted += chunk
        assert detok.text() == emitted
    emitted += detok.flush()
    assert emitted == detok.text() == tok.decode(ids, skip_special_tokens=skip_special)
    assert not detok.stopped


def test_partial_character_is_held_until_complete(tok):
    ids = tok.encode("a🎉")
    detok = IncrementalDetokenizer(tok, [], stop=[])
    chunks = [detok.push(t) for t in ids]
    assert chunks[-1].endswith("🎉") and all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == "a🎉"


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_random(tok, seed, include):
    rng = random.Random(seed)
    text = random_text(rng, 25)
    ids = tok.encode(text)
    full = tok.decode(ids)
    stop = []
    for _ in range(rng.randint(1, 3)):  # substrings of the output, so they do complete
        a = rng.randrange(len(full))
        stop.append(full[a : a + rng.randint(1, 6)])
    stop.append("never appears §§")
    want, want_stopped = reference(full, stop, include)
    first_stop = len(reference(full, stop, False)[0])

    detok = IncrementalDetokenizer(tok, tok.encode("prompt END"), stop, include_stop_str_in_output=include)
    emitted = ""
    pushed = []
    for t in ids:
        pushed.append(t)
        emitted += detok.push(t)
        if detok.stopped:
            break
        # Nothing that may turn out to be (part of) a stop string has been emitted.
        assert len(emitted) <= first_stop
        assert want.startswith(emitted)
    emitted += detok.flush()
    assert detok.stopped == want_stopped
    assert emitted == detok.text() == want
    # Stopped at the first token whose text completes a stop string.
    assert reference(tok.decode(pushed), stop, include)[0] == want
    if want_stopped:
        assert not reference(tok.decode(pushed[:-1]), stop, include)[1]


def test_stop_spanning_tokens_is_cut_exactly(tok):
    ids = tok.encode("The quick brown fox jumps over")
    stop = "brown fox ju"
    assert not any(stop in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [], [stop])
    out = ""
    for t in ids:
        out += detok.push(t)
        assert "The quick ".startswith(out)
        if detok.stopped:
            break
    assert detok.stopped and out == detok.text() == "The quick "


def test_stop_inside_a_token_and_include(tok):
    ids = tok.encode("The quick brown")
    assert "quick" in [tok.decode([i]).strip() for i in ids]
    for include, want in [(False, "The qu"), (True, "The quic")]:
        detok = IncrementalDetokenizer(tok, [], ["ic"], include_stop_str_in_output=include)
        out = "".join(detok.push(t) for t in ids)
        assert detok.stopped and out == detok.text() == want
        assert detok.push(ids[0]) == "" and detok.flush() == ""


def test_stop_on_multibyte_character(tok):
    ids = tok.encode("Emoji 😀🎉 more")
    detok = IncrementalDetokenizer(tok, [], ["🎉"], include_stop_str_in_output=True)
    out = ""
    for t in ids:
        out += detok.push(t)
        if detok.stopped:
            break
    assert out == "Emoji 😀🎉"


def test_flush_returns_held_back_text(tok):
    ids = tok.encode("The la")
    detok = IncrementalDetokenizer(tok, [], ["lazy dog"])
    out = "".join(detok.push(t) for t in ids)
    assert out == "The "
    assert detok.flush() == "la"
    assert not detok.stopped and detok.text() == "The la"
    assert detok.flush() == ""


def test_first_completed_stop_wins(tok):
    """"bc" completes before "abcd" does, even when both arrive with the same token."""
    for text in ["xabcd", "x abcd"]:
        ids = tok.encode(text)
        assert text != "x abcd" or tok.decode(ids[-1:]) == " abcd"
        detok = IncrementalDetokenizer(tok, [], ["abcd", "bc"])
        out = "".join(detok.push(t) for t in ids)
        assert detok.stopped and out == detok.text() == text[: text.index("bc")]


def test_prompt_ending_mid_character(tok):
    ids = tok.encode("ab🎉 end")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt, output = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(tok, prompt, [])
    out = "".join(detok.push(t) for t in output) + detok.flush()
    assert out == detok.text() == tok.decode(output)
