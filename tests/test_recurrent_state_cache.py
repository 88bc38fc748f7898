"""Recurrent state wherever a KV cache goes (issue 51 item 2), on the tiny random hybrids (LFM2, Granite-4.0-H)
and a model without attention (Mamba2): a prompt sent again starts from the state the prefix cache kept at
its last block boundary and computes at most a fifth of its tokens; a saved session (`save_prefix` /
`load_prefix`) and the disk tier carry that state into another engine (and another process); a damaged
state file is refused and its tokens computed again. Every warm run gives the tokens of an engine without
any cache (the reference), also batched, in chunks of 7 tokens and with n-gram speculation, and each
chosen token's log-probability is the reference's to 1e-4: the random models' greedy tokens hardly
depend on what lies a hundred tokens back (Mamba2's are the same from a zero state), their
log-probabilities do (by 3e-2 from a zero state)."""
from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_recurrent import GREEDY, TEXT, make_llm

from wallbreaker import LLM, InvalidRequestError, SamplingParams

BS = 16
PARAMS = dataclasses.replace(GREEDY, logprobs=1)
CLOSE = 1e-4
ARCHS = {"lfm2": {}, "granite": {}, "mamba2": {"max_model_len": 2048}}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(arch, recurrent_folder) -> Path:
    return recurrent_folder(arch)


@pytest.fixture(scope="module")
def make(arch, folder):
    return functools.partial(make_llm, folder, kv_block_size=BS, **ARCHS[arch])


@pytest.fixture(scope="module")
def plain(make) -> LLM:
    return make(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompt(plain) -> list[int]:
    return plain.tokenizer.encode(TEXT * 2)  # 118 tokens: 7 full blocks and 6 tokens


@pytest.fixture(scope="module")
def extended(plain, prompt) -> list[int]:
    """The prompt and a next turn's question after it."""
    return prompt + plain.tokenizer.encode(" And what keeps a state per sequence?")


@dataclasses.dataclass
class Run:
    tokens: list[int]
    logprobs: list[float]  # each chosen token's

    def __eq__(self, other: object) -> bool:
        """The same tokens, with log-probabilities within CLOSE."""
        return isinstance(other, Run) and self.tokens == other.tokens and \
            max(abs(a - b) for a, b in zip(self.logprobs, other.logprobs)) < CLOSE


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> tuple[list[Run], list[int]]:
    """Each prompt's run, all submitted at once, and the prompt tokens the prefix cache served each."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return ([Run(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
            [o.metrics["num_cached_prompt_tokens"] for o in outs])


def run(llm: LLM, ids: list[int]) -> tuple[Run, int]:
    runs, cached = generate(llm, [ids])
    return runs[0], cached[0]


@functools.cache
def _cold(plain: LLM, ids: tuple[int, ...]) -> Run:
    return run(plain, list(ids))[0]


def cold(plain: LLM, ids: list[int]) -> Run:
    return _cold(plain, tuple(ids))


def state_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").glob("*.kvst"))


def flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


# -- the RAM prefix cache ------------------------------------------------------------------------
def test_a_prompt_sent_twice_computes_at_most_a_fifth_of_it_the_second_time(make, plain, prompt, extended):
    """The repeat starts from the checkpoint at its last block boundary (112 of 118 tokens cached); the
    next turn's longer prompt from the same one; both give the reference's tokens."""
    llm = make()
    first, cached = run(llm, prompt)
    assert cached == 0 and first == cold(plain, prompt)
    again, cached = run(llm, prompt)
    assert cached == (len(prompt) - 1) // BS * BS and len(prompt) - cached <= len(prompt) / 5 and again == first
    turn, cached = run(llm, extended)
    assert cached == (len(prompt) - 1) // BS * BS and turn == cold(plain, extended)
    assert llm.stats()["state_checkpoint_hits"] == 2


def test_batched_chunked_by_7_and_speculated_repeats_give_the_cold_tokens(make, plain, prompt, extended):
    """Three prompts at once, 7 tokens a step (so a checkpoint falls inside a step), with n-gram
    speculation (greedy among four tokens, so that outputs repeat and n-grams propose); then again, and
    the next turns: each hit starts at a block boundary with the state taken there, and the tokens are
    the reference's."""
    few = dataclasses.replace(PARAMS, allowed_token_ids=plain.tokenizer.encode(" the quick brown fox"))
    llm = make(max_num_batched_tokens=7, speculative_method="ngram", num_speculative_tokens=4,
               speculative_adaptive=False)
    question = extended[len(prompt):]
    rounds = [[prompt, prompt[20:], prompt[:50] * 2]] * 2
    rounds.append([p + question for p in rounds[0]])
    for i, prompts in enumerate(rounds):
        runs, cached = generate(llm, prompts, few)
        assert runs == generate(plain, prompts, few)[0]
        if i == 1:
            assert cached == [(len(p) - 1) // BS * BS for p in prompts]
        elif i == 2:
            assert cached == [(len(p) - 1 - len(question)) // BS * BS for p in prompts]
    assert llm.stats()["spec_accepted"] > 0


# -- saved sessions ------------------------------------------------------------------------------
def test_a_saved_session_brings_the_state_into_another_engine(make, plain, prompt, extended, tmp_path):
    info = make(kv_cache_disk_dir=str(tmp_path)).save_prefix({"prompt_token_ids": prompt}, "chat")
    assert info.num_tokens == (len(prompt) - 1) // BS * BS  # up to the block whose state was kept
    restorer = make(kv_cache_disk_dir=str(tmp_path))
    assert restorer.load_prefix("chat").num_tokens == info.num_tokens
    tokens, cached = run(restorer, extended)
    assert cached == info.num_tokens and tokens == cold(plain, extended)


def test_a_corrupted_session_is_refused_and_the_prompt_computed(make, plain, prompt, extended, tmp_path):
    make(kv_cache_disk_dir=str(tmp_path)).save_prefix({"prompt_token_ids": prompt}, "chat")
    flip_a_payload_byte(tmp_path / "sessions" / "chat.kvs")  # the last bytes are the state's
    restorer = make(kv_cache_disk_dir=str(tmp_path))
    with pytest.raises(InvalidRequestError, match="fails its checksum"):
        restorer.load_prefix("chat")
    assert run(restorer, extended) == (cold(plain, extended), 0)


# -- the disk tier -------------------------------------------------------------------------------
def test_the_disk_tier_brings_the_state_into_another_engine(make, plain, prompt, extended, tmp_path):
    writer = make(kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=0.1)
    run(writer, prompt)
    writer.shutdown()
    assert len(state_files(tmp_path)) == 1
    reader = make(kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=0.1)
    tokens, cached = run(reader, extended)
    assert cached == (len(prompt) - 1) // BS * BS and tokens == cold(plain, extended)
    stats = reader.stats()
    assert stats["kv_disk_states_read"] == 1 and stats["kv_disk_bad"] == 0


def test_a_corrupted_state_file_is_detected_and_recomputed(make, plain, prompt, extended, tmp_path, caplog):
    writer = make(kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=0.1)
    run(writer, prompt)
    writer.shutdown()
    [path] = state_files(tmp_path)
    flip_a_payload_byte(path)
    reader = make(kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=0.1)
    with caplog.at_level("WARNING", logger="wallbreaker.kv"):
        tokens, cached = run(reader, extended)
    assert tokens == cold(plain, extended) and cached == 0
    assert reader.stats()["kv_disk_bad"] == 1
    assert "recurrent state file" in caplog.text and "fails its checksum" in caplog.text
    # computed again, written anew: the next engine finds it whole
    reader.shutdown()
    assert len(state_files(tmp_path)) == 1
    assert run(make(kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=0.1), extended)[1] > 0


# -- a new process ---------------------------------------------------------------------------------
RESTORER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_recurrent_state_cache import run
from tiny_recurrent import make_llm
folder, root, ids, options = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
out = {}
llm = make_llm(folder, kv_cache_disk_dir=root, **options)
out["session_tokens"] = llm.load_prefix("chat").num_tokens
r, cached = run(llm, ids)
out["session"] = [r.tokens, r.logprobs, cached]
r, cached = run(make_llm(folder, kv_cache_disk_dir=root, kv_cache_disk_gb=0.1, **options), ids)
out["disk"] = [r.tokens, r.logprobs, cached]
print(json.dumps(out))
"""


def test_a_new_process_restores_the_session_and_the_disk_tier(arch, folder, make, plain, prompt, extended, tmp_path):
    if arch != "granite":
        pytest.skip("one process start is enough: Granite has both pages and Mamba2 states")
    saver = make(kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=0.1)
    saver.save_prefix({"prompt_token_ids": prompt}, "chat")
    saver.shutdown()
    options = {"kv_block_size": BS, **ARCHS[arch]}
    done = subprocess.run([sys.executable, "-c", RESTORER, str(Path(__file__).parent), str(folder), str(tmp_path),
                           json.dumps(extended), json.dumps(options)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    boundary = (len(prompt) - 1) // BS * BS
    want = cold(plain, extended)
    assert out["session_tokens"] == boundary
    for tokens, logprobs, cached in (out["session"], out["disk"]):
        assert Run(tokens, logprobs) == want and cached == boundary


@pytest.mark.parametrize("other", ["qwen3_next", "mamba"])
def test_the_other_state_kinds_go_through_the_disk_tier(recurrent_folder, other, tmp_path):
    """Qwen3-Next's delta-net states and Mamba (v1)'s: nothing in the disk tier knows a layer kind."""
    plain = make_llm(recurrent_folder(other), kv_block_size=BS, max_model_len=2048, enable_prefix_caching=False)
    make = functools.partial(make_llm, recurrent_folder(other), kv_block_size=BS, max_model_len=2048,
                             kv_cache_disk_dir=str(tmp_path), kv_cache_disk_gb=0.1)
    prompt = plain.tokenizer.encode(TEXT * 2)
    extended = prompt + plain.tokenizer.encode(" And what keeps a state per sequence?")
    writer = make()
    run(writer, prompt)
    writer.shutdown()
    tokens, cached = run(make(), extended)
    assert cached == (len(prompt) - 1) // BS * BS and tokens == run(plain, extended)[0]


def test_a_session_without_a_kept_state_is_refused_saying_why(arch, make, prompt, tmp_path):
    if arch != "lfm2":
        pytest.skip("the refusal does not depend on the layer kind")
    llm = make(kv_cache_disk_dir=str(tmp_path), prefix_state_slots=0)
    with pytest.raises(InvalidRequestError, match=r"no recurrent state .*\(prefix_state_slots=0"):
        llm.save_prefix({"prompt_token_ids": prompt}, "chat")
