"""Where the real clients (Claude Code, Codex, opencode, aider, llm, openai-agents) are installed, and how.

They stay out of wallbreaker's venv (aider pins many packages): `.ci/run` installs the npm ones with
`npm install --prefix $WALLBREAKER_CLIENTS_DIR/npm` and each PyPI one in its own venv,
`$WALLBREAKER_CLIENTS_DIR/venvs/<name>`. The folder defaults to ~/.cache/wallbreaker-clients; a
client found on PATH is used too. A test whose client is absent skips with the command that
installs it.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


def clients_dir() -> Path:
    return Path(os.environ.get("WALLBREAKER_CLIENTS_DIR", Path.home() / ".cache" / "wallbreaker-clients"))


@dataclass(frozen=True)
class Client:
    name: str  # the executable (for openai-agents: the venv's python)
    package: str
    registry: str  # "npm" | "pypi"
    venv: str = ""  # the venv's folder name under venvs/ (PyPI clients)
    module: str = ""  # for a library run by the venv's python: the package it must hold

    @property
    def install_command(self) -> str:
        d = clients_dir()
        if self.registry == "npm":
            return f"npm install --prefix {d / 'npm'} {self.package}"
        v = d / "venvs" / self.venv
        return f"python3 -m venv {v} && {v}/bin/pip install {self.package}"

    def find(self) -> str | None:
        """The client's executable, or None."""
        d = clients_dir()
        if self.registry == "npm":
            local = d / "npm" / "node_modules" / ".bin" / self.name
        else:
            local = d / "venvs" / self.venv / "bin" / self.name
        if self.name == "python" and not any(local.parent.parent.glob(f"lib/python*/site-packages/{self.module}")):
            return None  # the venv is there but the package did not install
        if local.exists() and os.access(local, os.X_OK):
            return str(local)
        return None if self.name == "python" else shutil.which(self.name)


CLAUDE = Client("claude", "@anthropic-ai/claude-code", "npm")
CODEX = Client("codex", "@openai/codex", "npm")
OPENCODE = Client("opencode", "opencode-ai", "npm")
AIDER = Client("aider", "aider-chat", "pypi", "aider")
LLM = Client("llm", "llm", "pypi", "llm")
OPENAI_AGENTS = Client("python", "openai-agents", "pypi", "agents", "agents")
