"""Fill-in-the-middle: a model's FIM tokens, and the prompt that asks for the text between a prefix
and a suffix, in llama.cpp's layout (`format_prompt_infill`, prefix-suffix-middle):

    [FIM_REP]myproject\\n [FIM_SEP]name\\n text ... [FIM_SEP]filename\\n   (/infill: the repository level)
    [FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]                            (both)

`suffix` on /v1/completions asks for the second line alone, the form the models document
(Qwen2.5-Coder's model card); llama.cpp's /infill always writes the first where the model has the
tokens (and, without FIM_SEP, the extra files' text separated by a snippet line).

The tokens come from the GGUF metadata (`tokenizer.ggml.fim_pre_token_id`, ...) or, as llama.cpp
finds them when it is absent, from the vocabulary's own spellings (Qwen2.5-Coder's `<|fim_prefix|>`,
CodeLlama's `<PRE>`, DeepSeek-Coder's `<｜fim▁begin｜>`, ...). Each piece of text is tokenized alone.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import InvalidRequestError
from .tokenizer import Tokenizer

# llama.cpp's llama-vocab.cpp lists, in its order
SPELLINGS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# GGUF keys: the current ones, then the older CodeLlama-era names
METADATA_KEYS: dict[str, tuple[str, ...]] = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "rep": ("tokenizer.ggml.fim_rep_token_id",),
    "sep": ("tokenizer.ggml.fim_sep_token_id",),
}
REPO_NAME = "myproject"  # llama.cpp's placeholder for the repository and the current file
CURRENT_FILE = "filename"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra files, where the model has no FIM_SEP


@dataclass(frozen=True)
class ExtraFile:
    """Context from another file (llama.cpp's `input_extra` chunk)."""

    text: str
    filename: str = "tmp"


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "FimTokens":
        """The tokenizer's FIM tokens; `InvalidRequestError` naming what is missing if it has none."""
        found = {kind: _find(tokenizer, kind) for kind in SPELLINGS}
        missing = [kind for kind in ("pre", "suf", "mid") if found[kind] is None]
        if missing:
            names = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
            raise InvalidRequestError(
                "this model has no fill-in-the-middle tokens (no FIM " + ", ".join(names[m] for m in missing)
                + " token in its GGUF metadata or its vocabulary, such as <|fim_prefix|>, <|fim_suffix|>, "
                  "<|fim_middle|>): it was not trained to fill in the middle")
        return cls(**found)

    def prompt(self, tokenizer: Tokenizer, prefix: str | list[int], suffix: str, *, repo_level: bool = False,
               extra: Sequence[ExtraFile] = (), prompt: str = "") -> list[int]:
        """The token ids asking for the middle between `prefix` (text or token ids) and `suffix`;
        `repo_level` adds the repository header and `extra` files; `prompt` continues the prefix
        (llama.cpp's /infill puts it there)."""
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False) if text else []

        ids: list[int] = [tokenizer.bos_token_id] if tokenizer.add_bos else []
        if repo_level and self.rep is not None:
            ids += [self.rep] + encode(REPO_NAME + "\n")
        for file in extra if repo_level else ():
            ids += [self.sep] + encode(file.filename + "\n") if self.sep is not None else encode(SNIPPET_SEPARATOR)
            ids += encode(file.text)
        if repo_level and self.sep is not None:
            ids += [self.sep] + encode(CURRENT_FILE + "\n")
        ids += [self.pre] + (list(prefix) if isinstance(prefix, list) else encode(prefix)) + encode(prompt)
        ids += [self.suf] + encode(suffix)
        return ids + [self.mid]


def _find(tokenizer: Tokenizer, kind: str) -> int | None:
    ids: Mapping[str, int] = tokenizer.fim_token_ids
    if kind in ids:
        return ids[kind]
    for spelling in SPELLINGS[kind]:
        token = tokenizer.token_to_id(spelling)
        if token is not None and token < tokenizer.vocab_size:
            return token
    return None
