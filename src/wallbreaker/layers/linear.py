"""Linear layers: y = x Wᵀ + b. The float one is the exact reference; `QuantLinear` (the `auto`
path) keeps GGUF blocks as stored and runs our own kernels over them (wallbreaker.kernels).

`batch_invariant` (set for a whole model by `CausalLM.set_batch_invariant`, on by default): a row's
output bits do not depend on the other rows of the call. Two rules give that:

- every matmul call has one shape: PyTorch's float matmul and oneDNN's bfloat16 one pick their
  blocking, and so their order of summation, by the number of rows (a row among 600 and among 18
  differ in the last bits), so rows go in calls of exactly `INVARIANT_ROWS` (generated tokens) or
  `PROMPT_ROWS` (prompt tokens) rows, the last padded; the integer tiles compute every row alike
  whatever the call (tests/test_kernels.py) and need no padding;
- a row's path depends on the token, not on the call: the layers of a model's blocks share a
  `PromptRows` that the model sets each step (rows from `PromptRows.start` on are prompt tokens,
  models/base.py); prompt tokens take the fast prefill path (the dense path where the CPU has AMX,
  else the prompt tiles, which reduce every row alike too; `PROMPT_ROWS`-row float calls), generated
  tokens the decode path (the row tiles, `INVARIANT_ROWS`-row
  float calls), whether they come in a decode step, a speculative verification or a recompute after
  preemption. A layer without one (the output head, an expert of a mixture that sees some of the
  rows) takes the decode path for every row. A prompt of at most `SHORT_PROMPT` tokens takes the
  decode path whole (engine/sequence.py `prefill_path`): padded to one `PROMPT_ROWS`-row dense call
  it would cost twice its time on the integer tiles (Qwen2.5-0.5B, 32 tokens, AMX Xeon). The
  choice depends on the request alone, and the prefix cache keys such a prompt's blocks apart."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels as qk
from ..formats.mapping import file_mappings, mapped_file
from .direct import DirectModule
from .lora import LoRARows, LoRAWeights, add_lora


_qmatmul = qk._C.qmatmul
_qmatmul_dense = qk._C.qmatmul_dense


INVARIANT_ROWS = 16  # rows of every float matmul call of generated tokens in batch-invariant mode
PROMPT_ROWS = 512  # rows of every float and dense matmul call of prompt tokens: the default prefill chunk
SHORT_PROMPT = 64  # a prompt of at most this many tokens takes the decode path whole


class PromptRows:
    """Which rows of the step running now are prompt tokens: rows `start` on (the model runner puts
    them last, engine/model_runner.py); None between steps. One object shared by a model's layers."""

    start: int | None = None


def _split(x2: torch.Tensor, prompt: PromptRows | None) -> int:
    """Rows of x2 before its prompt rows (all of them where the layer has no `PromptRows`)."""
    if prompt is None or prompt.start is None:
        return x2.shape[0]
    return min(prompt.start, x2.shape[0])


def _in_calls_of(f, x2: torch.Tensor, rows: int) -> torch.Tensor:
    """f over x2 in calls of exactly `rows` rows, the last padded with zeros."""
    n = x2.shape[0]
    padded = -(-n // rows) * rows
    if padded != n:
        x2 = torch.cat([x2, x2.new_zeros(padded - n, x2.shape[1])])
    return torch.cat([f(chunk) for chunk in x2.split(rows)])[:n]


class Linear(nn.Module):
    batch_invariant = False
    prompt_rows: PromptRows | None = None
    lora_rows: LoRARows | None = None  # set with `lora` where adapters are enabled (layers/lora.py)
    lora: LoRAWeights | None = None  # every adapter slot's weights, once one targets this layer

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In the weights' dtype (the residual stream between layers is float32 on every path)."""
        rows = self.lora_rows
        if rows is not None and rows.slots is not None and self.lora is not None:
            return add_lora(self._base(x), x, self.lora, rows)
        return self._base(x)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if not self.batch_invariant:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, x.shape[-1])

        def f(chunk: torch.Tensor) -> torch.Tensor:
            return F.linear(chunk, self.weight, self.bias)
        split = _split(x2, self.prompt_rows)
        parts = [_in_calls_of(f, part, rows) for part, rows in ((x2[:split], INVARIANT_ROWS),
                                                                 (x2[split:], PROMPT_ROWS)) if len(part)]
        y = f(x2) if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.view(*x.shape[:-1], -1)


class QuantLinear(DirectModule):
    """GGUF blocks in the kernels' row layout, one or more segments (fused projections of the same
    input, each with its own type and rows) computed in one call; float32 out."""

    batch_invariant = False
    prompt_rows: PromptRows | None = None
    lora_rows: LoRARows | None = None  # as Linear's
    lora: LoRAWeights | None = None

    def __init__(self, segments: list[tuple[torch.Tensor, int]], in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = in_features
        self.qtypes = [int(q) for _, q in segments]
        self.rows = [int(w.shape[0]) for w, _ in segments]
        self.out_features = sum(self.rows)
        for i, (w, _) in enumerate(segments):
            self.register_buffer(f"blocks{i}", w)
        self.blocks = [w for w, _ in segments]  # the call's list (the buffers above are the same tensors)
        self.register_buffer("bias", bias)
        self._bias = bias  # read on every call: a plain attribute, not nn.Module's buffer lookup

    def as_embedding(self, dtype: torch.dtype) -> nn.Module:
        """The same blocks read by rows, for a tied embedding: one copy serves both ends."""
        from .embedding import QuantizedEmbedding
        assert len(self.blocks) == 1, "a tied embedding is one tensor"
        return QuantizedEmbedding(self.blocks[0], self.qtypes[0], (self.out_features, self.in_features), dtype,
                                  packed=True)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([qk.dequantize_packed(w, q, self.in_features) for w, q in zip(self.blocks, self.qtypes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if not self.batch_invariant:
            if x2.shape[0] >= qk.DENSE_MIN_ROWS and qk.dense_path():  # prefill on a CPU with AMX
                y = _qmatmul_dense(x2, self.blocks, self.qtypes, qk.DENSE_TILE_ROWS)
            else:
                y = _qmatmul(x2, self.blocks, self.qtypes, x2.shape[0] >= qk.PROMPT_MIN_ROWS)
        else:
            split = _split(x2, self.prompt_rows)
            if split == x2.shape[0]:  # no prompt rows: the row tiles
                y = _qmatmul(x2, self.blocks, self.qtypes)
            else:  # prompt rows: the dense path where it runs, else the prompt tiles (each row alike)
                y = (_qmatmul_dense(x2[split:], self.blocks, self.qtypes, qk.DENSE_TILE_ROWS, PROMPT_ROWS)
                     if qk.dense_path() else _qmatmul(x2[split:], self.blocks, self.qtypes, True))
                if split:
                    y = torch.cat([_qmatmul(x2[:split], self.blocks, self.qtypes), y])
        rows = self.lora_rows
        if rows is not None and rows.slots is not None and self.lora is not None:
            y = add_lora(y, x2, self.lora, rows)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], -1)
        return y if self._bias is None else y + self._bias


def _unique_tensors(module: nn.Module) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's weights (shared tensors counted once)."""
    return sum(t.numel() * t.element_size() for t in _unique_tensors(module))


def mapped_bytes(module: nn.Module) -> int:
    """Of `module_bytes`, those read from file mappings (the model file or the repack cache,
    formats/mapping.py) rather than held in the process's own memory."""
    maps = file_mappings()
    return sum(t.numel() * t.element_size() for t in _unique_tensors(module) if mapped_file(t, maps) is not None)
