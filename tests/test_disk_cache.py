"""The prefix cache's disk tier (kv/disk_cache.py): a new engine on the same folder reads a prompt's
blocks instead of computing them, with the same logits bit for bit; whatever is wrong with a file
(truncated, flipped, another model's, another page dtype's), a full disk, a tiny quota or another
process sharing the folder, the tokens stay right and the bad entries are counted; salts isolate."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tiny_models import make_tiny_model
from wallbreaker import LLM, SamplingParams
from wallbreaker.kv import disk_cache
from wallbreaker.kv.block_manager import BlockManager

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 16
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(150)]  # 9 full blocks; the 10th holds the last token
NUM_BLOCKS = (len(PROMPT) - 1) // BS


@pytest.fixture(scope="module")
def model(tiny_llama) -> Path:
    return tiny_llama.gguf_path


def make_llm(model: Path, folder: Path, **kw) -> LLM:
    kw.setdefault("kv_cache_disk_gb", 1.0)
    return LLM(model, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, kv_block_size=BS,
               kv_cache_disk_dir=str(folder), **kw)


def run(llm: LLM, prompt=PROMPT, salt: str | None = None) -> tuple[list[int], torch.Tensor, dict]:
    """Greedy tokens, the logits of the first sampled position, and the request's metrics."""
    captured = []
    runner = llm.engine.runner
    plain = runner.run_step  # what the engine's step calls

    def spy(batch, all_logits=False):
        seqs, logits, pooled = plain(batch, all_logits)
        if seqs and not captured:
            captured.append(logits[0].clone())
        return seqs, logits, pooled
    runner.run_step = spy
    try:
        request = {"prompt_token_ids": list(prompt)} | ({"cache_salt": salt} if salt is not None else {})
        out = llm.generate(request, GREEDY)[0]
    finally:
        runner.run_step = plain
    return out.outputs[0].token_ids, captured[0], out.metrics


def written(llm: LLM) -> LLM:
    llm.shutdown()  # flushes the writer, as the end of the process does
    return llm


def disk(llm: LLM) -> dict:
    return {k.removeprefix("kv_disk_"): v for k, v in llm.stats().items() if k.startswith("kv_disk_")}


def block_files(folder: Path) -> list[Path]:
    return sorted((folder / "blocks").glob("*.kvb"))


@pytest.fixture(scope="module")
def cold(model, tmp_path_factory) -> tuple[list[int], torch.Tensor]:
    """The reference: the prompt computed by an engine without any cache."""
    llm = LLM(model, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, kv_block_size=BS,
              enable_prefix_caching=False)
    tokens, logits, _ = run(llm)
    return tokens, logits


def test_a_new_engine_reads_the_prefix_from_disk_and_its_logits_are_bit_identical(model, tmp_path, cold):
    first = make_llm(model, tmp_path)
    tokens, logits, metrics = run(first)
    assert metrics["num_cached_prompt_tokens"] == 0
    assert (tokens, logits.tolist()) == (cold[0], cold[1].tolist())
    _, ram_logits, _ = run(first)  # warm from RAM, in the same engine
    assert disk(written(first))["blocks_written"] >= NUM_BLOCKS
    second = make_llm(model, tmp_path)
    warm_tokens, warm_logits, warm_metrics = run(second)
    assert warm_metrics["num_cached_prompt_tokens"] == NUM_BLOCKS * BS
    assert disk(second)["hits"] == NUM_BLOCKS and disk(second)["bad"] == 0
    assert disk(second)["bytes_read"] >= NUM_BLOCKS * second.kv_cache.block_nbytes
    assert warm_tokens == cold[0]
    assert torch.equal(warm_logits, ram_logits)  # the pages read back are the pages computed
    # A reused prefix, from RAM or disk, computes the tail alone (the paged kernel, not one prefill
    # over the whole prompt): the same K/V, the sums in another order.
    torch.testing.assert_close(warm_logits, cold[1], rtol=0, atol=1e-4)


def test_a_longer_prompt_reads_the_shared_prefix_and_computes_the_rest(model, tmp_path):
    written(make_llm(model, tmp_path)).generate({"prompt_token_ids": PROMPT}, GREEDY)
    longer = PROMPT + [11, 12, 13] * 20
    reference = LLM(model, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, kv_block_size=BS,
                    enable_prefix_caching=False)
    second = make_llm(model, tmp_path)
    tokens, _, metrics = run(second, longer)
    assert metrics["num_cached_prompt_tokens"] >= NUM_BLOCKS * BS
    assert tokens == run(reference, longer)[0]


def test_the_tier_is_off_by_default_and_writes_nothing(model, tmp_path, monkeypatch):
    monkeypatch.setenv("WALLBREAKER_CACHE", str(tmp_path))
    llm = LLM(model, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)
    llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
    llm.shutdown()
    assert llm.kv_disk is None and not (tmp_path / "kv").exists()
    assert disk(llm) == {k: 0 for k in disk(llm)}


def _flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20:40] = b"\xff" * 20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip_a_payload_byte, _truncate, _garbage_header, lambda p: p.write_bytes(b"")],
                         ids=["flipped byte", "truncated", "garbage header", "empty"])
def test_a_damaged_file_is_counted_and_its_block_recomputed(model, tmp_path, cold, damage):
    written(make_llm(model, tmp_path)).generate({"prompt_token_ids": PROMPT}, GREEDY)
    files = block_files(tmp_path)
    for path in files:
        damage(path)
    second = make_llm(model, tmp_path)
    tokens, logits, metrics = run(second)
    assert tokens == cold[0] and torch.equal(logits, cold[1])
    assert metrics["num_cached_prompt_tokens"] == 0
    stats = disk(written(second))
    assert stats["bad"] == 1 and stats["hits"] == 0  # the chain stops at the first bad block
    third = make_llm(model, tmp_path)  # the bad file was replaced by the recomputed block
    assert run(third)[0] == cold[0] and disk(third)["hits"] == NUM_BLOCKS and disk(third)["bad"] == 0


def _copy_under_our_names(theirs: LLM, ours: LLM) -> int:
    """Each of `theirs`' block files put where `ours` looks for the block of the same key."""
    bm: BlockManager = ours.engine.scheduler.block_manager
    copied = 0
    for block_hash, _ in bm.prompt_blocks(PROMPT, None):
        source = theirs.kv_disk.path(block_hash)
        if source.exists():
            ours.kv_disk.path(block_hash).write_bytes(source.read_bytes())
            copied += 1
    return copied


@pytest.mark.parametrize("other", ["model", "kv_cache_dtype"])
def test_a_file_from_another_model_or_kv_dtype_is_refused(model, tmp_path, cold, other):
    if other == "model":
        other_model = make_tiny_model("llama", tmp_path / "other", seed=1).gguf_path
        theirs = written(make_llm(other_model, tmp_path / "theirs"))
    else:
        theirs = written(make_llm(model, tmp_path / "theirs", kv_cache_dtype="bfloat16"))
    theirs.generate({"prompt_token_ids": PROMPT}, GREEDY)
    theirs.shutdown()
    ours = make_llm(model, tmp_path / "ours")
    assert _copy_under_our_names(theirs, ours) == NUM_BLOCKS
    tokens, logits, metrics = run(ours)
    assert tokens == cold[0] and torch.equal(logits, cold[1])
    assert metrics["num_cached_prompt_tokens"] == 0 and disk(ours)["bad"] == 1 and disk(ours)["hits"] == 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bfloat16"])
def test_quantized_pages_are_stored_as_they_are(model, tmp_path, kv_dtype):
    first = make_llm(model, tmp_path, kv_cache_dtype=kv_dtype)
    tokens, _, _ = run(first)
    _, ram_logits, _ = run(first)
    written(first)
    second = make_llm(model, tmp_path, kv_cache_dtype=kv_dtype)
    warm_tokens, warm_logits, metrics = run(second)
    assert metrics["num_cached_prompt_tokens"] == NUM_BLOCKS * BS
    assert warm_tokens == tokens and torch.equal(warm_logits, ram_logits)


def test_a_salt_never_reads_blocks_written_under_another(model, tmp_path):
    written(make_llm(model, tmp_path)).generate({"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}, GREEDY)
    other = make_llm(model, tmp_path)
    for salt in ("tenant-b", None):
        _, _, metrics = run(other, salt=salt)
        assert metrics["num_cached_prompt_tokens"] == 0
    assert disk(other)["hits"] == 0
    same = make_llm(model, tmp_path)
    assert run(same, salt="tenant-a")[2]["num_cached_prompt_tokens"] == NUM_BLOCKS * BS


def test_a_quota_smaller_than_a_block_writes_nothing(model, tmp_path, cold):
    llm = make_llm(model, tmp_path, kv_cache_disk_gb=1e-9)
    assert run(llm)[0] == cold[0]
    stats = disk(written(llm))
    assert stats["blocks_written"] == 0 and stats["writes_dropped"] >= NUM_BLOCKS and not block_files(tmp_path)


def test_the_folder_stays_within_its_quota_least_recently_used_first(model, tmp_path, cold):
    probe = make_llm(model, tmp_path / "probe")
    quota_blocks = 4
    gb = quota_blocks * (probe.kv_cache.block_nbytes + 4096) / 2**30
    llm = make_llm(model, tmp_path / "small", kv_cache_disk_gb=gb)
    assert run(llm)[0] == cold[0]
    stats = disk(written(llm))
    assert stats["evicted"] > 0
    assert sum(p.stat().st_size for p in block_files(tmp_path / "small")) <= gb * 2**30
    again = make_llm(model, tmp_path / "small", kv_cache_disk_gb=gb)
    assert run(again)[0] == cold[0]  # its first blocks were evicted: a miss, then computed


def test_a_full_disk_is_counted_and_costs_nothing_else(model, tmp_path, cold, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk_cache, "write_atomic", full)
    llm = make_llm(model, tmp_path)
    assert run(llm)[0] == cold[0]
    stats = disk(written(llm))
    assert stats["write_errors"] >= NUM_BLOCKS and stats["blocks_written"] == 0
    assert run(llm)[0] == cold[0]  # from RAM, as without the tier


SHARER = textwrap.dedent("""
    import json, sys
    from wallbreaker import LLM, SamplingParams
    model, folder, gb, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model, dtype="float32", kv_cache_memory_gb=0.004, max_model_len=512, kv_block_size=16,
              kv_cache_disk_dir=folder, kv_cache_disk_gb=gb)
    prompts = json.loads(sys.stdin.read())
    out = []
    for i in range(len(prompts)):
        p = prompts[(i + seed) % len(prompts)]
        out.append(llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids)
    llm.shutdown()
    print(json.dumps({"tokens": out, "stats": {k: v for k, v in llm.stats().items() if k.startswith("kv_disk")}}))
""")


def test_two_processes_sharing_one_folder_never_give_a_wrong_token(model, tmp_path):
    prompts = [PROMPT[:100 + 20 * i] + [i + 3] * 5 for i in range(5)]
    reference = LLM(model, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, kv_block_size=BS,
                    enable_prefix_caching=False)
    expected = [reference.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=4,
                                                                           ignore_eos=True))[0].outputs[0].token_ids
                for p in prompts]
    gb = 12 * (reference.kv_cache.block_nbytes + 4096) / 2**30  # a quota that makes them evict each other's files
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    for _ in range(2):  # the second round starts on the folder the first left
        procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(model), str(tmp_path), str(gb), str(seed)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for seed in (0, 2)]
        results = [p.communicate(json.dumps(prompts), timeout=300) for p in procs]
        for (out, err), proc, seed in zip(results, procs, (0, 2)):
            assert proc.returncode == 0, err
            got = json.loads(out.strip().splitlines()[-1])
            assert got["tokens"] == [expected[(i + seed) % len(prompts)] for i in range(len(prompts))]
    assert got["stats"]["kv_disk_hits"] > 0


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_disk_gb": -1}, ">= 0"), ({"kv_cache_disk_gb": float("nan")}, ">= 0"),
    ({"kv_cache_disk_gb": "4"}, ">= 0"),
    ({"kv_cache_disk_gb": 1, "tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"kv_cache_disk_gb": 1, "enable_prefix_caching": False}, "enable_prefix_caching")])
def test_options_are_checked(options, message):
    from wallbreaker import EngineConfig, InvalidRequestError
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(**options)


def test_queued_writes_are_finished_when_the_process_ends_without_shutdown(model, tmp_path):
    script = textwrap.dedent("""
        import sys
        from wallbreaker import LLM, SamplingParams
        llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512,
                  kv_cache_disk_dir=sys.argv[2], kv_cache_disk_gb=1)
        llm.generate({"prompt_token_ids": list(range(3, 150))}, SamplingParams(max_tokens=1))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, str(model), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(block_files(tmp_path)) == (150 - 3) // BS
