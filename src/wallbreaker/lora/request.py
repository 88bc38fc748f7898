"""vLLM's `LoRARequest`: which adapter a request runs with."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` names the adapter (the server's `model`); `lora_int_id` is vLLM's positive id;
    `lora_path` is a PEFT folder or a GGUF LoRA file, read the first time the name is asked for."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("LoRARequest needs a non-empty lora_name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer, "
                                      f"got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))
