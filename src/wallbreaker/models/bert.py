"""BERT: a post-norm encoder. Word + absolute position + token type embeddings and a LayerNorm;
each layer is bidirectional multi-head attention and a GELU MLP, each followed by residual add and
LayerNorm. It only pools (layers/pooling.py): an embedding (mean / CLS) or, with a classifier
(`BertForSequenceClassification`), a cross-encoder's logits.

It runs through the engine like any model, as prefill-only sequences that the scheduler admits
whole and frees in the step that computes them, but it does not use the paged KV cache:
bidirectional attention has no use for one (every token attends to every other token of the same
step, and no later token ever comes). Each sequence's attention is one SDPA over its own rows. On the
`auto` path its quantized linear layers are the generation models' own (`QuantLinear`: wide steps
take the dense bfloat16 path on a CPU with AMX, docs/kernels.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from ..layers.pooling import Pooler
from .source import WeightSource


class LayerNorm(nn.Module):
    def __init__(self, src: WeightSource, name: str, eps: float):
        super().__init__()
        self.weight = nn.Parameter(src.weights[name + ".weight"].load().float(), requires_grad=False)
        self.bias = nn.Parameter(src.weights[name + ".bias"].load().float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight, self.bias, self.eps)


def sequence_spans(meta: AttentionMetadata) -> list[tuple[int, int]]:
    """(first row, rows) of every sequence of the step, in row order: the short ones the runner
    grouped for the paged kernel, then the longer ones."""
    starts = meta.query_start.tolist()
    spans = [(a, b - a) for a, b in zip(starts, starts[1:])]
    return spans + [(p.start, p.length) for p in meta.prefills]


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = src.linear([p + f"attn_{x}.weight" for x in "qkv"], [p + f"attn_{x}.bias" for x in "qkv"])
        self.o = src.linear([p + "attn_output.weight"], [p + "attn_output.bias"])
        self.attn_norm = LayerNorm(src, p + "attn_output_norm", cfg.rms_norm_eps)
        self.up = src.linear([p + "ffn_up.weight"], [p + "ffn_up.bias"])
        self.down = src.linear([p + "ffn_down.weight"], [p + "ffn_down.bias"])
        self.out_norm = LayerNorm(src, p + "layer_output_norm", cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv(h).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # [T, heads, head_dim] each
        attn = torch.empty_like(q)
        for start, n in spans:
            rows = slice(start, start + n)
            # [1, heads, n, head_dim]: every token of the sequence sees every other (no mask)
            attn[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
                                                        v[rows].transpose(0, 1)[None])[0].transpose(0, 1)
        h = self.attn_norm(h + self.o(attn.flatten(1)).float())
        return self.out_norm(h + self.down(F.gelu(self.up(h))).float())


class BertModel(nn.Module):
    can_generate = False

    def __init__(self, cfg: ModelConfig, src: WeightSource):
        super().__init__()
        self.config = cfg
        self.embed = src.embedding("token_embd.weight")
        self.positions = nn.Parameter(src.weights["position_embd.weight"].load().float(), requires_grad=False)
        types = src.weights.get("token_types.weight")
        self.token_types = None if types is None else nn.Parameter(types.load().float(), requires_grad=False)
        self.embed_norm = LayerNorm(src, "token_embd_norm", cfg.rms_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg, i, src) for i in range(cfg.num_layers))
        head = None
        if cfg.pooling is not None and cfg.pooling.task == "score":
            # BertForSequenceClassification: tanh(pooler([CLS])) -> classifier (its dropout is off at inference)
            head = nn.Sequential(src.linear(["cls.pooler.weight"], ["cls.pooler.bias"]), nn.Tanh(),
                                 src.linear(["cls.output.weight"], ["cls.output.bias"]))
        self.pooler = Pooler(cfg.pooling, head) if cfg.pooling is not None else None

    def token_type_ids(self, input_ids: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """0 up to and including a sequence's first [SEP], 1 after it: BERT's pair encoding
        ([CLS] a [SEP] b [SEP]); a single text, whose one [SEP] ends it, is all type 0."""
        types = torch.zeros_like(input_ids)
        if self.token_types is None or self.token_types.shape[0] < 2 or self.config.sep_token_id is None:
            return types
        is_sep = (input_ids == self.config.sep_token_id).long()
        for start, n in spans:
            seps = is_sep[start:start + n]
            types[start:start + n] = ((torch.cumsum(seps, 0) - seps) > 0).long()
        return types

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids of whole sequences -> [T, hidden] float32 final hidden states."""
        spans = sequence_spans(meta)
        h = self.embed(input_ids).float() + self.positions[meta.positions]
        if self.token_types is not None:
            h = h + self.token_types[self.token_type_ids(input_ids, spans)]
        h = self.embed_norm(h)
        for layer in self.layers:
            h = layer(h, spans)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError("a BERT encoder has no language-model head")

    def attention_layers(self) -> list[nn.Module]:
        return []  # nothing of it lives in the KV pool
