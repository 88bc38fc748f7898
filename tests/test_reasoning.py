"""The reasoning split (server/reasoning.py), alone and behind /v1/chat/completions on a tiny model
whose chat template opens a thinking block, as Qwen3's and DeepSeek-R1's do."""
import dataclasses
import json
import random

import pytest
from server_apps import app_client, assert_openai_error, make_app

from wallbreaker.server.reasoning import ReasoningParser

THINK_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")

PARSER = ReasoningParser()


def test_parser_is_chosen_from_the_template():
    assert ReasoningParser.for_template(THINK_TEMPLATE) == PARSER
    assert ReasoningParser.for_template("{{ messages[0]['content'] }}") is None
    assert ReasoningParser.for_template(None) is None


@pytest.mark.parametrize("prompt, output, reasoning, content", [
    ("<|im_start|>assistant\n<think>\n", "plan it</think>\n\nThe answer", "plan it", "\n\nThe answer"),
    ("<|im_start|>assistant\n<think>\n", "still thinking when cut", "still thinking when cut", ""),
    ("<|im_start|>assistant\n", "<think>hmm</think>yes", "hmm", "yes"),
    ("<|im_start|>assistant\n", "\n<think>hmm</think>yes", "hmm", "yes"),
    ("<|im_start|>assistant\n", "no tags at all", "", "no tags at all"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "an answer", "", "an answer"),
    ("<|im_start|>assistant\n", "a < b and <think> later", "", "a < b and <think> later"),
])
def test_split_whole(prompt, output, reasoning, content):
    split = PARSER.split(output, prompt)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("prompt, output", [
    ("assistant\n<think>\n", "plan it</think>\n\nThe answer"),
    ("assistant\n", "<think>hmm, </thin k</think>yes </think> twice"),
    ("assistant\n", "  <thi"),
    ("assistant\n<think>", "cut in the tag </thi"),
])
def test_streamed_split_equals_the_whole_split_however_the_pieces_fall(prompt, output):
    whole = PARSER.split(output, prompt)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(output)), k=min(len(output) - 1, rng.randrange(1, 6))))
        pieces = [output[a:b] for a, b in zip([0] + cuts, cuts + [len(output)])]
        stream = PARSER.stream(prompt)
        parts = [stream.feed(p) for p in pieces] + [stream.finish()]
        assert "".join(p.reasoning for p in parts) == whole.reasoning
        assert "".join(p.content for p in parts) == whole.content


# -- behind the server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def think_client(tiny_qwen3, tmp_path_factory):
    path = tmp_path_factory.mktemp("think") / "think.gguf"
    tiny = dataclasses.replace(tiny_qwen3, chat_template=THINK_TEMPLATE, gguf_path=path)
    tiny.write_gguf(path)
    with app_client(make_app(path, max_model_len=128)) as client:
        yield client


MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
# the tiny model's random weights never close a block by themselves: a grammar makes it think, close
# the block and answer, so that the split has something to find
THINK_THEN_ANSWER = {"regex": "[a-z]{2,6} [a-z]{2,6}</think>\n[a-z]{2,6} [a-z]{2,6}"}


def raw_output(client, body: dict) -> str:
    """The same prompt and constraints through /v1/completions: the output as the model wrote it."""
    ids = client.post("/tokenize", json={"messages": body["messages"],
                                         **({"chat_template_kwargs": body["chat_template_kwargs"]}
                                            if "chat_template_kwargs" in body else {})}).json()["tokens"]
    fields = {k: v for k, v in body.items() if k not in ("messages", "chat_template_kwargs", "stream")}
    r = client.post("/v1/completions", json={"prompt": ids, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def chat_both_ways(client, body: dict) -> list[tuple[str | None, str | None]]:
    """(reasoning_content, content), not streamed and streamed."""
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    whole = (message.get("reasoning_content"), message["content"])
    reasoning, content = [], []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    reasoning.append(choice["delta"].get("reasoning_content") or "")
                    content.append(choice["delta"].get("content") or "")
    return [whole, ("".join(reasoning) or None, "".join(content))]


def test_thinking_arrives_in_reasoning_content_not_in_content(think_client):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 40, "structured_outputs": THINK_THEN_ANSWER}
    raw = raw_output(think_client, body)
    thought, answer = raw.split("</think>")
    assert thought and answer
    for reasoning, content in chat_both_ways(think_client, body):
        assert reasoning == thought
        assert content == answer


def test_a_block_never_closed_is_all_reasoning(think_client):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 6}
    raw = raw_output(think_client, body)
    assert "</think>" not in raw and raw
    for reasoning, content in chat_both_ways(think_client, body):
        assert reasoning == raw
        assert not content


def test_enable_thinking_false_reaches_the_template(think_client):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 6,
            "chat_template_kwargs": {"enable_thinking": False}}
    raw = raw_output(think_client, body)
    for reasoning, content in chat_both_ways(think_client, body):
        assert reasoning is None
        assert content == raw


@pytest.mark.parametrize("kwargs, status", [({"messages": []}, 400), ({"add_generation_prompt": False}, 400),
                                             ("yes", 400), ([1], 400)])
def test_bad_chat_template_kwargs_are_a_400(think_client, kwargs, status):
    r = think_client.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert_openai_error(r, status)


def test_chat_template_kwargs_reach_the_template_from_python(think_client):
    llm = think_client.app.state.server.llm  # LLM.chat renders through encode_chat
    thinking, _ = llm.encode_chat(MESSAGES)
    plain, _ = llm.encode_chat(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    assert thinking.endswith("<think>\n") and plain.endswith("<think>\n\n</think>\n\n")


def test_the_other_apis_carry_the_thinking_apart(think_client):
    """An unclosed block (the template opens it, the random model never closes it) is all reasoning:
    Anthropic's answer is one `thinking` block, Responses' a `reasoning` item, Ollama's `thinking`,
    each holding the chat answer's `reasoning_content`, none of it as text."""
    chat = think_client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0,
                                                           "max_tokens": 8}).json()["choices"][0]["message"]
    assert chat["reasoning_content"] and not chat["content"]
    model = think_client.get("/v1/models").json()["data"][0]["id"]
    r = think_client.post("/v1/messages", json={"model": model, "messages": MESSAGES, "max_tokens": 8,
                                                "temperature": 0})
    assert r.status_code == 200, r.text
    assert [b["type"] for b in r.json()["content"]] == ["thinking"]
    assert r.json()["content"][0]["thinking"] == chat["reasoning_content"]
    r = think_client.post("/v1/responses", json={"model": model, "input": MESSAGES[0]["content"], "max_output_tokens": 8,
                                                 "temperature": 0})
    assert r.status_code == 200, r.text
    reasoning = [item for item in r.json()["output"] if item["type"] == "reasoning"]
    assert len(reasoning) == 1 and chat["reasoning_content"] in json.dumps(reasoning[0], ensure_ascii=False)
    r = think_client.post("/api/chat", json={"model": model, "messages": MESSAGES, "stream": False,
                                             "options": {"temperature": 0, "num_predict": 8}})
    assert r.status_code == 200, r.text
    assert r.json()["message"]["thinking"] == chat["reasoning_content"] and not r.json()["message"]["content"]
