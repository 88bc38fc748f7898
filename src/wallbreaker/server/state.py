"""What every handler of one server shares: the model, the engine loop, metrics and settings."""
from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from ..engine.client import Grammar, GrammarError
from ..llm import LLM
from ..sampling_params import StructuredOutputsParams
from .access_log import AccessRecord
from .async_engine import AsyncEngine
from .config import ServerConfig
from .errors import bad_request
from .logprobs import TokenStrings
from .metrics import ServerMetrics

GRAMMAR_THREADS = 2  # compilations at once, off the engine thread


@dataclass
class ServerState:
    llm: LLM
    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    config: ServerConfig = field(default_factory=ServerConfig)
    strings: TokenStrings = field(init=False)
    max_prompt_chars: int = field(init=False)
    grammar_pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.strings = TokenStrings(self.llm.tokenizer)
        self.grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="wallbreaker-grammar")
        # No token stands for more characters than the longest one's bytes, so a longer text cannot
        # fit the context: refused before the tokenizer spends time on it. (Twice that: a normalizer
        # may compose characters, e.g. NFC's e + U+0301 into é.)
        self.max_prompt_chars = 2 * (self.llm.max_model_len - 1) * self.strings.longest_token_bytes()

    @property
    def request_timeout(self) -> float | None:
        return self.config.request_timeout

    def admit(self, request: Request, prefix: str) -> tuple[AccessRecord, str, float | None]:
        """A request starts: its access record, named by a fresh id (`prefix`-...), and its deadline.
        The state is the model's that the request named (server/router.py: with one model served, any
        name means it, as llama-server's does: clients send the names they were made for, Claude Code's
        `claude-opus-...`); answers name the model that wrote them."""
        access: AccessRecord = request.state.access
        access.request_id = f"{prefix}-{uuid.uuid4().hex}"
        return access, access.request_id, self.deadline()

    def deadline(self) -> float | None:
        """When a request arriving now times out, on the event loop's clock (for `asyncio.timeout_at`)."""
        if self.request_timeout is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout

    async def compile_grammar(self, spec: StructuredOutputsParams | None, param: str | None) -> Grammar | None:
        """The grammar of a request's constraint, compiled in a worker thread (never the engine's),
        within `grammar_compile_timeout`: a 400 naming `param` if it is invalid or takes longer.
        A compilation past the limit still finishes in its thread (llguidance bounds its work)."""
        if spec is None:
            return None
        client = self.engine.client
        grammar = client.cached_grammar(spec)
        if grammar is not None:
            return grammar
        limit = self.config.grammar_compile_timeout
        future = asyncio.get_running_loop().run_in_executor(self.grammar_pool, client.compile_grammar, spec)
        try:
            return await asyncio.wait_for(future, limit)
        except TimeoutError:
            raise bad_request(f"{param}: the constraint took longer than {limit:g} s to compile (this server's "
                              "limit); simplify it", param=param) from None
        except GrammarError as e:
            raise bad_request(f"{param}: {e}", param=param) from None
