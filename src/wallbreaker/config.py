"""Configuration: what a model is (`ModelConfig`, whichever file it came from) and how the engine runs
it (`EngineConfig`, every option of `LLM(...)` and of the verbs that run the engine)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from numbers import Integral, Real

import torch

from .errors import InvalidRequestError

HIDDEN_ACTS = ("silu", "gelu_tanh", "gelu")  # gelu: erf GELU, BERT's plain MLP
MAX_SIZE = 2**63
ATTENTION_LAYER_TYPES = ("full", "sliding")
# recurrent layers (layers/recurrent.py): LFM2's gated short convolution, a Mamba2 mixer, a gated delta net,
# a Mamba (v1) mixer
RECURRENT_LAYER_TYPES = ("conv", "mamba2", "linear_attention", "mamba", "rwkv7")
LAYER_TYPES = ATTENTION_LAYER_TYPES + RECURRENT_LAYER_TYPES
ROPE_TYPES = ("linear", "llama3", "yarn", "longrope")
POOLING_METHODS = ("mean", "cls", "last")
POOLING_TASKS = ("embed", "score")


class ConfigError(ValueError):
    """A ModelConfig field no model can have; `field` names it, so that a loader can name its key."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def short_repr(value: object, limit: int = 60) -> str:
    """repr(value), cut short: a crafted file may hold a megabyte where a number belongs."""
    if isinstance(value, (list, tuple, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if not _is_int(value):
        raise ConfigError(name, f"{name} must be an integer, got {short_repr(value)}")
    if value <= 0:
        raise ConfigError(name, f"{name} must be positive, got {value}")
    if value >= MAX_SIZE:
        raise ConfigError(name, f"{name} must be below 2**63 (tensors and kernels count in int64), got {value}")


def _positive_float(name: str, value: object) -> None:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise ConfigError(name, f"{name} must be a number, got {short_repr(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float
        finite = False
    if not (finite and value > 0):
        raise ConfigError(name, f"{name} must be finite and positive, got {value}")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies depart from theta ** (-2i / head_dim); layers/rotary.py builds them.

    - linear: every frequency divided by `factor`.
    - llama3: Llama 3.1's smooth blend between low and high frequencies (`factor`,
      `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`), or, as llama.cpp
      stores it (GGUF `rope_freqs.weight`), one divisor per frequency in `freq_factors`.
    - yarn: a ramp between interpolated and extrapolated frequencies (`factor`, `beta_fast`,
      `beta_slow`, `truncate`, `original_max_position_embeddings`) and `attention_factor` on cos/sin.
    - longrope (Phi-3): one divisor per frequency, `short_factor` for positions below
      `original_max_position_embeddings` and `long_factor` from there, and `attention_factor`.
    `attention_factor` None: derived from `factor` as transformers does (for longrope `factor` is
    max_position_embeddings / original_max_position_embeddings unless the model gives it).
    """

    kind: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()

    def check(self, head_dim: int) -> None:
        if self.kind not in ROPE_TYPES:
            raise ConfigError("rope_scaling", f"rope_scaling kind {short_repr(self.kind)} is not supported "
                                              f"(supported: {', '.join(ROPE_TYPES)})")
        _positive_float("rope_scaling.factor", self.factor)
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
            if getattr(self, name) is not None:
                _positive_float(f"rope_scaling.{name}", getattr(self, name))
        if self.original_max_position_embeddings is not None:
            _positive_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        needs = {"llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
                 "yarn": ("original_max_position_embeddings",), "longrope": ("original_max_position_embeddings",)}
        if self.kind == "llama3" and self.freq_factors:
            needs.pop("llama3")
        for name in needs.get(self.kind, ()):
            if getattr(self, name) is None:
                raise ConfigError("rope_scaling", f"{self.kind} RoPE scaling needs {name}")
        if self.kind == "llama3" and not self.freq_factors and self.low_freq_factor == self.high_freq_factor:
            raise ConfigError("rope_scaling", "llama3 RoPE scaling needs low_freq_factor != high_freq_factor")
        lists = {"short_factor": self.short_factor, "long_factor": self.long_factor, "freq_factors": self.freq_factors}
        if self.kind == "longrope" and not (self.short_factor and self.long_factor):
            raise ConfigError("rope_scaling", "longrope RoPE scaling needs short_factor and long_factor")
        for name, values in lists.items():
            if values and len(values) != head_dim // 2:
                raise ConfigError("rope_scaling", f"rope_scaling.{name} needs head_dim / 2 = {head_dim // 2} "
                                                  f"values, got {len(values)}")
            for v in values:
                _positive_float(f"rope_scaling.{name}", v)


@dataclass(frozen=True)
class PoolingConfig:
    """How the model pools. `method`: mean over the tokens, the first ([CLS]) token, or the last
    (decoder embedding models). `normalize`: embeddings come out with unit L2 norm (sentence-
    transformers' `Normalize` module). `task`: "embed" (the pooled hidden state is the embedding)
    or "score" (a classifier head on it gives `num_labels` logits: a cross-encoder)."""

    method: str
    normalize: bool = False
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")


@dataclass(frozen=True)
class ModelConfig:
    """What a model *is*, independent of the file it came from.

    Weight layout conventions (shared by every loader): q/k rows in Hugging Face order
    (rotate-half RoPE), Gemma norm weights as the effective multiplier (1 + w of HF).
    """

    architecture: str  # its family (formats/families.py): llama.cpp's general.architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    mrope_section: tuple[int, ...] = ()  # Qwen2.5-VL's multimodal RoPE (layers/rotary.py); (): plain
    mrope_interleaved: bool = False  # Qwen3-VL's: the sections dealt out pair by pair
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    # Gemma 3
    qk_norm: bool = False
    sandwich_norm: bool = False  # extra norms after attention and after the MLP
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default=())  # per layer: LAYER_TYPES; () is all "full"
    rope_local_theta: float | None = None  # RoPE base of sliding layers
    # Gemma 2: tanh soft-capping, cap * tanh(x / cap), of the attention scores and the final logits
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # mixture of experts (Mixtral, Qwen3-MoE): a softmax router picks num_experts_per_tok experts
    # of num_experts per token; their outputs are summed, weighted by the router's probabilities
    # (renormalized over the chosen ones with norm_topk_prob). expert_intermediate_size: each
    # expert's FFN width (None: intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # pooling models (models/bert.py, layers/pooling.py): how hidden states become an embedding or a
    # score; None: the model only generates. BERT also has token types (the segment after the first
    # [SEP], `sep_token_id`, is type 1) and a classifier of `num_labels` outputs (a cross-encoder).
    pooling: PoolingConfig | None = None
    type_vocab_size: int = 0
    sep_token_id: int | None = None
    num_labels: int = 0
    # LFM2: the taps of its layers' gated short convolution (layers/short_conv.py); 0: no such layers
    conv_kernel: int = 0
    # Qwen3-Next (models/qwen3_next.py): gated delta net layers ("linear_attention": linear_* sizes, a
    # causal convolution of linear_conv_kernel taps), attention rotating only the first rotary_dim
    # channels of a head (None: all), and a sigmoid-gated shared expert beside the routed ones
    rotary_dim: int | None = None
    linear_conv_kernel: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    shared_expert_intermediate_size: int = 0
    # Mamba2 and Granite-4.0-H (layers/mamba2.py, models/mamba2.py, models/granite_hybrid.py): the
    # mixer's geometry (heads of ssm_head_dim channels, ssm_num_groups groups of B/C of
    # ssm_state_size, a conv of ssm_conv_kernel taps, SSD chunks of ssm_chunk_size tokens, dt
    # clamped to ssm_time_step_limit); Granite's multipliers (embeddings, each branch before the
    # residual add, the attention scale (None: head_dim ** -0.5), the logits' divisor), its shared
    # expert's FFN width beside the routed experts (0: none) and whether its attention rotates (RoPE).
    ssm_num_heads: int = 0
    ssm_head_dim: int = 0
    ssm_num_groups: int = 0
    ssm_state_size: int = 0
    ssm_conv_kernel: int = 0
    ssm_conv_bias: bool = True
    ssm_chunk_size: int = 256
    ssm_time_step_limit: tuple[float, float] = (0.0, math.inf)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    shared_mlp_size: int = 0
    attention_rope: bool = True
    # Mamba (v1) and Falcon-Mamba (layers/mamba.py): a mixer of intermediate_size channels, each with a
    # state of ssm_state_size, a conv of ssm_conv_kernel taps (ssm_conv_bias), the time step made from
    # ssm_time_step_rank channels; Falcon-Mamba RMS-norms the time step, B and C (no weight) with
    # ssm_bc_norm_eps (None: no such norms).
    ssm_time_step_rank: int = 0
    ssm_bc_norm_eps: float | None = None
    # RWKV-7 (layers/rwkv7.py): heads of head_dim channels; the ranks of its low-rank projections of the
    # decay, the in-context learning rate, the value residual mix and the output gate
    rwkv_lora_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Refuse what no model can be, whichever loader read it: a loader turns the ValueError into
        a ModelFormatError naming its file and key. Sizes that tensors have are checked against
        the tensors by `check_weights`; these are the rules no shape check would catch."""
        if not isinstance(self.architecture, str) or not self.architecture:  # which ones run: formats/families.py
            raise ConfigError("architecture", f"architecture must be a family's name, got {short_repr(self.architecture)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", f"num_heads ({self.num_heads}) must be a multiple of "
                                              f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError("head_dim", f"head_dim must be even (RoPE rotates pairs of channels), got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            _positive_float(name, getattr(self, name))
        for name in ("query_pre_attn_scalar", "rope_local_theta", "attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, name) is not None:
                _positive_float(name, getattr(self, name))
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, RopeScaling):
                raise ConfigError("rope_scaling", f"rope_scaling must be a RopeScaling, got {short_repr(self.rope_scaling)}")
            self.rope_scaling.check(self.head_dim)
        if self.num_experts or self.num_experts_per_tok:
            _positive_int("num_experts", self.num_experts)
            _positive_int("num_experts_per_tok", self.num_experts_per_tok)
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError("num_experts_per_tok", f"num_experts_per_tok ({self.num_experts_per_tok}) "
                                                         f"exceeds num_experts ({self.num_experts})")
        if self.expert_intermediate_size is not None:
            _positive_int("expert_intermediate_size", self.expert_intermediate_size)
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != self.head_dim
                                   or not all(isinstance(n, int) and n >= 0 for n in self.mrope_section)):
            raise ConfigError("mrope_section", f"mrope_section must be three sizes summing to head_dim / 2, got "
                                               f"{short_repr(self.mrope_section)}")
        for name in ("tie_word_embeddings", "qkv_bias", "qk_norm", "sandwich_norm", "embed_scale", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"{name} must be true or false, got {short_repr(getattr(self, name))}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError("hidden_act", f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {short_repr(self.hidden_act)}")
        if not isinstance(self.layer_types, tuple) or (self.layer_types and len(self.layer_types) != self.num_layers):
            raise ConfigError("layer_types", f"layer_types must name every layer: {self.num_layers} layers, "
                                             f"{len(self.layer_types)} types")
        if any(t not in LAYER_TYPES for t in self.layer_types):
            bad = next(t for t in self.layer_types if t not in LAYER_TYPES)
            raise ConfigError("layer_types", f"layer_types must be {' or '.join(LAYER_TYPES)}, got {short_repr(bad)}")
        if self.conv_kernel:  # the loaders of LFM2 always set it
            _positive_int("conv_kernel", self.conv_kernel)
            if self.conv_kernel < 2:
                raise ConfigError("conv_kernel", f"conv_kernel must be at least 2, got {self.conv_kernel}")
        self._check_qwen3next()
        if self.bos_token_id is not None:
            self._token_id("bos_token_id", self.bos_token_id)
        if not isinstance(self.eos_token_ids, tuple):
            raise ConfigError("eos_token_ids", f"eos_token_ids must be a tuple, got {short_repr(self.eos_token_ids)}")
        for i in self.eos_token_ids:
            self._token_id("eos_token_ids", i)
        if "mamba2" in self.layer_types:
            self._check_mamba2()
        if "mamba" in self.layer_types:
            for name in ("ssm_state_size", "ssm_conv_kernel", "ssm_time_step_rank"):
                _positive_int(name, getattr(self, name))
            if self.ssm_bc_norm_eps is not None:
                _positive_float("ssm_bc_norm_eps", self.ssm_bc_norm_eps)
            if not isinstance(self.ssm_conv_bias, bool):
                raise ConfigError("ssm_conv_bias", f"ssm_conv_bias must be true or false, got {short_repr(self.ssm_conv_bias)}")
        if "rwkv7" in self.layer_types:
            ranks = self.rwkv_lora_ranks
            if not (isinstance(ranks, tuple) and len(ranks) == 4 and all(_is_int(r) and r > 0 for r in ranks)):
                raise ConfigError("rwkv_lora_ranks", f"rwkv_lora_ranks must be four positive integers, got "
                                                     f"{short_repr(ranks)}")

    def _check_mamba2(self) -> None:
        for name in ("ssm_num_heads", "ssm_head_dim", "ssm_num_groups", "ssm_state_size", "ssm_conv_kernel",
                     "ssm_chunk_size"):
            _positive_int(name, getattr(self, name))
        if self.ssm_num_heads % self.ssm_num_groups:
            raise ConfigError("ssm_num_groups", f"ssm_num_groups ({self.ssm_num_groups}) must divide ssm_num_heads "
                                                f"({self.ssm_num_heads})")
        limit = self.ssm_time_step_limit
        if not (isinstance(limit, tuple) and len(limit) == 2 and all(isinstance(v, Real) and not isinstance(v, bool)
                                                                    for v in limit) and 0 <= limit[0] <= limit[1]):
            raise ConfigError("ssm_time_step_limit", f"ssm_time_step_limit must be two numbers 0 <= low <= high, "
                                                     f"got {short_repr(limit)}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            _positive_float(name, getattr(self, name))
        if self.attention_multiplier is not None:
            _positive_float("attention_multiplier", self.attention_multiplier)
        if not _is_int(self.shared_mlp_size) or self.shared_mlp_size < 0:
            raise ConfigError("shared_mlp_size", f"shared_mlp_size must be a non-negative integer, "
                                                 f"got {short_repr(self.shared_mlp_size)}")
        if not isinstance(self.ssm_conv_bias, bool):
            raise ConfigError("ssm_conv_bias", f"ssm_conv_bias must be true or false, got {short_repr(self.ssm_conv_bias)}")
        if not isinstance(self.attention_rope, bool):
            raise ConfigError("attention_rope", f"attention_rope must be true or false, got {short_repr(self.attention_rope)}")

    def _check_qwen3next(self) -> None:
        if self.rotary_dim is not None:
            _positive_int("rotary_dim", self.rotary_dim)
            if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
                raise ConfigError("rotary_dim", f"rotary_dim must be even and at most head_dim ({self.head_dim}), "
                                                f"got {self.rotary_dim}")
        if self.shared_expert_intermediate_size:
            _positive_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        if "linear_attention" in self.layer_types:
            for name in ("linear_conv_kernel", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                         "linear_num_value_heads"):
                _positive_int(name, getattr(self, name))
            if self.linear_conv_kernel < 2:
                raise ConfigError("linear_conv_kernel", f"linear_conv_kernel must be at least 2, got {self.linear_conv_kernel}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError("linear_num_value_heads", f"linear_num_value_heads ({self.linear_num_value_heads}) "
                                                            f"must be a multiple of linear_num_key_heads "
                                                            f"({self.linear_num_key_heads})")

    def _token_id(self, name: str, value: object) -> None:
        if not _is_int(value):
            raise ConfigError(name, f"{name} must be an integer token id, got {short_repr(value)}")
        if not 0 <= value < self.vocab_size:
            raise ConfigError(name, f"{name} {value} is outside the embedding's {self.vocab_size} rows")

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_attention(self, layer: int) -> bool:
        return not self.layer_types or self.layer_types[layer] in ATTENTION_LAYER_TYPES

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (a hybrid's others keep a fixed-size state: layers/recurrent.py)."""
        return sum(self.is_attention(i) for i in range(self.num_layers))

    def state_shapes(self, layer: int) -> list[tuple[int, ...]]:
        """Layer `layer`'s recurrent state kinds for one sequence, float32 ([] for attention): the one
        account the state pool, `inspect` and the roofline size from (the runner checks each
        mixer's own `state_shapes` against it). LFM2: the last conv_kernel - 1 inputs; Mamba2: those
        of xBC, then S [heads, head_dim, d_state]; a gated delta net: those of q|k|v (channel-major),
        then S [value heads, k_dim, v_dim]; Mamba: those of x, then S [intermediate, d_state]; RWKV-7: the
        time mix's last input, its WKV state [heads, values, keys], the channel mix's last input."""
        kind = self.layer_types[layer] if self.layer_types else "full"
        if kind == "conv":
            return [(self.conv_kernel - 1, self.hidden_size)]
        if kind == "mamba2":
            conv_dim = self.ssm_num_heads * self.ssm_head_dim + 2 * self.ssm_num_groups * self.ssm_state_size
            return [(self.ssm_conv_kernel - 1, conv_dim), (self.ssm_num_heads, self.ssm_head_dim, self.ssm_state_size)]
        if kind == "mamba":
            return [(self.ssm_conv_kernel - 1, self.intermediate_size), (self.intermediate_size, self.ssm_state_size)]
        if kind == "rwkv7":
            return [(1, self.hidden_size), (self.num_heads, self.head_dim, self.head_dim), (1, self.hidden_size)]
        if kind == "linear_attention":
            channels = 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
                self.linear_num_value_heads * self.linear_value_head_dim
            return [(channels, self.linear_conv_kernel - 1),
                    (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)]
        return []

    @property
    def state_bytes_per_sequence(self) -> int:
        """One sequence's recurrent state across all layers (read and written whole every step)."""
        return sum(math.prod(shape) * 4 for i in range(self.num_layers) for shape in self.state_shapes(i))

    @property
    def is_recurrent(self) -> bool:
        """Whether any layer keeps a recurrent state (kv/state_pool.py)."""
        return self.num_attention_layers < self.num_layers

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        """Each expert's FFN width."""
        return self.expert_intermediate_size or self.intermediate_size


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# int8: symmetric, one float32 scale per token and KV head (amax / 127); fp8: e4m3 with such a
# scale (amax / 448). Both are written by the fused cache write and read by the paged kernel.
# `packed`: our kernels' path for every model (stored GGUF blocks as they are, float weights Q8_0 at
# load). `auto` is the same for a generative model; a pooling model keeps its checkpoint's precision
# (formats/stored_precision.py), so that its vectors are the reference's.
PACKED_DTYPES = ("auto", "packed")
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8,
                   "fp8": torch.float8_e4m3fn}


@dataclass
class EngineConfig:
    """How the engine runs a model: `LLM(model, **options)` takes these fields, the CLI has a flag for each."""

    model: str | os.PathLike | None = None
    mmproj: str | None = None  # llama.cpp's vision projector GGUF, beside a GGUF text model (llama-server's --mmproj)
    dtype: str = "auto"
    device: str = "cpu"
    kv_cache_dtype: str = "auto"  # "auto" (bfloat16 on the auto path, else the model's dtype) | KV_CACHE_DTYPES
    kv_block_size: int = 16
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_adaptive: bool = True
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0  # a rank silent this long in a collective fails the engine
    # The prefix cache's disk tier (kv/disk_cache.py) and saved sessions (kv/sessions.py) live in
    # kv_cache_disk_dir (None: ~/.cache/wallbreaker/kv, or $WALLBREAKER_CACHE/kv). kv_cache_disk_gb
    # bounds the tier; 0, the default, turns it off: llama.cpp's and vLLM's users do not expect an
    # engine to write gigabytes to disk they did not ask for, and on a fast prompt the tier only costs.
    # Sessions are written only when asked for (LLM.save_prefix, the server's /sessions), tier or not,
    # and never evicted: kv_cache_sessions_gb bounds their folder, a save past it is refused (delete
    # sessions to make room); 0 turns saving off.
    kv_cache_disk_dir: str | None = None
    kv_cache_disk_gb: float = 0.0
    kv_cache_sessions_gb: float = 8.0
    # Recurrent layers' states the prefix cache may keep as checkpoints (kv/state_pool.py); None: one
    # per max_num_seqs. They share kv_cache_memory_gb with the KV pages.
    prefix_state_slots: int | None = None
    # Every token's logits independent of what else its step computes (other sequences, the prompt
    # chunk it is in, a prefix reused from RAM or disk, speculation, a recompute after preemption):
    # the same request gives the same tokens, as vLLM's VLLM_BATCH_INVARIANT but by default. Prompt
    # tokens take the prefill path and generated tokens the decode path, each in calls of one shape
    # (layers/linear.py, layers/attention.py). Costs: on the float32 path decode (matmuls in calls of
    # 16 rows); a short prompt on a CPU with AMX is computed as a call of 512 rows; a block of
    # generated tokens is not reused as a later prompt's (kv/block_pool.py `hash_block`). An encoder
    # computes each input whole and ignores it.
    batch_invariant: bool = True
    # LoRA adapters beside the weights (lora/, docs/lora.md): up to max_loras loaded at once, each of
    # rank at most max_lora_rank (vLLM's default, 16); a request names one (LLM.generate's lora_request,
    # the server's model). Each adapted layer keeps room for max_loras adapters of max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.dtype not in (*PACKED_DTYPES, *_DTYPES):
            raise InvalidRequestError(f"dtype must be one of {', '.join((*PACKED_DTYPES, *_DTYPES))}; "
                                      f"got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):
            raise InvalidRequestError(f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; "
                                      f"got {self.kv_cache_dtype!r}")
        for name in ("kv_block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise InvalidRequestError(f"{name} must be at least 1")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise InvalidRequestError("kv_cache_memory_gb must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be at least 2")
        if self.speculative_method not in (None, "draft", "ngram"):
            raise InvalidRequestError("speculative_method must be None, 'draft' or 'ngram'")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise InvalidRequestError("speculative_method='draft' needs speculative_model (a path or packaged name)")
        if self.speculative_method and not 1 <= self.num_speculative_tokens <= 32:
            raise InvalidRequestError("num_speculative_tokens must be between 1 and 32")
        if self.prefix_state_slots is not None and (not _is_int(self.prefix_state_slots) or self.prefix_state_slots < 0):
            raise InvalidRequestError("prefix_state_slots must be a non-negative integer")
        if int(self.tensor_parallel_size) < 1:
            raise InvalidRequestError("tensor_parallel_size must be at least 1")
        if not (_is_int(self.max_loras) and self.max_loras >= 1 and _is_int(self.max_lora_rank) and self.max_lora_rank >= 1):
            raise InvalidRequestError("max_loras and max_lora_rank must be integers of at least 1")
        if self.enable_lora and int(self.tensor_parallel_size) > 1:
            raise InvalidRequestError("enable_lora is not supported with tensor_parallel_size > 1 yet")
        if not self.tensor_parallel_timeout_s > 0:
            raise InvalidRequestError("tensor_parallel_timeout_s must be positive")
        if not (isinstance(self.kv_cache_disk_gb, Real) and math.isfinite(self.kv_cache_disk_gb)
                and self.kv_cache_disk_gb >= 0):
            raise InvalidRequestError("kv_cache_disk_gb must be a finite number >= 0 (0 turns the disk tier off)")
        if not (isinstance(self.kv_cache_sessions_gb, Real) and math.isfinite(self.kv_cache_sessions_gb)
                and self.kv_cache_sessions_gb >= 0):
            raise InvalidRequestError("kv_cache_sessions_gb must be a finite number >= 0 (0 turns saving sessions off)")
        if self.kv_cache_disk_gb and int(self.tensor_parallel_size) > 1:
            raise InvalidRequestError("kv_cache_disk_gb is not supported with tensor_parallel_size > 1 yet")
        if self.kv_cache_disk_gb and not self.enable_prefix_caching:
            raise InvalidRequestError("kv_cache_disk_gb needs enable_prefix_caching (the disk tier is the "
                                      "prefix cache's)")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activation (and KV cache) dtype."""
        return torch.float32 if self.dtype in PACKED_DTYPES else _DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The pages' dtype. `auto`: bfloat16 on the `auto` path (batched decoding reads the KV cache
        more than the weights), the model's dtype on the others (float32: the exact path)."""
        if self.kv_cache_dtype != "auto":
            return KV_CACHE_DTYPES[self.kv_cache_dtype]
        return torch.bfloat16 if self.dtype in PACKED_DTYPES else self.torch_dtype

    @property
    def packed_weights(self) -> bool:
        """`auto` and `packed` on the CPU keep linear weights as GGUF blocks for our kernels
        (wallbreaker.kernels); float weights are made Q8_0 at load."""
        return self.dtype in PACKED_DTYPES and torch.device(self.device).type == "cpu"
