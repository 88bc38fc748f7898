"""The tool parsers (server/tool_parsers/) on what each format allows beyond the templates' own
renderings (test_tool_formats.py has those): Hermes's fenced and bare JSON for a declared tool,
Qwen3-Coder's typing of values by the schema, harmony's channels split whole and streamed, the
same calls as PyPI `openai-harmony` (gpt-oss's own library) renders and parses; and that the
detokenizer keeps special tokens when asked (the markers of several formats are special tokens)."""
from __future__ import annotations

import json
import os

import pytest
from harmony_vocab import INSTALL as HARMONY_INSTALL, encodings_base
from tool_formats import FAMILIES, TEMPLATES, TOOLS, TWO_CALLS, tool_call

from wallbreaker import LLM, SamplingParams
from wallbreaker.server.harmony import HarmonyReasoning, harmony_split
from wallbreaker.server.reasoning import Split
from wallbreaker.text.chat_template import ChatTemplate
from wallbreaker.server.tool_parsers import DeepSeekParser, HarmonyParser, HermesParser, Qwen3CoderParser
from wallbreaker.server.tools import ToolStream

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def named(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text", [WEATHER, f"```json\n{WEATHER}\n```", f"  ```\n{WEATHER}\n```\n", f"[{WEATHER}]"])
def test_hermes_reads_a_fenced_or_bare_call_of_a_declared_tool(text):
    content, calls = HermesParser(TOOLS).parse(text)
    assert content is None and named(calls) == [("get_weather", {"city": "Paris"})]
    stream = ToolStream(HermesParser(TOOLS))
    assert "".join(stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)) == ""  # held: it may be a call
    assert named(stream.finish()[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", ['{"name": "launch_rockets", "arguments": {}}', f"Here: {WEATHER}",
                                  f"{WEATHER} and more", '{"city": "Paris"}', "```python\nprint(1)\n```"])
def test_hermes_leaves_other_json_as_text(text):
    assert HermesParser(TOOLS).parse(text) == (text, [])
    stream = ToolStream(HermesParser(TOOLS))
    sent = "".join(stream.feed(text[i:i + 4]) for i in range(0, len(text), 4))
    assert sent + stream.finish()[0] == text


def test_hermes_without_tools_reads_only_tagged_calls():
    assert HermesParser().parse(WEATHER) == (WEATHER, [])


def test_qwen3_coder_types_values_by_the_schema_as_qwens_parser_does():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "a": {"type": "array"}, "s": {"type": "string"}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=x>\n2.0\n</parameter>\n"
            "<parameter=b>\nFalse\n</parameter>\n<parameter=o>\n{\"k\": [1]}\n</parameter>\n<parameter=a>\n[1, 'two']\n"
            "</parameter>\n<parameter=s>\n 42 \n</parameter>\n<parameter=extra>\n5\n</parameter>\n"
            "<parameter=n2>\nnull\n</parameter>\n</function>\n</tool_call>")
    (call,) = Qwen3CoderParser(tools).parse(text)[1]
    assert json.loads(call.arguments) == {"n": 7, "x": 2, "b": False, "o": {"k": [1]}, "a": [1, "two"], "s": " 42 ",
                                          "extra": "5", "n2": None}


GPT_OSS_OUTPUT = ("<|channel|>analysis<|message|>The user wants the weather.<|end|>"
                  "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                  '{"city":"Paris"}<|call|>')


def test_harmony_analysis_is_reasoning_and_a_message_to_a_function_a_call():
    split = harmony_split(GPT_OSS_OUTPUT)
    assert split.reasoning == "The user wants the weather."
    assert named(HarmonyParser(TOOLS).parse(split.content)[1]) == [("get_weather", {"city": "Paris"})]
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi there.<|return|>"
    assert harmony_split(final) == Split("Easy.", "Hi there.")
    assert harmony_split("no markers at all") == Split("", "no markers at all")  # special tokens skipped: all answer


@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_harmony_streamed_in_pieces_splits_as_the_whole(size):
    text = GPT_OSS_OUTPUT.replace("<|call|>", "<|call|><|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    stream = HarmonyReasoning().stream()
    parts = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    assert Split("".join(p.reasoning for p in parts), "".join(p.content for p in parts)) == harmony_split(text)


def _harmony_encoding():
    harmony = pytest.importorskip("openai_harmony")
    base = encodings_base()
    if base is None:
        pytest.skip(f"openai-harmony's vocabulary (o200k_base.tiktoken) is not here; make it with: {HARMONY_INSTALL}")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = base
    return harmony, harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def test_harmony_calls_match_openai_harmonys_rendering_and_parsing():
    h, enc = _harmony_encoding()
    messages = [h.Message.from_role_and_content(h.Role.ASSISTANT, "Two lookups.").with_channel("analysis")]
    for name, args in TWO_CALLS:
        call = h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps(args)).with_channel("commentary")
        messages.append(call.with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
    tokens = enc.render_conversation(h.Conversation.from_messages(messages))
    text = enc.decode_utf8(tokens)
    output = text.removeprefix("<|start|>assistant")
    split = harmony_split(output)
    assert split.reasoning == "Two lookups."
    assert named(HarmonyParser(TOOLS).parse(split.content)[1]) == TWO_CALLS
    # and the other way: what gpt-oss's template writes (past the prompt's `<|start|>assistant`), parsed by it
    ours = FAMILIES["gpt-oss"].output(TWO_CALLS) + "<|call|>"
    parsed = enc.parse_messages_from_completion_tokens(enc.encode(ours, allowed_special="all"), h.Role.ASSISTANT,
                                                       strict=False)
    theirs = [(m.recipient.removeprefix("functions."), json.loads(m.content[0].text)) for m in parsed if m.recipient]
    assert theirs == named(HarmonyParser(TOOLS).parse(ours)[1]) == TWO_CALLS


def test_special_tokens_stay_in_the_text_when_not_skipped(tiny_llama):
    llm = LLM(tiny_llama.gguf_path, dtype="float32", max_model_len=64)
    special = llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(special) == 1
    params = dict(max_tokens=2, temperature=0.0, allowed_token_ids=special)
    kept = llm.generate(["Hi"], SamplingParams(**params, skip_special_tokens=False))[0].outputs[0].text
    skipped = llm.generate(["Hi"], SamplingParams(**params))[0].outputs[0].text
    assert kept == "<|im_start|><|im_start|>" and skipped == ""


def test_deepseek_v3_and_r1_calls_as_r1s_template_writes_them():
    """V3 and R1 write `function<｜tool▁sep｜>NAME` and the arguments in a ```json fence (V3.1's form,
    NAME<｜tool▁sep｜>{...}, is in test_tool_formats.py)."""
    template = ChatTemplate((TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text(), "<s>", "</s>")
    calls = [tool_call(name, args, i) for i, (name, args) in enumerate(TWO_CALLS)]
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    rendered = template.render([{"role": "user", "content": "Hi"}, message], add_generation_prompt=False)
    start, end = rendered.index("<｜tool▁calls▁begin｜>"), rendered.index("<｜tool▁calls▁end｜>")
    output = "Let me look both up." + rendered[start:end + len("<｜tool▁calls▁end｜>")]
    assert "function<｜tool▁sep｜>get_time\n```json\n" in output
    content, calls = DeepSeekParser(TOOLS).parse(output)
    assert content == "Let me look both up." and named(calls) == TWO_CALLS
