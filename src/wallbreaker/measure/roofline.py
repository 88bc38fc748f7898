"""The roofline of decoding: what one step must read and compute, and the tokens/s that allows.

A decode step of B sequences reads every weight once in the engine's resident form (one read
serves the whole batch), B rows of an untied embedding table (a tied table is read in full, as the
output head), and the K/V of every sequence's context in the cache dtype. It computes about
2 FLOPs per matmul weight per token, plus attention over the context. So

    memory bound  = B · bandwidth / bytes_per_step(B, context)      (grows with B, falls with context)
    compute bound = FLOP/s / FLOPs per token(context)               (the same for every B)

and decoding turns compute-bound at the batch where the two meet. Speculative decoding can pass
the memory bound (several tokens per weight read): a `roofline_fraction` above 1 means it did.

A mixture of experts reads only the experts its tokens chose: a step of B tokens reads the share
1 - (1 - k/E)^B of the expert weights (k of E experts per token, routed independently and evenly:
k/E at batch 1, nearly all of them at large batches), and each token multiplies k/E of them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..kv.cache import kv_bytes_per_position
from ..layers.linear import Linear, QuantLinear, module_bytes
from .machine import MachineProfile, load_profile, machine_path, quant_kind

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..formats.weights import ModelFiles

_FLOAT_KINDS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "bfloat16"}


def layer_windows(cfg: "ModelConfig") -> tuple[int | None, ...]:
    """Per attention layer: its sliding window, or None (a hybrid's recurrent layers read no K/V)."""
    return tuple(cfg.sliding_window if cfg.is_sliding(i) else None for i in range(cfg.num_layers)
                 if cfg.is_attention(i))


def attended_positions(windows: tuple[int | None, ...], context: int) -> int:
    """Positions whose K/V one new token reads, summed over layers (a sliding layer reads its window)."""
    return sum(context if w is None else min(context, w) for w in windows)


@dataclass(frozen=True)
class DecodeCost:
    """Bytes and FLOPs of one decode step of a built model (see the module docstring)."""

    weight_bytes: int  # read once a step, whatever the batch
    row_bytes: int  # one gathered row of an untied embedding table (0 when none)
    kv_bytes_per_layer_position: int  # K and V of one position in one layer, cache dtype
    layer_windows: tuple[int | None, ...]  # per layer: sliding window, or None for full attention
    matmul_params: dict[str, int]  # matmul kernel kind -> weights multiplied per token
    attn_flops_per_layer_position: int
    attn_kind: str  # the measured kind whose FLOP/s attention gets: `attention_<KV dtype>`
    expert_bytes: int = 0  # the part of weight_bytes that is experts
    experts: tuple[int, int] = (0, 0)  # experts in all, experts active per token
    state_bytes: int = 0  # one sequence's recurrent state: read, and written anew, every step

    @property
    def active_share(self) -> float:
        """The share of the experts one token runs (1 without experts)."""
        total, active = self.experts
        return active / total if total else 1.0

    def weights_read(self, batch: int) -> float:
        """Weight bytes a step of `batch` tokens reads: every dense weight, the chosen experts'."""
        touched = 1.0 - (1.0 - self.active_share) ** batch
        return self.weight_bytes - self.expert_bytes + self.expert_bytes * touched

    def kv_bytes(self, context: int) -> int:
        """K/V bytes one sequence reads at this context length."""
        return self.kv_bytes_per_layer_position * attended_positions(self.layer_windows, context)

    def bytes_per_step(self, batch: int, context: int) -> float:
        return self.weights_read(batch) + batch * (self.row_bytes + self.kv_bytes(context) + 2 * self.state_bytes)

    @property
    def break_even_context(self) -> float | None:
        """The context at which a sequence's K/V reads in a step equal its state's traffic (read
        and written); None without both."""
        per_position = self.kv_bytes(1)
        return 2 * self.state_bytes / per_position if per_position and self.state_bytes else None

    def bytes_per_token(self, batch: int, context: int) -> float:
        return self.bytes_per_step(batch, context) / batch

    @property
    def params(self) -> int:
        return sum(self.matmul_params.values())

    def memory_bound(self, bandwidth: float, batch: int, context: int) -> float:
        """Tokens/s (all sequences together) that `bandwidth` bytes/s allows."""
        return batch * bandwidth / self.bytes_per_step(batch, context)

    def compute_bound(self, flops: dict[str, float], context: int) -> float | None:
        """Tokens/s that the measured FLOP/s of each matmul kind allow (None: a kind not measured)."""
        def rate(kind: str) -> float | None:  # a profile stored before attention had its own rate: the GEMM's
            return flops.get(kind) or flops.get(kind.removeprefix("attention_")) or flops.get("float32")
        seconds = 0.0
        for kind, n in self.matmul_params.items():
            if rate(kind) is None:
                return None
            seconds += 2.0 * n / rate(kind)
        attn_rate = rate(self.attn_kind)
        if attn_rate is None:
            return None
        positions = attended_positions(self.layer_windows, context)
        seconds += self.attn_flops_per_layer_position * positions / attn_rate
        return 1.0 / seconds if seconds else None

    def bound(self, bandwidth: float, flops: dict[str, float] | None, batch: int, context: int) -> float:
        memory = self.memory_bound(bandwidth, batch, context)
        compute = self.compute_bound(flops, context) if flops else None
        return memory if compute is None else min(memory, compute)

    def crossover_batch(self, bandwidth: float, flops: dict[str, float], context: int) -> float | None:
        """The batch at which the memory bound reaches the compute bound (None: never, the K/V reads
        of each extra sequence cost more time than its FLOPs). Experts count in full: by the
        crossover batch nearly every one is read."""
        compute = self.compute_bound(flops, context)
        if compute is None:
            return None
        per_seq = self.row_bytes + self.kv_bytes(context) + 2 * self.state_bytes
        denominator = bandwidth - compute * per_seq  # from B·bw / (W + B·per_seq) = compute
        return compute * self.weight_bytes / denominator if denominator > 0 else None


def _tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    return {t.data_ptr(): t for t in list(module.parameters()) + list(module.buffers())}


def _matmul_params(model: nn.Module, share: float = 1.0, experts: set[int] | None = None) -> dict[str, float]:
    """Weights multiplied per token, by kernel kind; a module in `experts` (ids) counts `share` of its own."""
    params: dict[str, float] = {}
    for m in model.modules():
        weight = share if experts and id(m) in experts else 1.0
        if isinstance(m, QuantLinear):
            for rows, qtype in zip(m.rows, m.qtypes):
                kind = quant_kind(qtype)
                params[kind] = params.get(kind, 0) + weight * rows * m.in_features
            continue
        if isinstance(m, Linear):
            kind, n = _FLOAT_KINDS.get(m.weight.dtype, "float32"), m.weight.numel()
        else:
            continue
        params[kind] = params.get(kind, 0) + weight * n
    return params


def model_cost(cfg: "ModelConfig", weight_bytes: int, table_bytes: int, kv_dtype: torch.dtype,
               matmul_params: dict[str, float] | None = None, expert_bytes: int = 0) -> DecodeCost:
    """The cost of a decode step of a model of `cfg` whose weights take `weight_bytes`, of which
    `table_bytes` are an embedding table read by rows (0: none, or a tied table read whole as the head)
    and `expert_bytes` experts."""
    return DecodeCost(
        weight_bytes=weight_bytes - table_bytes,
        row_bytes=table_bytes // cfg.vocab_size,
        kv_bytes_per_layer_position=kv_bytes_per_position(cfg, kv_dtype),
        layer_windows=layer_windows(cfg),
        matmul_params=matmul_params or {},
        attn_flops_per_layer_position=4 * cfg.num_heads * cfg.head_dim,
        attn_kind=f"attention_{_FLOAT_KINDS.get(kv_dtype, 'bfloat16')}",  # int8/fp8 pages: read as bfloat16
        expert_bytes=expert_bytes,
        experts=(cfg.num_experts, cfg.num_experts_per_tok),
        state_bytes=cfg.state_bytes_per_sequence,
    )


def _expert_modules(model: nn.Module) -> list[nn.Module]:
    """Every expert's projections: those of a mixture with `num_experts` and per-expert `gate_up` and
    `down` lists (models/moe.py's SparseMoE, models/gpt_oss.py's GptOssMoE)."""
    return [e for m in model.modules() if hasattr(m, "num_experts") and isinstance(getattr(m, "gate_up", None), nn.ModuleList)
            for e in (*m.gate_up, *m.down)]


def decode_cost_of(model: nn.Module, kv_dtype: torch.dtype) -> DecodeCost:
    """A built model's: its weights in their resident form."""
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    head_tensors = _tensors(head) if head is not None else {}
    gathered = [t for ptr, t in _tensors(embed).items() if ptr not in head_tensors] if embed is not None else []
    table_bytes = sum(t.numel() * t.element_size() for t in gathered)
    cfg = model.config
    experts = _expert_modules(model)
    ids = {id(sub) for e in experts for sub in e.modules()}
    share = cfg.num_experts_per_tok / cfg.num_experts if cfg.is_moe else 1.0
    expert_bytes = sum(module_bytes(e) for e in experts)
    return model_cost(cfg, module_bytes(model), table_bytes, kv_dtype, _matmul_params(model, share, ids),
                      expert_bytes)


_COSTS: "weakref.WeakKeyDictionary[nn.Module, dict[torch.dtype, DecodeCost]]" = weakref.WeakKeyDictionary()


def decode_cost(model: nn.Module, kv_dtype: torch.dtype) -> DecodeCost:
    """`decode_cost_of`, computed once per model (request metrics ask for it often)."""
    per_model = _COSTS.setdefault(model, {})
    if kv_dtype not in per_model:
        per_model[kv_dtype] = decode_cost_of(model, kv_dtype)
    return per_model[kv_dtype]


def llm_cost(llm: Any) -> DecodeCost:
    return decode_cost(llm.model, llm.kv_cache.tensor.dtype)


def stored_decode_cost(files: "ModelFiles", kv_dtype: torch.dtype) -> DecodeCost:
    """The cost with the weights in their stored (file) form, for `inspect` and llama.cpp, which build
    no model of ours (memory only: no matmul kinds, so no compute bound)."""
    cfg = files.config
    table = files.weights.get("token_embd.weight")
    untied = table.nbytes if table is not None and not cfg.tie_word_embeddings else 0
    experts = sum(w.nbytes for name, w in files.weights.items() if name.endswith("_exps.weight"))
    return model_cost(cfg, files.weight_bytes, untied, kv_dtype, expert_bytes=experts)


# -- the stored machine profile --------------------------------------------------------------------
_PROFILE: dict[str, Any] = {"mtime": None, "profile": None}


def machine_profile() -> MachineProfile | None:
    """The stored profile (`wallbreaker roofline` writes it), re-read only when the file changes."""
    path = machine_path()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    if _PROFILE["mtime"] != mtime:
        _PROFILE.update(mtime=mtime, profile=load_profile(path))
    return _PROFILE["profile"]


def stored_bandwidth(threads: int | None = None) -> float | None:
    """Best measured read bandwidth (bytes/s) at `threads` (default: torch's current thread count)."""
    profile = machine_profile()
    return profile.read_bandwidth(threads or torch.get_num_threads()) if profile else None


def stored_flops() -> dict[str, float] | None:
    profile = machine_profile()
    return {k: s.best for k, s in profile.flops.items()} if profile and profile.flops else None


def decode_bound_tokens_per_s(llm: Any, batch: int = 1, context: int = 1,
                              bandwidth: float | None = None) -> float | None:
    """The roofline bound on decode tokens/s (all `batch` sequences together) for a loaded `LLM`;
    None when no bandwidth is given or stored."""
    bandwidth = bandwidth or stored_bandwidth()
    if bandwidth is None:
        return None
    return llm_cost(llm).bound(bandwidth, stored_flops(), batch, context)


def roofline_fraction(tokens_per_s: float | None, cost: DecodeCost, context: int, bandwidth: float | None,
                      flops: dict[str, float] | None = None, batch: int = 1) -> float | None:
    """Decode tokens/s as a fraction of the bound at `batch` and (mean) `context`: the one roofline
    fraction, for every engine `bench` runs, `roofline` and a request's metrics. Without `flops` the
    bound is the memory bound alone. None when there is no bandwidth or nothing was decoded."""
    if not tokens_per_s or not bandwidth:
        return None
    return tokens_per_s / cost.bound(bandwidth, flops, batch, context)


def request_roofline_fraction(llm: Any, metrics: dict) -> float | None:
    """A request's decode tokens/s (its `metrics`) as a fraction of the batch-1 bound at its mean decode
    context, against the stored machine profile. Computed when asked, never on the engine's path.

    A request that shared its steps with others is measured against running alone, so under load
    the fraction shows what each request got, not what the machine did.
    """
    context = int(metrics.get("num_prompt_tokens", 0) + metrics.get("num_generated_tokens", 0) / 2) or 1
    return roofline_fraction(metrics.get("decode_tokens_per_s"), llm_cost(llm), context, stored_bandwidth(),
                             stored_flops())
