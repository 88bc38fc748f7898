"""Scheduler: token budget and chunked prefill, seats, decode-first order, preemption of the newest."""
from wallbreaker.engine.scheduler import Scheduler
from wallbreaker.engine.sequence import Sequence, SequenceStatus
from wallbreaker.kv import BlockManager, BlockPool
from wallbreaker.sampling_params import SamplingParams

BS = 4


def make_seq(i: int, n_prompt: int) -> Sequence:
    return Sequence(i, str(i), 0, list(range(1000 * i, 1000 * i + n_prompt)), n_prompt, SamplingParams(), None)


def scheduler(num_blocks=64, max_num_seqs=8, budget=16) -> Scheduler:
    return Scheduler(BlockManager(BlockPool(num_blocks), BS), max_num_seqs, budget)


def step(s: Scheduler):
    """One schedule + commit; sequences that caught up sample a dummy token."""
    batch = s.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        s.block_manager.commit(seq, n)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
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
