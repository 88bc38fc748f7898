"""The server's saved sessions (server/sessions.py): save a conversation's prefix by name, restore it
in a server started afresh, and the next turn reuses it; a session of another model is a 400 that
names the difference; an unknown one a 404; the disk tier's counts in /metrics."""
from __future__ import annotations

from pathlib import Path

import pytest

from server_apps import app_client, assert_openai_error, make_app, metrics_once
from tiny_models import make_tiny_model

PROMPT = [(3 * i + 2) % 200 + 3 for i in range(70)]  # 4 full blocks of 16


@pytest.fixture(scope="module")
def model(tiny_llama) -> Path:
    return tiny_llama.gguf_path


def app_on(model: Path, folder: Path, **options):
    return make_app(model, max_model_len=256, kv_cache_disk_dir=str(folder), **options)


def cached_tokens_of_next_turn(client, prompt: list[int]) -> int:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return client.app.state.server.llm.stats()["prefix_cache_hits"] * 16


def test_save_then_restore_in_a_new_server_serves_the_next_turn_from_the_session(model, tmp_path):
    with app_client(app_on(model, tmp_path)) as client:
        r = client.post("/sessions/chat-7/save", json={"prompt": PROMPT})
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["object"] == "session" and saved["name"] == "chat-7"
        assert (saved["num_tokens"], saved["num_blocks"]) == (64, 4) and saved["bytes"] > 0
    with app_client(app_on(model, tmp_path)) as client:
        r = client.post("/sessions/chat-7/restore", json={})
        assert r.status_code == 200, r.text
        assert r.json()["num_tokens"] == 64
        assert cached_tokens_of_next_turn(client, PROMPT + [5, 6, 7]) == 64


def test_messages_are_saved_as_the_chat_template_renders_them(model, tmp_path):
    messages = [{"role": "system", "content": "Be brief. " * 12}, {"role": "user", "content": "Hello there"}]
    with app_client(app_on(model, tmp_path)) as client:
        r = client.post("/sessions/talk/save", json={"messages": messages})
        assert r.status_code == 200, r.text
        saved = r.json()["num_tokens"]
    with app_client(app_on(model, tmp_path)) as client:
        assert client.post("/sessions/talk/restore", json={}).status_code == 200
        r = client.post("/v1/chat/completions", json={"messages": messages + [
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert client.app.state.server.llm.stats()["prefix_cache_hits"] * 16 == saved


def test_restoring_into_another_model_is_a_400_naming_the_mismatch(model, tmp_path):
    with app_client(app_on(model, tmp_path)) as client:
        assert client.post("/sessions/s/save", json={"prompt": PROMPT}).status_code == 200
    other = make_tiny_model("llama", tmp_path / "other", seed=1).gguf_path
    with app_client(app_on(other, tmp_path)) as client:
        error = assert_openai_error(client.post("/sessions/s/restore", json={}), 400, param="name")
        assert "model" in error["message"] and "cannot be restored" in error["message"]
    with app_client(app_on(model, tmp_path, kv_cache_dtype="int8")) as client:
        error = assert_openai_error(client.post("/sessions/s/restore", json={}), 400, param="name")
        assert "kv_cache_dtype" in error["message"]


def test_bad_names_unknown_sessions_and_bad_bodies(model, tmp_path):
    with app_client(app_on(model, tmp_path)) as client:
        assert_openai_error(client.post("/sessions/nothing/restore", json={}), 404, param="name")
        assert_openai_error(client.post("/sessions/.hidden/save", json={"prompt": PROMPT}), 400, param="name")
        assert_openai_error(client.post("/sessions/s/save", json={}), 400, param="prompt")
        assert_openai_error(client.post("/sessions/s/save", json={"prompt": PROMPT, "messages": []}), 400)
        assert_openai_error(client.post("/sessions/s/save", json={"prompt": [1, 2]}), 400, param="prompt")
        assert client.post("/sessions/s/save", json={"prompt": PROMPT}).status_code == 200
        assert client.delete("/sessions/s").status_code == 200
        assert_openai_error(client.delete("/sessions/s"), 404)
        assert client.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2}).status_code == 200


def test_metrics_count_disk_hits_and_bytes(model, tmp_path):
    with app_client(app_on(model, tmp_path, kv_cache_disk_gb=0.1)) as client:
        assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        client.app.state.server.llm.kv_disk.flush()
    with app_client(app_on(model, tmp_path, kv_cache_disk_gb=0.1)) as client:
        assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        text = metrics_once(client, "wallbreaker_kv_disk_hits_total 4.0")
        assert "wallbreaker_kv_disk_hits_total 4.0" in text
        assert "wallbreaker_kv_disk_bad_entries_total 0.0" in text
        read = [line for line in text.splitlines() if line.startswith("wallbreaker_kv_disk_read_bytes_total")]
        assert read and float(read[0].split()[1]) > 0


def test_a_save_past_the_sessions_quota_is_a_400_and_the_server_goes_on(model, tmp_path):
    with app_client(app_on(model, tmp_path, kv_cache_sessions_gb=1e-6)) as client:  # 1 KiB: not one session
        assert_openai_error(client.post("/sessions/big/save", json={"prompt": PROMPT}), 400, param="name")
        assert not (tmp_path / "sessions" / "big.kvs").exists()
        assert client.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2}).status_code == 200
