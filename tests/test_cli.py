"""The `wallbreaker` command as a user runs it."""
from __future__ import annotations

import json
import subprocess
import sys

from wallbreaker import LLM, SamplingParams


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wallbreaker.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_generate_with_the_default_model_prints_a_completion_and_its_speed(packaged_model):
    packaged_model("smollm2")
    result = run("generate", "--max-tokens", "8", "The capital of France is")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is") and "Paris" in result.stdout
    assert "tokens/s" in result.stderr and "TTFT" in result.stderr


def test_generate_json_gives_one_object_per_prompt(tiny_llama):
    result = run("generate", "--model", str(tiny_llama.gguf_path), "--max-tokens", "5", "--json", "Hello", "Once upon")
    assert result.returncode == 0, result.stderr
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    assert [o["prompt"] for o in objects] == ["Hello", "Once upon"]
    for o in objects:
        assert set(o) >= {"prompt", "text", "token_ids", "finish_reason", "metrics"}
        assert o["finish_reason"] in ("stop", "length") and 0 < len(o["token_ids"]) <= 5


def test_chat_streams_replies_and_keeps_the_conversation(tiny_llama):
    model = str(tiny_llama.gguf_path)
    result = run("chat", "--model", model, "--dtype", "float32", "--max-tokens", "6", stdin="Hi there\nAnd again\n")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("tokens/s") == 2  # one reply per user line
    # the replies, as the Python API gives them for the whole conversation so far (greedy, the CLI's default)
    llm, params = LLM(model, dtype="float32"), SamplingParams(temperature=0.0, max_tokens=6)
    first = llm.chat([{"role": "user", "content": "Hi there"}], params)[0].outputs[0].text
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "And again"}]
    second = llm.chat(history, params)[0].outputs[0].text
    assert result.stdout == f"{first}\n{second}\n"
    alone = llm.chat([{"role": "user", "content": "And again"}], params)[0].outputs[0].text
    assert second != alone  # the history changes the reply here, so the check above tells the two apart


def test_inspect_describes_formats_and_bytes_per_token(packaged_model):
    packaged_model("smollm2")
    result = run("inspect", "smollm2")
    assert result.returncode == 0, result.stderr
    assert "llama: 30 layers" in result.stdout and "Q4_1" in result.stdout and "Q8_0" in result.stdout
    info = json.loads(run("inspect", "smollm2", "--json").stdout)
    assert info["kv_bytes_per_token_float32"] == 46080  # 30 layers x 3 KV heads x 64 x K,V x 4 bytes


def test_sampling_engine_and_quantize_fields_are_all_flags():
    """The flags are generated from the dataclasses: a field added there is a flag here."""
    import dataclasses

    from wallbreaker import EngineConfig
    from wallbreaker.cli import build_parser, engine_options, sampling_params
    from wallbreaker.quant.pipeline import QuantizeConfig
    args = build_parser().parse_args(["generate", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
                                      "--stop", "a", "--stop", "b", "--stop-token-ids", "7", "--ignore-eos",
                                      "--no-enable-prefix-caching", "Hello"])
    p = sampling_params(args)
    assert (p.presence_penalty, p.frequency_penalty, p.stop, p.stop_token_ids, p.ignore_eos) == \
        (0.5, -0.5, ["a", "b"], [7], True)
    assert p.temperature == 0.0 and p.max_tokens == 64  # the CLI's own defaults: greedy, 64 tokens
    options = engine_options(args)
    assert set(options) == {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert options["enable_prefix_caching"] is False
    q = build_parser().parse_args(["quantize", "--method", "rtn", "--bits", "4", "MODEL", "OUT"])
    assert {f.name for f in dataclasses.fields(QuantizeConfig)} <= set(vars(q))
