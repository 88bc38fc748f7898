"""BERT's WordPiece tokenizers: from its Hugging Face folder (tokenizer.json, made to add [CLS] and
[SEP] as BOS and EOS) and from llama.cpp's `bert` GGUF vocabulary."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ModelFormatError
from .tokenizer import Tokenizer


def bert_hf_tokenizer(path: Path) -> Tokenizer:
    """BERT's WordPiece tokenizer with [CLS] text [SEP] around every text (its post-processor's
    template; the Tokenizer adds them as BOS and EOS). Truncation is the request's to ask for."""
    base = Tokenizer.from_hf_folder(path)
    backend = base.backend
    backend.no_padding()  # sentence-transformers' tokenizer.json pads to 128 and cuts at 128: we do neither
    backend.no_truncation()
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    if cls is None or sep is None:
        raise ModelFormatError(f"{path}/tokenizer.json: a BERT tokenizer needs [CLS] and [SEP] tokens")
    return Tokenizer(backend, bos_token_id=cls, eos_token_id=sep, add_bos=True, add_eos=True, byte_level=False,
                     vocab_size=base.vocab_size)


def gguf_wordpiece_tokenizer(metadata: dict[str, Any], label: str) -> Tokenizer:
    """The Hugging Face WordPiece tokenizer (BERT's normalizer and pre-tokenizer, [CLS] ... [SEP])
    from llama.cpp's `bert` vocabulary. Control tokens (type 3) are kept as written."""
    from tokenizers import Tokenizer as Backend, models, normalizers, pre_tokenizers

    tokens = metadata.get("tokenizer.ggml.tokens")
    kinds = metadata.get("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not isinstance(kinds, list) or len(tokens) != len(kinds):
        raise ModelFormatError(f"{label}: tokenizer.ggml.tokens and token_type must be arrays of the same length")
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, kinds)):
        word = tok if kind == 3 else (tok[1:] if tok.startswith("\u2581") else "##" + tok)
        vocab.setdefault(word, i)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 100)
    lowercase = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
    backend = Backend(models.WordPiece(vocab, unk_token=tokens[unk_id] if 0 <= unk_id < len(tokens) else "[UNK]",
                                       max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                    lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    from tokenizers import AddedToken, decoders, processors
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(t, special=True) for t, k in zip(tokens, kinds) if k == 3])
    cls = metadata.get("tokenizer.ggml.bos_token_id")
    sep = metadata.get("tokenizer.ggml.seperator_token_id", metadata.get("tokenizer.ggml.eos_token_id"))
    if not (isinstance(cls, int) and isinstance(sep, int) and 0 <= cls < len(tokens) and 0 <= sep < len(tokens)):
        raise ModelFormatError(f"{label}: a bert vocabulary needs tokenizer.ggml.bos_token_id ([CLS]) and "
                               "seperator_token_id ([SEP])")
    cls_text, sep_text = tokens[cls], tokens[sep]
    backend.post_processor = processors.TemplateProcessing(single=f"{cls_text} $A {sep_text}",
                                                           pair=f"{cls_text} $A {sep_text} $B:1 {sep_text}:1",
                                                           special_tokens=[(cls_text, cls), (sep_text, sep)])
    return Tokenizer(backend, bos_token_id=cls, eos_token_id=sep, add_bos=True, add_eos=True, byte_level=False,
                     vocab_size=len(tokens))
