"""The Responses API's memory store: bounded in count and in bytes, the oldest dropped first."""
from __future__ import annotations

from wallbreaker.server.response_store import ResponseStore


def conversation(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_oldest_response_goes_first_past_the_count():
    store = ResponseStore(max_responses=2)
    for name in "abc":
        store.put(name, conversation(name), {"id": name})
    assert store.get("a") is None
    assert store.get("b").messages == conversation("b") and store.get("c").response == {"id": "c"}


def test_the_oldest_responses_go_first_past_the_bytes():
    store = ResponseStore(max_responses=100, max_bytes=300)
    for name in "abcd":
        store.put(name, conversation(name * 80), {"id": name})
    kept = [name for name in "abcd" if store.get(name) is not None]
    assert kept == ["c", "d"]


def test_a_response_larger_than_the_store_is_not_kept_and_empties_nothing():
    store = ResponseStore(max_bytes=200)
    store.put("small", conversation("x"), {"id": "small"})
    store.put("huge", conversation("x" * 1000), {"id": "huge"})
    assert store.get("huge") is None and store.get("small") is not None


def test_delete_frees_its_bytes():
    store = ResponseStore(max_responses=100, max_bytes=300)
    store.put("a", conversation("a" * 80), {"id": "a"})
    assert store.delete("a") and not store.delete("a")
    for name in "bc":
        store.put(name, conversation(name * 80), {"id": name})
    assert store.get("b") is not None and store.get("c") is not None
