"""Token log-probabilities in OpenAI's two shapes: completions' parallel lists and chat's `content` list."""
from __future__ import annotations

from collections.abc import Sequence

from ..text.tokenizer import Tokenizer
from .responses import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

TopList = Sequence[tuple[int, float]]


class TokenStrings:
    """Each token's text and bytes, cached. A token that is not whole UTF-8 on its own (a piece of a
    multi-byte character) is spelled `bytes:\\xe2\\x80` as OpenAI does."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def longest_token_bytes(self) -> int:
        return max((len(self._tokenizer.token_bytes(i)) for i in range(self._tokenizer.vocab_size)), default=1) or 1

    def get(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            raw = self._token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            entry = self._cache[token_id] = (text, raw)
        return entry

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _token_bytes(self, token_id: int) -> bytes:
        """A token id the tokenizer lacks (a padded embedding row) is spelled as nothing, never an error."""
        try:
            return self._tokenizer.token_bytes(token_id)
        except IndexError:
            return b""


def completion_logprobs(strings: TokenStrings, token_ids: Sequence[int], logprobs: Sequence[float],
                        top: Sequence[TopList], text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset` is where the first token starts in the completion (a stream's chunks continue it)."""
    out = CompletionLogprobs(top_logprobs=[])
    offset = text_offset
    for token_id, logprob, candidates in zip(token_ids, logprobs, top):
        text = strings.text(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append({strings.text(t): lp for t, lp in candidates})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(strings: TokenStrings, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[TopList]) -> ChoiceLogprobs:
    content = []
    for token_id, logprob, candidates in zip(token_ids, logprobs, top):
        text, raw = strings.get(token_id)
        alternatives = [TopLogprob(token=strings.text(t), logprob=lp, bytes=list(strings.get(t)[1]))
                        for t, lp in candidates]
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(raw), top_logprobs=alternatives))
    return ChoiceLogprobs(content=content)
