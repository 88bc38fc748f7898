"""What every architecture is: embeddings, a stack of decoder layers, a final norm, the output head.
An architecture (llama.py, gemma.py) supplies the class of its layers."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from ..layers.linear import Linear, PromptRows, QuantLinear
from ..layers.lora import LoRARows
from ..layers.norm import RMSNorm
from ..layers.recurrent import RecurrentMixer
from .decoder_plan import DecoderStackPlan
from .source import WeightSource


def rms_norm(src: WeightSource, name: str, eps: float) -> RMSNorm:
    """An RMSNorm with the named weight, kept in float32 on every path."""
    w = src.tensor(name).float()
    norm = RMSNorm(w.shape[0], eps)
    norm.weight.data = w
    return norm


class CausalLM(nn.Module):
    """Token ids in, hidden states out (`forward`); hidden states to vocabulary logits (`logits`).

    `layer_class(cfg, i, src)` builds layer i; a layer maps (h, meta, delta) to (h, delta), the
    residual add deferred to the next norm (`RMSNorm.add_and_norm`), and holds its attention as `attn`
    (None or absent in a recurrent layer, whose state-keeping module is a `RecurrentMixer`)."""

    layer_class: type[nn.Module]
    batch_invariant = False  # set_batch_invariant
    prompt_rows: PromptRows | None = None  # set_batch_invariant
    lora_rows: LoRARows | None = None  # where LoRA adapters are enabled (lora/registry.py)
    final_norm = "output_norm.weight"  # the norm after the last layer (LFM2 stores it as token_embd_norm)

    def __init__(self, cfg: ModelConfig, src: WeightSource):
        super().__init__()
        self.config = cfg
        self.embed, self.lm_head = src.embedding_and_head(cfg.tie_word_embeddings)
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.embed_scale else None
        self.layers = nn.ModuleList(self.layer_class(cfg, i, src) for i in range(cfg.num_layers))
        self.norm = rms_norm(src, self.final_norm, cfg.rms_norm_eps)
        self.final_softcap = cfg.final_logit_softcap
        self.decoder_plan = DecoderStackPlan(self.layers)  # the C++ stack for decode steps, where it runs

    def set_batch_invariant(self, on: bool) -> None:
        """Compute every token's row the same whatever else is in its step: the other sequences, the
        chunk of the prompt it is in, a prefix reused from the cache, speculation, a recompute after
        preemption. Every linear layer then keeps to its batch-invariant form (layers/linear.py): the
        layers of the blocks route prompt tokens to the prefill path and generated tokens to the
        decode path, each in calls of one shape, by the `PromptRows` that `forward` sets each step;
        the output head and a mixture's experts take the decode path for every row. The model runner
        puts a step's generated tokens first, for the paged attention kernel, and its prompt tokens
        last, for SDPA in calls of one shape (layers/attention.py). Recurrent layers scan a prompt
        chunk by chunk and a step token by token, so a hybrid's rows stay within rounding, not bit
        for bit (and all its rows take the decode path)."""
        self.batch_invariant = on
        self.prompt_rows = PromptRows() if on else None
        for module in self.modules():
            if isinstance(module, (Linear, QuantLinear)):
                module.batch_invariant = on
                module.prompt_rows = None
        if on:
            for module in _per_token_linears(self.layers):
                module.prompt_rows = self.prompt_rows
        self.decoder_plan.dense = not on

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden] float32: what the first layer receives (the residual stream is float32
        on every path)."""
        h = self.embed(input_ids).float()
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`embeds`: (rows [R], vectors [R, hidden]) that take the place of those rows' token
        embeddings (an image's soft tokens: its encoder's output, unscaled). Vectors wider than the
        hidden size carry Qwen3-VL's DeepStack features after the first `hidden`: the k-th is added
        to those rows' hidden states after the k-th layer."""
        h = self.embed_tokens(input_ids)
        deepstack = None
        if embeds is not None:
            rows, values = embeds[0], embeds[1].to(h.dtype)
            h[rows] = values[:, :h.shape[-1]]
            if values.shape[-1] > h.shape[-1]:
                deepstack = values[:, h.shape[-1]:].unflatten(-1, (-1, h.shape[-1]))  # [R, k, hidden]
        planned = None if deepstack is not None \
            else self.decoder_plan.run(h, meta, self.lora_rows.slots if self.lora_rows is not None else None)
        if planned is not None:
            return self.norm.add_and_norm(*planned)
        if self.prompt_rows is not None:
            self.prompt_rows.start = meta.num_paged_tokens if meta.split_by_origin else h.shape[0]
        try:
            delta = None
            for i, layer in enumerate(self.layers):
                h, delta = layer(h, meta, delta)
                if deepstack is not None and i < deepstack.shape[1]:  # h + delta is the layer's output
                    h = h.index_add(0, rows, deepstack[:, i])
        finally:
            if self.prompt_rows is not None:
                self.prompt_rows.start = None
        return self.norm.add_and_norm(h, delta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [B, vocab]
        if self.final_softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def attention_layers(self) -> list[nn.Module]:
        """The layers' attention modules, in order (a hybrid's recurrent layers have none)."""
        return [layer.attn for layer in self.layers if getattr(layer, "attn", None) is not None]

    def recurrent_layers(self) -> list[RecurrentMixer]:
        """The modules that keep a recurrent state, in layer order (kv/state_pool.py binds them)."""
        return [m for m in self.modules() if isinstance(m, RecurrentMixer)]


def _per_token_linears(module: nn.Module):
    """The linear layers under `module` that see every row of a step: not those under a module that
    runs some of the rows (`runs_row_subsets`, a mixture of experts)."""
    for child in module.children():
        if getattr(child, "runs_row_subsets", False):
            continue
        if isinstance(child, (Linear, QuantLinear)):
            yield child
        else:
            yield from _per_token_linears(child)
