"""Each request shape a real client sends gets a 200 (issue 47).

The fixtures (tests/data/client_bodies/*.json) are synthetic: made-up text in the fields and shapes
captured from Claude Code, Codex, opencode, aider, llm, openai-agents, the ollama client and curl
with tests/client_capture.py (the captures themselves hold those programs' prompts and stay out of
the repository). Each names its client, whether it was captured or derived, the route, the
Content-Type it came with (curl -d sends a form type) and its headers. They are posted to an
in-process server on the "Hello!" model with a 4096-token context, so Claude Code's and opencode's
`max_tokens` (64000, 32000) are past the context, as they are on a real local model.

docs/clients.md lists every field of every fixture, with what the server does with it; a test here
keeps the two in step.
"""
from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

import pytest
from client_fields import body_shapes
from server_apps import app_client, make_app

FIXTURES = Path(__file__).parent / "data" / "client_bodies"
DOCS_TABLE = Path(__file__).parent.parent / "docs" / "clients.md"
FIXTURE_NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))
WHAT_WE_DO = {"implemented", "ignored (logged)"}


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def client(hello_model: Path):
    with app_client(make_app(hello_model, max_model_len=4096, max_num_seqs=4)) as c:
        yield c


def stream_errors(text: str) -> list[str]:
    """Error events or error objects in an SSE or NDJSON body (a stream answers 200 before it fails)."""
    errors = []
    for line in text.splitlines():
        if line.startswith("event: error"):
            errors.append(line)
        payload = line.removeprefix("data:").strip()
        if payload.startswith("{"):
            item = json.loads(payload)
            if item.get("error") or item.get("type") in ("error", "response.failed"):
                errors.append(payload)
    return errors


def post_fixture(client, name: str):
    """The fixture's request as its client sent it: its route, headers and Content-Type."""
    fixture = load_fixture(name)
    headers = {**fixture["headers"], "content-type": fixture["content_type"]}
    return client.request(fixture["method"], fixture["path"], content=json.dumps(fixture["body"]).encode(),
                          headers=headers)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_client_body_is_answered_200(client, name: str) -> None:
    fixture = load_fixture(name)
    response = post_fixture(client, name)
    assert response.status_code == 200, f"{fixture['client']} ({fixture['source']}): {response.text[:1000]}"
    assert not stream_errors(response.text), response.text[-2000:]
    if answers_in_text(fixture):
        assert "Hello" in response.text, response.text[-2000:]  # the model's answer came back, not only a 200


def answers_in_text(fixture: dict) -> bool:
    """Whether the model's "Hello!" comes back: not for /api/show, nor where a forced tool call
    constrains what it writes."""
    forced = isinstance(fixture["body"].get("tool_choice"), dict)
    return fixture["path"] != "/api/show" and not forced


def documented_rows() -> list[list[str]]:
    """The rows of docs/clients.md's table (client, endpoint, field, what we do, how), unquoted."""
    rows = []
    for line in DOCS_TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[3] in WHAT_WE_DO:
            rows.append([cells[0], cells[1].strip("`"), cells[2].strip("`"), cells[3], cells[4]])
    return rows


def documented_fields() -> set[tuple[str, str]]:
    return {(row[1], row[2]) for row in documented_rows()}


def field_of(shape: str) -> str:
    """A shape as the docs name it: `max_tokens: int` -> `max_tokens`; `tools[].type=web_search` stays."""
    return re.sub(r": .*$", "", shape)


def test_every_fixture_field_is_in_the_docs_table() -> None:
    documented = documented_fields()
    missing = set()
    for name in FIXTURE_NAMES:
        fixture = load_fixture(name)
        endpoint = fixture["path"].split("?")[0]
        for shape in body_shapes(fixture["body"]):
            if (endpoint, field_of(shape)) not in documented:
                missing.add(f"{endpoint} {field_of(shape)} ({name})")
    assert not missing, "fields not in docs/clients.md:\n" + "\n".join(sorted(missing))


def test_fixtures_are_synthetic_and_small() -> None:
    """No captured prompt text slipped in: each fixture stays small and names where it came from."""
    for name in FIXTURE_NAMES:
        fixture = load_fixture(name)
        assert (FIXTURES / f"{name}.json").stat().st_size < 16_000, name
        assert fixture["source"].startswith(("captured:", "derived:")), name
        assert {"client", "method", "path", "content_type", "headers", "body"} <= set(fixture), name


def test_fields_documented_as_ignored_are_logged_once(client, caplog, monkeypatch) -> None:
    """An ignored field is named in the log at INFO the first time the process meets it in an object of
    its kind, once: each "ignored (logged)" row says under which name ("logged as `name`"), and
    posting every fixture (several carry the same field) logs each name once per kind of object."""
    from wallbreaker.server import ignored

    monkeypatch.setattr(ignored, "_seen", set())  # what earlier tests in this process logged
    with caplog.at_level(logging.INFO, logger="wallbreaker.server"):
        for name in FIXTURE_NAMES:
            post_fixture(client, name)
    once = Counter(m.groups() for r in caplog.records
                   if (m := re.search(r"(\S+): ignoring the field '([^']+)'", r.getMessage())))
    logged = Counter(name for _, name in once)
    expected = {}
    for row in documented_rows():
        if row[3] == "ignored (logged)":
            named = re.search(r"logged as `([^`]+)`", row[4])
            assert named, f"{row[1]} {row[2]}: say under which name it is logged"
            expected[named.group(1)] = f"{row[1]} {row[2]}"
    missing = {name: field for name, field in expected.items() if name not in logged}
    assert not missing, f"documented as ignored (logged) but not logged: {missing}; logged: {dict(logged)}"
    assert all(count == 1 for count in once.values()), once  # once per object that carries it (chat's and Responses' tools)
