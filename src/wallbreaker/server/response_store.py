"""The Responses API's `store` and `previous_response_id`, from memory: the last responses (their
conversation as chat messages, and the response object), bounded in count and in bytes, the oldest
dropped first. Nothing is written to disk; a restart forgets them all."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 256
MAX_BYTES = 64 * 2**20


@dataclass
class StoredResponse:
    messages: list[dict]  # the conversation up to and including this response's answer, without instructions
    response: dict  # the response object, as GET /v1/responses/{id} returns it
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        size = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere rather than emptying it
        with self._lock:
            self._items[response_id] = StoredResponse(messages, response, size)
            self._bytes += size
            while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is not None:
                self._bytes -= item.size
            return item is not None
