"""The one door to the engine, for `LLM` and the server (vLLM's `EngineClient`): requests in, a step
at a time, outputs out, stats, and the facts a request is checked against. Nothing above the engine
reads its insides; `server/` imports from `engine/` only this module (tests/test_layering.py).

`LLMEngine` is the one implementation. It is not thread-safe: one thread steps it. `check_prompt`,
`check_token_ids`, `cached_grammar` and `compile_grammar` read only what is fixed at construction, so a server's
handlers may call them from any thread before a request reaches the engine's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..kv.sessions import SessionInfo, SessionNotFoundError, check_session_name
from ..config import PoolingConfig
from ..lora.request import LoRARequest
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .outputs import CompletionOutput, RequestOutput, StepFailure, StreamDelta
from .structured_output import Grammar, GrammarError

__all__ = ["CompletionOutput", "EngineClient", "EngineRequest", "Grammar", "GrammarError", "RequestOutput",
           "SessionInfo", "SessionNotFoundError", "StepFailure", "StepResult", "StreamDelta", "check_session_name"]


@dataclass
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, where the prompt was one
    request_id: str | None = None  # None: the engine names it
    cache_salt: str | None = None  # shares prefix-cache blocks only with requests of the same salt
    grammar: Grammar | None = None  # `params.structured_outputs` compiled already (off the engine thread)
    pooling: PoolingParams | None = None  # set: a pooling request (an embedding, a score), run once, nothing generated
    # computed to be saved as a session (the prefix of longer prompts to come): its prompt takes the
    # prefill path however short (batch-invariant mode, layers/linear.py SHORT_PROMPT)
    saved_prefix: bool = False
    images: tuple = ()  # vision.inputs.ImageInput of each image, by the positions of its soft tokens
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)


@dataclass
class StepResult:
    deltas: list[StreamDelta]  # each sequence's new output in this step, for streaming
    finished: list[RequestOutput]  # requests whose every sequence has ended; the engine forgets them


class EngineClient(Protocol):
    max_model_len: int  # tokens one sequence may reach, prompt included

    def add_request(self, request: EngineRequest) -> str:
        """Queue a request; its id. `InvalidRequestError` for one the engine must not run."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request now and forget it (no output comes for it); unknown ids are ignored."""
        ...

    def step(self) -> StepResult: ...
    def has_unfinished(self) -> bool: ...

    def check_prompt(self, token_ids: list[int], max_tokens: int | None = None) -> None:
        """`InvalidRequestError` for a prompt that is empty, past the context or outside the vocabulary."""
        ...

    def check_token_ids(self, token_ids: list[int]) -> None:
        """`InvalidRequestError` for an id outside the vocabulary a step can produce."""
        ...

    def cached_grammar(self, spec: StructuredOutputsParams) -> Grammar | None: ...
    def compile_grammar(self, spec: StructuredOutputsParams) -> Grammar: ...
    def check_pooling(self, task: str) -> None: ...
    def check_pooling_prompt(self, token_ids: list[int]) -> None: ...
    @property
    def pooling_config(self) -> PoolingConfig | None: ...
    def live_stats(self) -> dict: ...
    def stats(self) -> dict: ...

    def save_session(self, name: str, token_ids: list[int], cache_salt: str | None = None) -> SessionInfo:
        """Save the prefix cache's blocks of `token_ids` (run them first) as session `name`."""
        ...

    def load_session(self, name: str) -> tuple[SessionInfo, list[int]]:
        """Put session `name`'s blocks into the prefix cache. `SessionNotFoundError` for an unknown
        name; `InvalidRequestError` naming the difference for one saved by another model or settings."""
        ...

    def delete_session(self, name: str) -> SessionInfo: ...

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Read and bind an adapter (`InvalidRequestError` for a bad one, or where LoRA is not enabled)."""
        ...

    def unload_lora_adapter(self, name: str) -> None: ...
    def lora_adapters(self) -> list[str]: ...
