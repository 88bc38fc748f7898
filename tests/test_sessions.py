"""Saved sessions (kv/sessions.py): `LLM.save_prefix` / `load_prefix` put a prompt's cached blocks
back into another engine's prefix cache, with the same tokens as a cold run; a session from another
model or page dtype is refused naming the difference; names are file names, never paths."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiny_models import make_tiny_model
from wallbreaker import LLM, InvalidRequestError, SamplingParams
from wallbreaker.engine.client import SessionNotFoundError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 16
PROMPT = [(5 * i + 1) % 200 + 3 for i in range(100)]  # 6 full blocks and 4 tokens
QUESTION = [9, 8, 7, 6, 5]


@pytest.fixture(scope="module")
def model(tiny_llama) -> Path:
    return tiny_llama.gguf_path


def make_llm(model: Path, folder: Path, **kw) -> LLM:
    return LLM(model, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, kv_block_size=BS,
               kv_cache_disk_dir=str(folder), **kw)


def tokens(llm: LLM, prompt: list[int] | dict) -> tuple[list[int], int]:
    request = prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}
    out = llm.generate(request, GREEDY)[0]
    return out.outputs[0].token_ids, out.metrics["num_cached_prompt_tokens"]


def test_a_saved_prefix_restored_in_another_engine_serves_the_next_turn(model, tmp_path):
    saver = make_llm(model, tmp_path)
    info = saver.save_prefix({"prompt_token_ids": PROMPT}, "chat-1")
    assert (info.name, info.num_tokens, info.num_blocks) == ("chat-1", 96, 6)
    assert (tmp_path / "sessions" / "chat-1.kvs").stat().st_size == info.nbytes
    cold, cached = tokens(make_llm(model, tmp_path / "elsewhere"), PROMPT + QUESTION)
    assert cached == 0
    restorer = make_llm(model, tmp_path)
    assert restorer.kv_disk is None  # sessions need no disk tier
    assert restorer.load_prefix("chat-1").num_tokens == 96
    warm, cached = tokens(restorer, PROMPT + QUESTION)
    assert cached == 96 and warm == cold


def test_a_conversation_is_saved_through_the_chat_template(model, tmp_path):
    messages = [{"role": "system", "content": "You answer in one word. " * 8},
                {"role": "user", "content": "What is the colour of the sky on a clear day?"}]
    saver = make_llm(model, tmp_path)
    info = saver.save_prefix(messages, "conversation")
    restorer = make_llm(model, tmp_path)
    restorer.load_prefix("conversation")
    out = restorer.chat(messages + [{"role": "assistant", "content": "Blue."},
                                    {"role": "user", "content": "And at night?"}], GREEDY)[0]
    assert info.num_tokens >= BS and out.metrics["num_cached_prompt_tokens"] == info.num_tokens


def test_a_restored_session_keeps_its_salt(model, tmp_path):
    make_llm(model, tmp_path).save_prefix({"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}, "salted")
    restorer = make_llm(model, tmp_path)
    restorer.load_prefix("salted")
    assert tokens(restorer, {"prompt_token_ids": PROMPT + QUESTION, "cache_salt": "tenant-b"})[1] == 0
    assert tokens(restorer, PROMPT + QUESTION)[1] == 0
    assert tokens(restorer, {"prompt_token_ids": PROMPT + QUESTION, "cache_salt": "tenant-a"})[1] == 96


@pytest.mark.parametrize("other", ["kv_cache_dtype", "model", "kv_block_size"])
def test_a_session_from_another_engine_is_refused_naming_the_difference(model, tmp_path, other):
    make_llm(model, tmp_path).save_prefix(PROMPT, "mine")
    if other == "kv_cache_dtype":
        restorer = make_llm(model, tmp_path, kv_cache_dtype="int8")
    elif other == "model":
        restorer = make_llm(make_tiny_model("llama", tmp_path / "other", seed=1).gguf_path, tmp_path)
    else:
        restorer = LLM(model, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, kv_block_size=8,
                       kv_cache_disk_dir=str(tmp_path))
    field = {"kv_block_size": "block_size"}.get(other, other)
    with pytest.raises(InvalidRequestError, match=f"written with {field} "):
        restorer.load_prefix("mine")
    assert tokens(restorer, PROMPT)[1] == 0


def test_a_damaged_session_is_refused(model, tmp_path):
    make_llm(model, tmp_path).save_prefix(PROMPT, "s")
    path = tmp_path / "sessions" / "s.kvs"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidRequestError, match="checksum"):
        make_llm(model, tmp_path).load_prefix("s")


@pytest.mark.parametrize("name", ["../escape", "", ".hidden", "a/b", "x" * 200])
def test_a_name_is_a_file_name_never_a_path(model, tmp_path, name):
    llm = make_llm(model, tmp_path)
    with pytest.raises(InvalidRequestError, match="session name"):
        llm.load_prefix(name)
    with pytest.raises(InvalidRequestError, match="session name"):
        llm.engine.save_session(name, PROMPT)
    assert not (tmp_path / "escape.kvs").exists()


def test_an_unknown_session_and_a_too_short_prompt(model, tmp_path):
    llm = make_llm(model, tmp_path)
    with pytest.raises(SessionNotFoundError):
        llm.load_prefix("never-saved")
    with pytest.raises(InvalidRequestError, match="one full block"):
        llm.save_prefix([5, 6, 7], "short")


def test_the_sessions_folder_has_a_quota_and_nothing_is_evicted_to_meet_it(model, tmp_path):
    one = make_llm(model, tmp_path / "sizing").save_prefix(PROMPT, "sizing").nbytes
    llm = make_llm(model, tmp_path, kv_cache_sessions_gb=1.2 * one / 2**30)  # room for one session, not 1 + 1/3
    llm.save_prefix(PROMPT, "first")
    with pytest.raises(InvalidRequestError, match="kv_cache_sessions_gb") as refused:
        llm.save_prefix(PROMPT[:40], "second")
    assert "1 files" in str(refused.value) and not (tmp_path / "sessions" / "second.kvs").exists()
    assert llm.load_prefix("first").num_tokens == 96  # kept whole
    saved = llm.save_prefix(PROMPT, "first")  # replacing a session counts only the new one
    assert llm.delete_prefix("first").nbytes == saved.nbytes
    assert llm.save_prefix(PROMPT[:40], "second").num_blocks == 2
    with pytest.raises(SessionNotFoundError):
        llm.delete_prefix("first")


def test_a_quota_of_zero_turns_saving_off(model, tmp_path):
    llm = make_llm(model, tmp_path, kv_cache_sessions_gb=0)
    with pytest.raises(InvalidRequestError, match="off"):
        llm.save_prefix(PROMPT, "any")
    with pytest.raises(InvalidRequestError, match="kv_cache_sessions_gb"):
        make_llm(model, tmp_path, kv_cache_sessions_gb=-1)
