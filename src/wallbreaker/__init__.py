"""wallbreaker: an LLM inference engine on PyTorch.

    from wallbreaker import LLM, SamplingParams
    llm = LLM()                      # the embedded default, SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
"""
from .config import EngineConfig
from .engine.outputs import CompletionOutput, RequestOutput
from .errors import (EngineError, InvalidRequestError, ModelFormatError, ModelNotFoundError,
                     UnsupportedModelError, WallbreakerError)
from .llm import LLM
from .lora import LoRARequest
from .sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "WallbreakerError",
           "ModelNotFoundError", "ModelFormatError", "UnsupportedModelError", "InvalidRequestError",
           "EngineError", "LoRARequest"]
