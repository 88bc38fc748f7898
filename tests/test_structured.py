"""Structured output on the engine: the bitmask in the sampler, outputs that fit their grammar (JSON
schema, regex, choice, GBNF) through n > 1 forks, preemption and beam search; logit_bias,
allowed_token_ids and bad_words; the grammar cache and bad constraints."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from wallbreaker import LLM, InvalidRequestError, SamplingParams
from wallbreaker.engine.structured_output import GrammarError, banned_tokens
from wallbreaker.kv.cache import bytes_per_block
from wallbreaker.layers.sampler import TokenMask, apply_token_mask, sample
from wallbreaker.sampling_params import StructuredOutputsParams as Constraint

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["red", "green", "blue"]},
    "name": {"type": "string", "minLength": 1, "maxLength": 6},
    "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3}},
    "required": ["id", "tag", "name", "xs"], "additionalProperties": False}
COMPACT_JSON = Constraint(json=SCHEMA, disable_any_whitespace=True)  # random weights would pad whitespace
REGEX = r"[0-9]{2,4}-[a-z]{2,3}"
PROMPTS = ["Hello", "The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama.hf_dir), dtype="float32", kv_cache_memory_gb=0.02)


def texts(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in llm.generate(prompts, params)]


# -- the sampler's mask ------------------------------------------------------------------------
def test_token_mask_leaves_exactly_the_set_bits_and_nothing_past_the_tokenizer():
    V_tok, V_model = 70, 80  # an embedding padded past the tokenizer's 70 tokens
    bits = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(3, V_model)
    masked = logits.clone()
    apply_token_mask(masked, TokenMask([0, 2], bits))
    for r, row in ((0, 0), (2, 1)):
        for t in range(V_model):
            allowed = t < 96 and (int(bits[row, t // 32]) >> (t % 32)) & 1
            assert (masked[r, t] == logits[r, t]) if allowed else masked[r, t] == float("-inf"), (r, t)
    assert torch.equal(masked[1], logits[1])  # a row without a mask is untouched
    assert V_tok < 96


def test_sampler_gives_minus_one_where_no_token_is_allowed():
    logits = torch.randn(2, 40)
    bits = torch.zeros(1, 2, dtype=torch.int32)
    for temperature in (0.0, 1.0):
        out = sample(logits, [SamplingParams(temperature=temperature)] * 2, [[], []], [[], []], [None, None],
                     TokenMask([1], bits))
        assert out.token_ids[1] == -1 and out.token_ids[0] >= 0


# -- outputs fit their constraint --------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_fit_json_schema_regex_choice_and_gbnf(llm, temperature):
    cases = [(COMPACT_JSON, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             (Constraint(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
             (Constraint(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so") or pytest.fail(t)),
             (Constraint(grammar='root ::= "(" [a-c]+ ")" | "none"'),
              lambda t: re.fullmatch(r"\([a-c]+\)|none", t) or pytest.fail(t))]
    for constraint, check in cases:
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=60, structured_outputs=constraint)
        for out in llm.generate(PROMPTS, params):
            assert out.outputs[0].finish_reason == "stop", (constraint, out.outputs[0].text)
            check(out.outputs[0].text)


def test_n_greater_than_one_forks_copy_the_matcher(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=60, structured_outputs=COMPACT_JSON)
    outs = llm.generate(PROMPTS[:1], params)[0].outputs
    for c in outs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in outs}) > 1  # the forks went their own ways, each within the schema


def test_preemption_and_recompute_keep_the_grammar(tiny_llama, llm):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=COMPACT_JSON)
    cfg = llm.model_config
    tiny_pool = LLM(str(tiny_llama.hf_dir), dtype="float32", kv_block_size=4,
                    kv_cache_memory_gb=24 * bytes_per_block(cfg, 4, torch.float32) / 2**30)
    prompts = [p * 3 for p in PROMPTS] * 2
    assert texts(tiny_pool, params, prompts) == texts(llm, params, prompts)
    assert tiny_pool.stats()["num_preemptions"] > 0 and tiny_pool.stats()["kv_blocks_used"] == 0


def test_beam_search_keeps_every_beam_in_the_grammar(llm):
    out = llm.beam_search(PROMPTS[:2], beam_width=3, max_tokens=12, structured_outputs=Constraint(regex=REGEX))
    for o in out:
        assert o.sequences
        for s in o.sequences:
            assert re.fullmatch(REGEX, s.text) or (s.finish_reason == "length" and re.fullmatch(r"[0-9]{0,4}-?[a-z]*",
                                                                                                s.text)), s.text
    assert any(s.finish_reason == "stop" for o in out for s in o.sequences)


# -- logit_bias, allowed_token_ids, bad_words --------------------------------------------------
def test_logit_bias_minus_100_bans_and_plus_100_forces(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], greedy)[0].outputs[0].token_ids
    banned = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      logit_bias={first[0]: -100}))[0].outputs[0].token_ids
    assert first[0] not in banned
    forced = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.9, seed=1, max_tokens=6, ignore_eos=True,
                                                      logit_bias={"77": 100}))[0].outputs[0].token_ids
    assert forced == [77] * 6


def test_allowed_token_ids_bound_every_token(llm):
    allowed = [5, 77, 99, 300]
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True,
                                               allowed_token_ids=allowed))
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in out)


def test_bad_words_are_never_completed(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate(PROMPTS[:1], greedy)[0].outputs[0].text
    word = next(w for w in re.findall(r"[A-Za-z]{3,}", text))
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word]))
    ids = out[0].outputs[0].token_ids
    for bad in llm.engine.structured.bad_words_ids([word]):
        assert not any(ids[i:i + len(bad)] == bad for i in range(len(ids)))
    assert banned_tokens([[4], [1, 2, 3]], [9, 1, 2]) == [4, 3]
    assert banned_tokens([[1, 2, 3]], [2, 1]) == []


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="logit_bias names token id 9999"):
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={9999: 5}))
    with pytest.raises(InvalidRequestError, match=r"logit_bias values must be numbers in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(InvalidRequestError, match="allowed_token_ids names token id 512"):
        llm.generate(PROMPTS[:1], SamplingParams(allowed_token_ids=[1, 512]))


def test_constraints_that_allow_nothing_fail_the_request_alone(llm):
    from wallbreaker.errors import EngineError
    with pytest.raises(EngineError, match="allow no token"):
        llm.generate(PROMPTS[:1], SamplingParams(allowed_token_ids=[5], structured_outputs=Constraint(choice=["zzz"]),
                                                 max_tokens=4))
    assert llm.stats()["kv_blocks_used"] == 0


# -- compiling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint, message", [
    (Constraint(json={"type": "integer", "minimum": "a"}), "invalid JSON schema"),
    (Constraint(json={"type": "strnig"}), "strnig"),
    (Constraint(regex="(("), "unclosed group"),
    (Constraint(grammar='root ::= "a" undefined_rule'), "invalid grammar"),
])
def test_invalid_constraints_are_errors_that_name_the_problem(llm, constraint, message):
    with pytest.raises(GrammarError, match=message) as err:
        llm.engine.structured.compile(constraint)
    assert "\n" not in str(err.value) and isinstance(err.value, InvalidRequestError)


def test_compiled_grammars_are_cached_by_constraint(llm):
    structured = llm.engine.structured
    before = structured.compiled
    schema = {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}}}
    first = structured.compile(Constraint(json=schema))
    again = structured.compile(Constraint(json=json.dumps(dict(reversed(list(schema.items()))))))  # same, reordered
    assert first is again and structured.compiled == before + 1
    assert structured.compile(Constraint(json=schema, disable_any_whitespace=True)) is not first


def test_structured_outputs_params_take_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Constraint(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Constraint()
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == Constraint(regex="a+")
    assert SamplingParams(structured_outputs='{"choice": ["x"]}').structured_outputs.choice == ["x"]  # a CLI flag
