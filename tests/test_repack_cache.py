"""kernels/repack_cache.py through a real load: blocks the kernels cannot read from the GGUF's own
mapping are written once to a cache file and mapped from it; later loads map it and write nothing;
a truncated file, one of another layout version, or one made from another model is detected and
rebuilt, never used. Whatever the cache does, the logits are those of weights held in memory."""
from __future__ import annotations

import gc
import json
import os
import time
import struct

import gguf
import pytest
import torch

from wallbreaker import LLM
from wallbreaker.formats.mapping import file_mappings, mapped_file
from wallbreaker.kernels import repack_cache
from wallbreaker.layers.linear import QuantLinear
from wallbreaker.measure.random_model import SHAPES, write_random_gguf

Q8_0 = gguf.GGMLQuantizationType.Q8_0
TEXT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WALLBREAKER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "repack"


def load(path) -> LLM:
    return LLM(path, kv_cache_memory_gb=0.01)


def where_blocks_live(llm: LLM) -> set[str]:
    maps = file_mappings()
    return {mapped_file(b, maps) or "memory" for m in llm.model.modules() if isinstance(m, QuantLinear)
            for b in m.blocks}


def logits_from_memory(path, tmp_dir) -> torch.Tensor:
    """The reference: a cache folder that cannot be created leaves every weight in memory."""
    mp = pytest.MonkeyPatch()
    blocker = tmp_dir / "a-file"
    blocker.write_text("not a folder")
    mp.setenv("WALLBREAKER_CACHE", str(blocker))
    try:
        llm = load(path)
        assert where_blocks_live(llm) == {"memory"}
        return llm.logits(TEXT)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def in_memory_logits(tiny_llama, tmp_path_factory):
    return logits_from_memory(tiny_llama.quantized_gguf(Q8_0), tmp_path_factory.mktemp("nocache"))


def test_blocks_are_mapped_from_the_cache_file_and_a_second_load_writes_nothing(tiny_llama, cache, in_memory_logits):
    llm = load(tiny_llama.quantized_gguf(Q8_0))
    (made,) = cache.glob("*.bin")
    assert where_blocks_live(llm) == {str(made)}  # Q8_0's group order: every block from the cache
    assert torch.equal(llm.logits(TEXT), in_memory_logits)
    stats = llm.stats()
    assert stats["weight_bytes_mapped"] > 0.9 * stats["weight_bytes"]
    before = made.stat()
    again = load(tiny_llama.quantized_gguf(Q8_0))
    after = made.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)  # mapped, not rewritten
    assert where_blocks_live(again) == {str(made)}
    assert torch.equal(again.logits(TEXT), in_memory_logits)


def test_a_model_file_nothing_reads_is_not_kept_mapped(tiny_qwen2, cache):
    """A tied Q8_0 model: every matrix comes from the cache, the embedding from the head's blocks."""
    path = tiny_qwen2.quantized_gguf(Q8_0)
    llm = load(path)
    gc.collect()
    assert str(path) not in {p for *_, p in file_mappings()}
    assert llm.generate(TEXT)[0].outputs[0].token_ids


def rewrite_index(path, change) -> None:
    """Edit a cache file's index, keeping its trailer consistent (a well-formed file that lies)."""
    raw = path.read_bytes()
    at, length, magic = repack_cache.TRAILER.unpack(raw[-repack_cache.TRAILER.size:])
    index = json.loads(raw[at:at + length])
    change(index)
    blob = json.dumps(index).encode()
    path.write_bytes(raw[:at] + blob + repack_cache.TRAILER.pack(at, len(blob), magic))


def truncated(path, other) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def other_layout(path, other) -> None:
    rewrite_index(path, lambda index: index.update(layout=repack_cache.LAYOUT_VERSION + 1))


def other_model(path, other) -> None:
    path.write_bytes(other.read_bytes())  # a valid cache file, made from another GGUF


def entry_out_of_bounds(path, other) -> None:
    def move(index):
        key = next(iter(index["tensors"]))
        index["tensors"][key][0] = 1 << 40
    rewrite_index(path, move)


@pytest.mark.parametrize("damage", [truncated, other_layout, other_model, entry_out_of_bounds])
def test_a_bad_cache_file_is_rebuilt_never_used(tiny_llama, tiny_qwen2, cache, in_memory_logits, damage, caplog):
    load(tiny_qwen2.quantized_gguf(Q8_0))
    (other,) = cache.glob("*.bin")
    load(tiny_llama.quantized_gguf(Q8_0))
    (made,) = set(cache.glob("*.bin")) - {other}
    good = made.read_bytes()
    damage(made, other)
    assert made.read_bytes() != good
    llm = load(tiny_llama.quantized_gguf(Q8_0))
    assert "not usable" in caplog.text
    assert made.read_bytes() == good  # rebuilt: the same bytes as the first build
    assert torch.equal(llm.logits(TEXT), in_memory_logits)


def test_a_changed_model_file_gets_a_cache_of_its_own(tiny_llama, cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_llama.quantized_gguf(Q8_0).read_bytes())
    load(path)
    first = set(cache.glob("*.bin"))
    offset = next(int(t.data_offset) for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    raw = bytearray(path.read_bytes())
    struct.pack_into("<e", raw, offset, 0.5)  # the first block's scale of one weight
    path.write_bytes(bytes(raw))
    changed = load(path)
    assert len(set(cache.glob("*.bin")) - first) == 1
    expected = logits_from_memory(path, tmp_path)
    assert torch.equal(changed.logits(TEXT), expected)
    assert not torch.equal(expected, logits_from_memory(tiny_llama.quantized_gguf(Q8_0), tmp_path))


def test_k_quant_rows_run_from_the_gguf_itself(packaged_model, cache, tmp_path):
    """Q4_K and Q6_K rows are what the kernels read: mapped from the model file. Only llama's q/k
    rows (un-permuted per head) go through the cache."""
    path = write_random_gguf(tmp_path / "k.gguf", SHAPES["tiny-k"], "q4_k_m", packaged_model("smollm2"))
    llm = load(path)
    maps = file_mappings()
    (made,) = cache.glob("*.bin")
    for name, module in llm.model.named_modules():
        if isinstance(module, QuantLinear):
            want = str(made) if name.endswith("attn.qkv") else str(path)
            assert {mapped_file(b, maps) for b in module.blocks[:1]} == {want}, name
    assert llm.stats()["weight_bytes_resident"] < 0.01 * llm.stats()["weight_bytes"]  # norms only
    gc.collect()
    assert str(path) in {p for *_, p in file_mappings()}  # what the kernels read stays mapped


def test_the_folder_keeps_the_most_recently_used_within_its_size_and_age(tiny_llama, cache, monkeypatch, tmp_path):
    copies = []
    for name in "abc":  # the same model three times: three identities, caches of one size
        copies.append(tmp_path / f"{name}.gguf")
        copies[-1].write_bytes(tiny_llama.quantized_gguf(Q8_0).read_bytes())
    load(copies[0])
    (first,) = cache.glob("*.bin")
    stale = cache / ("0" * 40 + ".bin")
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 40 * 86400,) * 2)
    monkeypatch.setattr(repack_cache, "MAX_BYTES", 2 * first.stat().st_size + 1)
    load(copies[1])
    assert not stale.exists() and first.exists()  # unused for 40 days: gone, whatever its size
    os.utime(first, (time.time() - 60,) * 2)
    load(copies[2])
    assert not first.exists() and len(list(cache.glob("*.bin"))) == 2  # the least recently used went
