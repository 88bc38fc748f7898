"""engine/threads.py: the thread count of decode steps follows the measured step times, driven here
by a stand-in machine whose step time depends on the count and on a neighbour taking a core."""
from wallbreaker.engine.threads import EXPLORE_EVERY, ThreadGovernor, using_threads

import torch


def step_seconds(threads: int, neighbour: bool) -> float:
    """Two cores: two threads are faster when idle, four times slower beside a busy process."""
    if threads == 2:
        return 0.010 * (4 if neighbour else 1)
    return 0.016


def run(governor: ThreadGovernor, steps: int, neighbour: bool) -> list[int]:
    chosen = []
    for _ in range(steps):
        n = governor.threads(decode=True)
        chosen.append(n)
        governor.record(step_seconds(n, neighbour))
    return chosen


def test_idle_runs_every_thread_and_a_neighbour_moves_it_to_one_at_once():
    g = ThreadGovernor(2)
    assert run(g, 64, neighbour=False)[-32:] == [2] * 32
    busy = run(g, 64, neighbour=True)
    assert busy[-32:] == [1] * 32 and busy.index(1) <= 2  # the first slow step starts a trial


def test_the_neighbour_leaving_is_found_by_the_next_round():
    g = ThreadGovernor(2)
    run(g, 64, neighbour=True)
    after = run(g, EXPLORE_EVERY + 64, neighbour=False)
    assert after[-32:] == [2] * 32
    assert after.count(1) <= EXPLORE_EVERY + 16  # no longer than a round's wait and its trial


def test_prefill_takes_every_thread_unless_the_decode_steps_found_a_neighbour():
    g = ThreadGovernor(2)
    run(g, 64, neighbour=False)
    assert g.threads(decode=False) == 2
    run(g, 64, neighbour=True)
    assert g.threads(decode=False) == 1


def test_a_steps_thread_count_is_put_back_after_it():
    before = torch.get_num_threads()
    with using_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
