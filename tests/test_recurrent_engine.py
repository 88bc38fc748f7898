"""The engine's behaviours keep greedy output exact on recurrent states, on the tiny random model of each
recurrent architecture (tests/tiny_recurrent.py): LFM2 (short convolutions beside attention),
Granite-4.0-H (Mamba2 mixers beside attention), pure Mamba2 (no attention, so no KV pages),
Qwen3-Next (gated delta nets beside gated attention) and Mamba (v1). Batching and chunked prefill, n-gram and
draft-model speculation, a pool too small for all (preemption), the prefix cache and n > 1 samples
sharing one state each give what a request alone gives; any chunking of a prompt gives the logits of
one pass."""
from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

import pytest
import torch
from tiny_recurrent import (GREEDY, GREEDY_TOKENS, PROMPTS, TEXT, VOCAB, assert_any_chunking_gives_one_pass_logits,
                            holds_only_checkpoints, make_llm, no_fused_kernels, save_random_model)

from wallbreaker import LLM, SamplingParams
from wallbreaker.kv.cache import bytes_per_block
from wallbreaker.kv.state_pool import slots_per_sequence

Make = Callable[..., LLM]  # engine options -> an engine running the model under test
BLOCK = 4  # the KV block size where pools are sized by hand or the prefix cache is hit


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    options: dict = dataclasses.field(default_factory=dict)  # every engine's
    long_pool: tuple[int, int] = (7, 200)  # the long prompts' pool: the bytes of (states, KV blocks)


ARCHS = [
    Arch("lfm2"),
    Arch("granite"),
    # no attention: the block table only keys the prefix cache, and the engine sizes it by
    # max_num_seqs * max_model_len (the config says 2**20 tokens); with no K/V to run short of, the
    # long prompts' pool is short of states (3 slots for 2 sequences)
    Arch("mamba2", {"max_model_len": 2048}, long_pool=(4, 0)),
    Arch("qwen3_next"),
    Arch("mamba", {"max_model_len": 2048}, long_pool=(4, 0)),  # no attention, as Mamba2
]


def test_transformers_runs_its_own_torch_path():
    """The reference every architecture's tests compare with (tiny_recurrent.load_reference)."""
    assert no_fused_kernels() == []


# -- requests ------------------------------------------------------------------------------------
def motif_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of mixed lengths (3 to 45 tokens) with repeated motifs (so that n-grams propose)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(3, 2000) for _ in range(rng.randint(2, 6))]
        out.append((motif * 12)[:rng.randint(3, 45)])
    return out


def greedy_of(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
              ) -> list[list[int]]:
    """Each prompt's tokens, all submitted at once."""
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def greedy_alone(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [greedy_of(llm, [p], params)[0] for p in prompts]


def budget_gb(llm: LLM, states: int, blocks: int) -> float:
    """The bytes of `states` recurrent states and `blocks` KV blocks of BLOCK tokens, as kv_cache_memory_gb
    (the engine gives a hybrid's states three quarters of it, at most what max_num_seqs need)."""
    per_block = bytes_per_block(llm.model_config, BLOCK, torch.float32)
    return (states * llm.stats()["state_bytes_per_sequence"] + blocks * per_block) / 2**30


def assert_all_given_back(llm: LLM) -> dict:
    """Every KV block and state slot is back but the prefix cache's checkpoints. Returns the stats."""
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and holds_only_checkpoints(llm)
    return stats


# -- each architecture's engines and prompts (module-scoped: built once per architecture) ---------
@pytest.fixture(scope="module", params=ARCHS, ids=[a.name for a in ARCHS])
def arch(request) -> Arch:
    return request.param


@pytest.fixture(scope="module")
def make(arch, recurrent_folder) -> Make:
    return functools.partial(make_llm, recurrent_folder(arch.name), **arch.options)


@pytest.fixture(scope="module")
def plain(make) -> LLM:
    """No prefix cache: every request computed from its first token, the reference for the rest."""
    return make(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    """PROMPTS, a long one (TEXT three times, 177 tokens), one that repeats itself, and eight of motifs."""
    long = plain.tokenizer.encode(TEXT * 3)
    return [plain.tokenizer.encode(p) for p in PROMPTS] + [long, long[:6] * 4 + long[:3]] + motif_prompts(8)


@pytest.fixture(scope="module")
def expected(plain, prompts) -> list[list[int]]:
    return greedy_alone(plain, prompts)


@pytest.fixture(scope="module")
def few(plain) -> SamplingParams:
    """Greedy among four tokens: the random models' free choice rarely repeats itself (Mamba2's and
    Qwen3-Next's) or always does (LFM2's and Granite's); among four, each picks by its state and
    repeats enough that n-grams and a draft are sometimes right and sometimes wrong."""
    return dataclasses.replace(GREEDY, allowed_token_ids=plain.tokenizer.encode(" the quick brown fox"))


@pytest.fixture(scope="module")
def expected_few(plain, prompts, few) -> list[list[int]]:
    return greedy_alone(plain, prompts, few)


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory):
    """A random-weight Llama with the same tokenizer: a draft that is often wrong."""
    from transformers import LlamaConfig
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return save_random_model(config, tmp_path_factory.mktemp("llama_draft") / "hf", seed=1)


# -- the behaviours ------------------------------------------------------------------------------
def test_any_chunking_gives_the_logits_of_one_pass(make):
    """177 tokens in chunks of 1, 5 and 7 (each run token by token from the pool, `step_in_pool`), 17
    and 100 (the chunked form from a saved state, across Mamba2's SSD chunks of 8 and Qwen3-Next's
    delta-rule chunks of 64)."""
    llm = make(kv_block_size=BLOCK)
    assert_any_chunking_gives_one_pass_logits(llm, llm.tokenizer.encode(TEXT * 3), chunks=(1, 5, 7, 17, 100))


def test_batched_and_chunked_prefill_give_the_tokens_of_each_prompt_alone(make, prompts, expected):
    """All at once; in steps of 5 tokens; and beside a prompt of 300 tokens prefilled 64 at a time."""
    assert greedy_of(make(), prompts) == expected
    assert greedy_of(make(max_num_batched_tokens=5), prompts) == expected
    long_prompt = (prompts[-1] * 40)[:300]
    assert greedy_of(make(max_num_batched_tokens=64), [long_prompt, *prompts])[1:] == expected


@pytest.mark.parametrize("budget", [{}, {"max_num_batched_tokens": 5}], ids=["whole", "5_a_step"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_is_token_for_token_plain_greedy(request, make, prompts, few, expected, expected_few, method,
                                                     budget):
    """The prompts, greedy and greedy among `few` tokens, all at once, give what each gives alone; drafts
    were accepted and rejected (the state after a verified position is kept, the rest dropped; with 5
    tokens a step, drafts are also cut or dropped unverified), and every block and slot is given back.
    Every request drafts: by n-grams where its output repeats (among `few`), by the draft model always."""
    if method == "ngram":
        options = dict(speculative_method="ngram", num_speculative_tokens=4)
    else:
        options = dict(speculative_method="draft", speculative_model=str(request.getfixturevalue("llama_draft")),
                       num_speculative_tokens=3)
    llm = make(speculative_adaptive=False, **options, **budget)
    params = [GREEDY] * len(prompts) + [few] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params)
    assert [o.outputs[0].token_ids for o in outs] == expected + expected_few
    stats = assert_all_given_back(llm)
    assert 0 < stats["spec_accepted"] < stats["spec_proposed"]
    drafting = outs[len(prompts):] if method == "ngram" else outs
    assert all(o.metrics.get("spec_proposed_tokens", 0) > 0 for o in drafting)


def test_a_pool_too_small_for_all_preempts_and_keeps_the_greedy_tokens(make, plain, prompts, expected):
    """Three copies of the prompts, up to 8 running, in the bytes of 8 states and 96 KV blocks: fewer
    than 8 fit (by their states; LFM2's are small, so by their K/V), so requests wait, and running
    ones are preempted and recomputed (from the prefix cache's blocks and state checkpoints)."""
    llm = make(max_num_seqs=8, kv_block_size=BLOCK, kv_cache_memory_gb=budget_gb(plain, states=8, blocks=96))
    assert greedy_of(llm, prompts * 3) == expected * 3
    stats = assert_all_given_back(llm)
    assert stats["num_preemptions"] > 0
    eight_longest = sorted(-(-(len(p) + GREEDY_TOKENS) // BLOCK) for p in prompts)[-8:]
    assert stats["state_slots_total"] < 1 + 8 * slots_per_sequence(0) or stats["kv_blocks_total"] < sum(eight_longest)


def test_long_prompts_preempted_without_checkpoints_are_recomputed(arch, make, plain):
    """Three prompts of 420 to 445 tokens, two at a time, with no state checkpoints for the prefix cache,
    in a pool whose KV share (Mamba2's: whose states) holds fewer than two need: one is preempted and
    computed again from its first token."""
    ids = plain.tokenizer.encode(TEXT * 12)
    prompts = [ids[:440], ids[5:450], ids[10:430]]
    llm = make(max_num_seqs=2, prefix_state_slots=0, kv_block_size=BLOCK,
               kv_cache_memory_gb=budget_gb(plain, *arch.long_pool))
    assert greedy_of(llm, prompts) == greedy_alone(plain, prompts)
    assert assert_all_given_back(llm)["num_preemptions"] > 0


def test_a_repeated_or_extended_prompt_starts_from_a_cached_state(make, plain, prompts, expected):
    """Each prompt longer than a block, again, and again with 5 of its tokens after it: both start from
    the prefix cache and give the tokens of a request computed from scratch."""
    llm = make(kv_block_size=BLOCK)
    for prompt, want in zip(prompts, expected):
        if len(prompt) <= BLOCK:  # no block boundary before its last token: nothing to cache
            continue
        first, again = (llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0] for _ in range(2))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
        assert again.metrics["num_cached_prompt_tokens"] > 0
        longer = prompt + want[:5]
        extended = llm.generate([{"prompt_token_ids": longer}], GREEDY)[0]
        assert extended.metrics["num_cached_prompt_tokens"] > 0
        assert extended.outputs[0].token_ids == greedy_of(plain, [longer])[0]
    assert_all_given_back(llm)


def assert_seeded_forks_are_separate_requests(llm: LLM, prompt: list[int], other: list[int]) -> None:
    """n = 4 samples of `prompt` share its state slot; sample i with seed s is the request with seed
    s + i on its own, whatever else is in the batch, and the samples differ."""
    def sampled(prompts: list[list[int]], **params) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, **params)
        return [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)[-1].outputs]

    forks = sampled([prompt], n=4, seed=7)
    assert sampled([other, prompt], n=4, seed=7) == forks
    assert [sampled([prompt], seed=7 + i)[0] for i in range(4)] == forks
    assert len({tuple(t) for t in forks}) > 1 and holds_only_checkpoints(llm)


def test_n_samples_sharing_the_state_equal_separate_requests(make, prompts):
    """A short prompt beside the long one, and two of motifs."""
    llm = make()
    assert_seeded_forks_are_separate_requests(llm, prompts[0], prompts[2])
    assert_seeded_forks_are_separate_requests(llm, prompts[4], prompts[5])
