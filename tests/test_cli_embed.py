"""`wallbreaker embed`: embeddings (or a reranking) of texts as JSON lines, errors as one line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from wallbreaker import LLM


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wallbreaker.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_embed_prints_one_json_line_a_text(tiny_bert_embedding):
    texts = ["the cat sat", "paris is a city"]
    result = run("embed", "--model", str(tiny_bert_embedding), "--dtype", "float32", *texts)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    expected = LLM(tiny_bert_embedding, dtype="float32").embed(texts)
    assert [line["text"] for line in lines] == texts
    for line, vector in zip(lines, expected):
        assert line["embedding"] == pytest.approx(vector, abs=1e-6)


def test_embed_reads_stdin_and_reranks_with_a_query(tiny_bert_cross_encoder):
    docs = ["the dog ran fast", "paris is a city on a river", "banana fruit"]
    result = run("embed", "--model", str(tiny_bert_cross_encoder), "--dtype", "float32", "--query", "the cat", "-",
                 stdin="\n".join(docs) + "\n")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    expected = LLM(tiny_bert_cross_encoder, dtype="float32").rerank("the cat", docs)
    assert [line["index"] for line in lines] == [r["index"] for r in expected]


def test_embed_errors_are_one_line(tiny_bert_embedding, tiny_qwen3):
    too_long = run("embed", "--model", str(tiny_bert_embedding), "word " * 100)
    assert too_long.returncode == 1 and "limit of 64 tokens" in too_long.stderr
    assert len(too_long.stderr.strip().splitlines()) == 1
    generator = run("embed", "--model", str(tiny_qwen3.hf_dir), "hello")
    assert generator.returncode == 1 and "cannot pool" in generator.stderr
