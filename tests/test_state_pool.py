"""The state pool and the scheduler's state bookkeeping (kv/state_pool.py, kv/block_manager.py),
through the real scheduler and model runner over a stand-in recurrent model whose state is exact
(the sum and count of the tokens so far, small integers in float32) and whose next token is a
function of that state alone. So any state lost, applied twice, taken from the wrong slot or
after the wrong number of tokens changes the tokens, against a plain-Python reference."""
from __future__ import annotations

import pytest
import torch

from wallbreaker.config import ModelConfig
from wallbreaker.engine.model_runner import ModelRunner
from wallbreaker.engine.scheduler import Append, Scheduler, StepOutput
from wallbreaker.engine.sequence import Sequence
from wallbreaker.kv import BlockManager, BlockPool, KVCache
from wallbreaker.kv.state_pool import StatePool, logs_drafts, size_state_pool, slots_per_sequence
from wallbreaker.layers.recurrent import RecurrentMixer, scan_spans
from wallbreaker.sampling_params import SamplingParams

BS = 4
VOCAB = 97
CONFIG = ModelConfig("llama", vocab_size=VOCAB, hidden_size=2, intermediate_size=2, num_layers=1, num_heads=1,
                     num_kv_heads=1, head_dim=2, layer_types=("conv",))


def next_token(total: int, count: int) -> int:
    return (total * 31 + count * 7) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(sum(tokens), len(tokens)))
    return tokens[len(prompt):]


class SumMixer(RecurrentMixer):
    """State: [sum of token ids, count of tokens]. `in_pool`: short spans run token by token from
    and into the pool's slots (scan_spans' `step_in_pool`, which the C++ kernels are). `logs`: that
    form keeps the states after drafts as logs of their tokens, as Mamba2's kernel does (a slot of
    WIDTH holds a whole state in its first two places, or up to WIDTH tokens): a log read as a whole
    state, or a root let go too early, gives other tokens."""

    in_pool = False
    logs = False
    WIDTH = 6

    def state_shapes(self):
        return [(self.WIDTH,)] if self.logs else [(2,)]

    @property
    def logs_drafts(self) -> int:
        return self.WIDTH if self.logs and self.in_pool else 0

    def forward(self, x, meta):
        return scan_spans(meta.state, self.state, (x,), self._scan, self._scan,
                          self._in_pool if self.in_pool else None, self.logs_drafts > 0)

    def _in_pool(self, inputs, src, dst, logged=None):
        (x,), (pool,) = inputs, self.state  # x: [B, T, 1]
        steps = x.shape[1]
        state = pool[src, :2]
        if logged is not None:
            for b, (root, entries, _) in enumerate(logged.tolist()):
                if root >= 0:
                    state[b] = pool[root, :2] + torch.tensor([pool[src[b], :entries].sum(), entries])
        out = []
        for t in range(steps):
            state = state + torch.cat([x[:, t], torch.ones_like(x[:, t])], 1)
            out.append(state)
            for b in range(x.shape[0]):
                slot, first = int(dst[b, t]), steps if logged is None else int(logged[b, 2])
                if slot >= 0 and t < first:
                    pool[slot, :2] = state[b]
                elif slot >= 0:
                    pool[slot, :t + 1 - first] = x[b, first:t + 1, 0]
        return torch.stack(out, 1)

    @staticmethod
    def _scan(inputs, states):
        (x,), (s,) = inputs, states  # x: [L, 1] (or [B, 1]: one token each), s: [1 or B, 2 or WIDTH]
        if s.shape[0] == x.shape[0] and x.shape[0] > 1:  # a one-token-each step
            new = s.clone()
            new[:, :2] += torch.cat([x, torch.ones_like(x)], 1)
            return new[:, :2], [new]
        steps = torch.cat([x, torch.ones_like(x)], 1).cumsum(0) + s[:, :2]  # [L, 2]: the state after each row
        last = s.clone()
        last[:, :2] = steps[-1:]
        return steps, [last]


class SumModel(torch.nn.Module):
    config = CONFIG

    def __init__(self):
        super().__init__()
        self.mixer = SumMixer()

    def attention_layers(self):
        return []

    def recurrent_layers(self):
        return [self.mixer]

    def forward(self, input_ids, meta):
        return self.mixer(input_ids.float()[:, None], meta)

    def logits(self, hidden):
        ids = (hidden[:, 0].long() * 31 + hidden[:, 1].long() * 7) % VOCAB
        return torch.nn.functional.one_hot(ids, VOCAB).float()


@pytest.fixture(autouse=True, params=["torch", "in_pool", "logged"])
def in_pool(request, monkeypatch):
    monkeypatch.setattr(SumMixer, "in_pool", request.param != "torch")
    monkeypatch.setattr(SumMixer, "logs", request.param == "logged")


def engine(num_blocks=64, slots=None, max_num_seqs=8, budget=64, checkpoints=8, spec=0, caching=True):
    slots = slots or 1 + max_num_seqs * slots_per_sequence(spec) + checkpoints
    model = SumModel()
    states = StatePool([model.mixer.state_shapes()], slots, checkpoints, log_drafts=logs_drafts(model))
    bm = BlockManager(BlockPool(num_blocks, caching), BS, states=states)
    s = Scheduler(bm, max_num_seqs, budget, max_model_len=10_000)
    runner = ModelRunner(model, KVCache(CONFIG, num_blocks, BS, torch.float32), "cpu", states=states)
    return s, runner, states


def make_seq(i: int, prompt: list[int]) -> Sequence:
    return Sequence(i, str(i), 0, list(prompt), len(prompt), SamplingParams(), None)


def step(s: Scheduler, runner: ModelRunner, drafts: dict | None = None, fail: bool = False):
    """One step; every caught-up sequence takes the greedy token, and verifies its drafts greedily."""
    for seq, d in (drafts or {}).items():
        seq.spec_token_ids = list(d)
    batch = s.schedule()
    if not batch.seqs:  # as the engine does: nothing to run
        return batch
    caught_up, logits = runner.run(batch)
    if fail:
        s.update_from_output(batch, StepOutput(computed=False))
        return batch
    appends, row = [], 0
    for seq in caught_up:
        rows = logits[row:row + 1 + seq.num_draft].argmax(-1).tolist()
        row += 1 + seq.num_draft
        kept = []
        for i, token in enumerate(rows):
            kept.append(token)
            if i >= seq.num_draft or seq.spec_token_ids[i] != token:
                break
        appends.append(Append(seq, kept, [0.0] * len(kept), [[]] * len(kept)))
    s.update_from_output(batch, StepOutput(appends=appends))
    return batch


def run(s, runner, seqs, n_out, **step_args):
    for seq in seqs:
        if seq not in s.running and seq not in s.waiting:
            s.add(seq)
    while any(seq.num_output_tokens < n_out for seq in seqs):
        step(s, runner, **step_args)
    for seq in seqs:
        if not seq.is_finished:
            s.finish(seq, "length")
    return [seq.output_token_ids[:n_out] for seq in seqs]


PROMPTS = [[5, 9, 14, 3, 7, 1, 8, 2, 6, 11, 4], [2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.mark.parametrize("budget", [64, 5, 1])
def test_any_chunking_gives_the_reference_tokens(budget):
    s, runner, states = engine(budget=budget)
    outs = run(s, runner, [make_seq(i, p) for i, p in enumerate(PROMPTS)], 6)
    assert outs == [reference(p, 6) for p in PROMPTS]
    assert states.num_used == len(states.checkpoints)  # what finished sequences held went back


def test_repeated_prompt_starts_from_the_checkpoint_at_its_last_block_boundary():
    s, runner, states = engine()
    prompt = PROMPTS[0]  # 11 tokens: the checkpoint is after 8
    run(s, runner, [make_seq(0, prompt)], 3)
    again = make_seq(1, prompt + [1])
    s.add(again)
    step(s, runner)
    assert again.num_cached_tokens == 8
    assert states.checkpoint_hits == 1
    assert run(s, runner, [again], 4) == [reference(prompt + [1], 4)]


def test_a_cached_block_without_a_checkpoint_is_not_reused():
    s, runner, states = engine(checkpoints=0)
    run(s, runner, [make_seq(0, PROMPTS[0])], 2)
    again = make_seq(1, PROMPTS[0])
    s.add(again)
    step(s, runner)
    assert again.num_cached_tokens == 0
    assert run(s, runner, [again], 3) == [reference(PROMPTS[0], 3)]


def test_failed_step_keeps_the_state_it_started_from():
    s, runner, states = engine()
    seq = make_seq(0, PROMPTS[0])
    s.add(seq)
    step(s, runner)
    step(s, runner)
    used = states.num_used
    step(s, runner, fail=True)
    assert states.num_used == used  # the failed step's slots went back
    assert run(s, runner, [seq], 5) == [reference(PROMPTS[0], 5)]


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_verification_keeps_the_state_after_the_accepted_drafts(accepted):
    s, runner, states = engine(spec=3)
    prompt = PROMPTS[0]
    seq = make_seq(0, prompt)
    s.add(seq)
    step(s, runner)  # prefill and first token
    truth = reference(prompt, 8)
    drafts = truth[1:1 + accepted] + [(t + 1) % VOCAB for t in truth[1 + accepted:4]]
    batch = step(s, runner, drafts={seq: drafts})
    assert batch.num_new_tokens == [4]
    assert seq.output_token_ids == truth[:2 + accepted]
    if SumMixer.logs:  # the state kept is a log of the accepted drafts over the state after the first token
        assert states.log_of(seq.state_slot)[1] == accepted or accepted == 0
    assert run(s, runner, [seq], 8) == [truth]
    assert not states.logs and states.num_used == len(states.checkpoints)  # every root let go


def test_forks_share_their_parent_state_slot():
    s, runner, states = engine()
    parent = make_seq(0, PROMPTS[2])
    s.add(parent)
    step(s, runner)
    child = make_seq(1, list(parent.token_ids))
    child.num_prompt_tokens = parent.num_prompt_tokens
    s.block_manager.fork(parent, child)
    assert child.state_slot == parent.state_slot and states.ref_counts[parent.state_slot] >= 2
    s.running.append(child)
    from wallbreaker.engine.sequence import SequenceStatus
    child.status = SequenceStatus.RUNNING
    outs = run(s, runner, [parent, child], 5)
    assert outs == [reference(PROMPTS[2], 5)] * 2


def test_preemption_in_a_small_pool_recomputes_exactly():
    prompts = [[i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(0, 30, 5)]
    s, runner, states = engine(num_blocks=8, budget=64)
    outs = run(s, runner, [make_seq(i, p) for i, p in enumerate(prompts)], 6)
    assert s.num_preemptions > 0
    assert outs == [reference(p, 6) for p in prompts]


def test_admission_waits_for_free_state_slots():
    """A pool with room for one sequence's slots runs the others after it, not beside it."""
    s, runner, states = engine(slots=1 + slots_per_sequence(0), checkpoints=0)
    outs = run(s, runner, [make_seq(i, p) for i, p in enumerate(PROMPTS)], 3)
    assert outs == [reference(p, 3) for p in PROMPTS]


def test_checkpoints_are_bounded_and_least_recent_go_first():
    pool = StatePool([[(2,)]], 10, max_checkpoints=2)
    slots = [pool.allocate() for _ in range(3)]
    for i, slot in enumerate(slots):
        pool.checkpoint(bytes([i]), slot)
        pool.release(slot)
    assert pool.lookup(bytes([0])) is None and pool.lookup(bytes([2])) == slots[2]
    assert pool.num_used == 2


def test_pool_is_sized_within_the_budget_or_refused():
    shapes = [[(1024,)]]  # 4 KB a slot
    slots, checkpoints = size_state_pool(shapes, 4, 0, 4, budget_bytes=1e9)
    assert slots == 1 + 4 * slots_per_sequence(0) + 4 and checkpoints == 4
    slots, _ = size_state_pool(shapes, 64, 0, 64, budget_bytes=40 * 4096)
    assert slots == 40
    with pytest.raises(Exception, match="raise kv_cache_memory_gb"):
        size_state_pool(shapes, 4, 0, 4, budget_bytes=2 * 4096)


def test_a_prefix_hit_is_not_counted_as_a_free_slot_when_admitting():
    """The checkpoint a new sequence starts from is held before the pool is asked for the step's
    slots: counted as evictable, it was taken twice and the pool ran dry mid-admission."""
    s, runner, states = engine(slots=1 + slots_per_sequence(0), checkpoints=1)
    prompt = PROMPTS[0]
    run(s, runner, [make_seq(0, prompt)], 1)  # leaves its checkpoint after 8 tokens
    held = states.allocate()  # another's: one free slot and the evictable checkpoint remain
    longer = make_seq(1, prompt + [3, 4, 5, 6, 7])  # from the checkpoint, it needs two slots for its step
    s.add(longer)
    assert not step(s, runner).seqs  # it waits
    states.release(held)
    assert run(s, runner, [longer], 3) == [reference(prompt + [3, 4, 5, 6, 7], 3)]
    assert longer.num_cached_tokens == 8


def test_a_state_read_from_a_file_becomes_a_checkpoint_where_a_slot_is_free():
    """`read_slot` / `write_slot` round-trip every layer's kinds; `restore_checkpoint` keeps the state
    as the block's checkpoint (the one already kept where there is one), and gives up, taking
    nothing, where no slot is free or checkpoints are off."""
    pool = StatePool([[(2,), (1, 3)], [(4,)]], 4, max_checkpoints=2)
    source = pool.allocate()
    for t in (t for kinds in pool.layers for t in kinds):
        t[source] = torch.randn(t.shape[1:])
    parts = pool.read_slot(source)
    slot = pool.restore_checkpoint(b"a", parts)
    assert slot not in (None, source) and pool.lookup(b"a") == slot
    assert all(torch.equal(a, b) for a, b in zip(pool.read_slot(slot), parts))
    assert pool.restore_checkpoint(b"a", parts) == slot and pool.num_used == 2
    held = [pool.allocate() for _ in range(pool.num_free)]  # the checkpoint too: evicted
    assert pool.lookup(b"a") is None and pool.restore_checkpoint(b"b", parts) is None and pool.num_used == 3
    for s in held:
        pool.release(s)
    assert StatePool([[(2,)]], 4, max_checkpoints=0).restore_checkpoint(b"a", [torch.zeros(2)]) is None
