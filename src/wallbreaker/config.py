"""Model configuration: one dataclass that every architecture is described by."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    """What a model *is*, independent of the file it came from.

    Weight layout conventions (shared by every loader): q/k rows in Hugging Face order
    (rotate-half RoPE), Gemma norm weights as the effective multiplier (1 + w of HF).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # linear position interpolation
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
    layer_types: tuple[str, ...] = field(default=())  # per layer: "full" | "sliding"
    rope_local_theta: float | None = None  # RoPE base of sliding layers
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must name every layer")

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, in float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
