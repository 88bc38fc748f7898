"""Scheduler: token budget and chunked prefill, seats, decode-first order, preemption of the newest,
and a step's aftermath. Each step runs the model runner over a stand-in model, then the scheduler's
own `update_from_output`, which commits what was computed and appends the sampled tokens."""
import torch

from wallbreaker.config import ModelConfig
from wallbreaker.engine.model_runner import ModelRunner
from wallbreaker.engine.scheduler import Append, Scheduler, StepOutput
from wallbreaker.engine.sequence import Sequence, SequenceStatus
from wallbreaker.kv import BlockManager, BlockPool, KVCache
from wallbreaker.sampling_params import SamplingParams

BS = 4
CONFIG = ModelConfig("llama", vocab_size=32, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                     num_kv_heads=1, head_dim=8)


class NoModel(torch.nn.Module):
    """No layers and zero logits: what the scheduler decides is all that moves."""

    config = CONFIG

    def attention_layers(self) -> list:
        return []

    def forward(self, input_ids: torch.Tensor, meta) -> torch.Tensor:
        return torch.zeros(len(input_ids), 1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(hidden), CONFIG.vocab_size)


def make_seq(i: int, n_prompt: int) -> Sequence:
    return Sequence(i, str(i), 0, list(range(1000 * i, 1000 * i + n_prompt)), n_prompt, SamplingParams(), None)


def scheduler(num_blocks=64, max_num_seqs=8, budget=16) -> Scheduler:
    return Scheduler(BlockManager(BlockPool(num_blocks), BS), max_num_seqs, budget, max_model_len=10_000)


def step(s: Scheduler):
    """One schedule, the runner, then the scheduler's aftermath; each sequence the runner reports
    caught up samples token 7 (the sampler's place)."""
    batch = s.schedule()
    runner = ModelRunner(NoModel(), KVCache(CONFIG, s.block_manager.pool.num_blocks, BS, torch.float32), "cpu")
    caught_up, _ = runner.run(batch)
    s.update_from_output(batch, StepOutput(appends=[Append(seq, [7], [0.0], [[]]) for seq in caught_up]))
    return batch


def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    s = scheduler(budget=16)
    seq = make_seq(1, 40)
    s.add(seq)
    sizes = [step(s).num_new_tokens for _ in range(3)]
    assert sizes == [[16], [16], [8]]
    assert seq.num_output_tokens == 1


def test_decodes_go_first_and_new_prompts_fill_the_remaining_budget():
    s = scheduler(budget=16)
    a = make_seq(1, 4)
    s.add(a)
    step(s)
    b = make_seq(2, 30)
    s.add(b)
    batch = step(s)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 15]


def test_max_num_seqs_bounds_the_running_batch():
    s = scheduler(max_num_seqs=2, budget=64)
    seqs = [make_seq(i, 3) for i in range(1, 5)]
    for q in seqs:
        s.add(q)
    batch = step(s)
    assert batch.seqs == seqs[:2] and len(s.waiting) == 2


def test_pool_exhaustion_preempts_the_newest_and_it_resumes_later():
    s = scheduler(num_blocks=4, budget=64)
    old, new = make_seq(1, 7), make_seq(2, 7)  # two blocks each: the pool is full after admission
    s.add(old)
    s.add(new)
    step(s)
    assert s.block_manager.pool.num_free == 0
    step(s)
    step(s)  # both need a third block now: the newest is preempted, its blocks freed
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert s.num_preemptions >= 1 and old.status is SequenceStatus.RUNNING
    assert list(s.waiting)[0] is new
    s.finish(old, "stop")
    step(s)
    assert new.status is SequenceStatus.RUNNING
    assert new.num_computed_tokens == new.num_tokens - 1  # recomputed prompt + output, sampled again


def test_finish_frees_blocks_at_once():
    s = scheduler()
    seq = make_seq(1, 9)
    s.add(seq)
    step(s)
    assert s.block_manager.pool.num_used == 3
    s.finish(seq, "abort")
    assert s.block_manager.pool.num_used == 0 and not s.has_unfinished()


def decoding(s: Scheduler, n_prompt: int) -> Sequence:
    """A sequence past its prompt and first sample: one token behind, as decoding always is."""
    seq = make_seq(1, n_prompt)
    s.add(seq)
    step(s)
    return seq


def test_verified_drafts_keep_what_was_accepted_and_release_the_rest():
    s = scheduler(budget=64)
    seq = decoding(s, 6)  # 7 tokens, 6 computed
    seq.spec_token_ids = [1, 2, 3, 4, 5]
    batch = s.schedule()
    assert batch.num_new_tokens == [6] and len(seq.block_table) == 3  # room for 12 tokens
    s.update_from_output(batch, StepOutput(appends=[Append(seq, [1, 2, 9], [0.0] * 3, [[]] * 3)]))
    assert seq.token_ids[-3:] == [1, 2, 9] and seq.num_draft == 0
    assert seq.num_computed_tokens == 9  # the last token and the two accepted drafts; 9 is not computed yet
    assert len(seq.block_table) == 3 and s.block_manager.pool.num_used == 3
    assert len(seq.block_hashes) == 2  # two full blocks offered to the prefix cache


def test_rejected_drafts_free_the_blocks_they_took():
    s = scheduler(budget=64)
    seq = decoding(s, 7)  # 8 tokens, 7 computed: two blocks
    seq.spec_token_ids = [1, 2, 3, 4, 5, 6]
    batch = s.schedule()
    assert len(seq.block_table) == 4
    s.update_from_output(batch, StepOutput(appends=[Append(seq, [9], [0.0], [[]])]))  # none accepted
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 2 and s.block_manager.pool.num_used == 2


def test_a_failed_step_commits_nothing_and_returns_the_slots_it_took():
    s = scheduler(budget=64)
    seq = decoding(s, 8)  # 9 tokens, 8 computed: two full blocks
    batch = s.schedule()
    assert batch.num_new_tokens == [1] and len(seq.block_table) == 3
    s.update_from_output(batch, StepOutput(computed=False))
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 2
    assert step(s).num_new_tokens == [1] and seq.num_computed_tokens == 9  # the next step redoes it


def test_a_fork_shares_its_parents_blocks_and_runs_at_once():
    s = scheduler(budget=64)
    parent = make_seq(1, 6)
    s.add(parent)
    batch = s.schedule()
    child = make_seq(2, 6)
    child.token_ids = list(parent.token_ids)
    s.update_from_output(batch, StepOutput(forks=[(parent, child)], appends=[Append(parent, [7], [0.0], [[]]),
                                                                           Append(child, [8], [0.0], [[]])]))
    assert child.block_table == parent.block_table and child.num_computed_tokens == 6
    assert child in s.running and child.status is SequenceStatus.RUNNING
    assert s.block_manager.pool.num_used == 2
    step(s)  # each writes its own token into the shared tail: copied on write
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]


def test_a_sequence_that_stops_is_finished_and_freed_in_the_same_update():
    s = scheduler()
    seq = make_seq(1, 5)
    seq.stop_token_ids = frozenset({2})
    s.add(seq)
    batch = s.schedule()
    deltas = s.update_from_output(batch, StepOutput(appends=[Append(seq, [2], [0.0], [[]])]))
    assert [d.finish_reason for d in deltas] == ["stop"] and seq.is_finished
    assert s.block_manager.pool.num_used == 0 and not s.has_unfinished()
