"""LoRA adapters: read from PEFT folders and GGUF files (adapter.py), bound into a model's linear
layers by slot (registry.py) and applied beside their matmuls (layers/lora.py)."""
from .request import LoRARequest

__all__ = ["LoRARequest"]
