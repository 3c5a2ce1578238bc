"""The thread count of decode steps (engine/model/cpu/decode_threads.py): the faster of all the
engine's threads and one by their recent step times, one thread timed again only when the
team's steps slow down, the team timed again now and then while on one thread, so that a host
getting busy or idle turns the choice; and the fast path running each decode step on it."""

from __future__ import annotations

import pytest
import torch

from engine.model.cpu.decode_threads import PROBE_AT_MOST, PROBE_EVERY, RECENT, DecodeThreads
from engine.model.cpu.fast_path import CpuFastPath


def _run(choice: DecodeThreads, steps: int, seconds: dict[int, float], rows: int = 1) -> list[int]:
    """``steps`` decode steps, each taking ``seconds[threads]``; the counts they ran on."""
    counts = []
    for _ in range(steps):
        threads = choice.choose(rows)
        choice.observe(rows, threads, seconds[threads])
        counts.append(threads)
    return counts


def test_an_idle_host_runs_every_step_on_the_team():
    choice = DecodeThreads(4)
    counts = _run(choice, RECENT + 1 + 3 * PROBE_EVERY, {4: 0.009, 1: 0.012})
    assert counts[: RECENT + 1] == [4] * RECENT + [1]  # the team, one thread once
    assert counts[RECENT + 1 :] == [4] * 3 * PROBE_EVERY  # then the team only


def test_a_step_held_up_now_and_then_does_not_turn_the_choice():
    """Every 4th step on the team three times as long (the event loop, a fault): the median of
    the recent steps does not move, and one thread is never timed again."""
    choice = DecodeThreads(2)
    counts = []
    for step in range(4 * PROBE_EVERY):
        threads = choice.choose(1)
        slow = 3 if step % 4 == 3 else 1
        choice.observe(1, threads, {2: 0.009 * slow, 1: 0.012}[threads])
        counts.append(threads)
    assert counts.count(1) == 1


def test_one_thread_is_timed_again_when_the_teams_steps_slow_down():
    """A longer context slows every step: one thread is timed again at each 25 %."""
    choice = DecodeThreads(2)
    counts = _run(choice, 10, {2: 0.009, 1: 0.012})
    counts += _run(choice, 10, {2: 0.0105, 1: 0.014})  # 17 % slower: nothing to time
    counts += _run(choice, 10, {2: 0.012, 1: 0.016})  # 33 %: one thread timed once
    assert counts[RECENT + 1 :].count(1) == 1 and counts[-1] == 2


def test_a_busy_host_turns_the_choice_to_one_thread_within_steps_and_back_when_idle():
    choice = DecodeThreads(2)
    _run(choice, 10, {2: 0.009, 1: 0.012})
    busy = _run(choice, 4 + 3 * PROBE_EVERY + PROBE_AT_MOST, {2: 0.055, 1: 0.012})
    assert busy[:4] == [2, 2, 2, 1]  # three slow steps moved the team's median: on one thread
    probes = [at for at, n in enumerate(busy) if n == 2][3:]
    # the team timed again less and less often: after 64 steps on one thread, then 128, 256
    assert probes == [2 + PROBE_EVERY, 2 + 3 * PROBE_EVERY, 2 + 3 * PROBE_EVERY + PROBE_AT_MOST]
    idle = _run(choice, 2 * PROBE_AT_MOST, {2: 0.009, 1: 0.012})
    back = idle.index(2)  # at the next probe, back on the team for good
    assert back < PROBE_AT_MOST and idle[back:] == [2] * (len(idle) - back)


def test_each_batch_size_class_has_its_own_times():
    choice = DecodeThreads(2)
    _run(choice, 20, {2: 0.009, 1: 0.012}, rows=1)
    _run(choice, 20, {2: 0.040, 1: 0.030}, rows=16)
    assert choice.choose(1) == 2 and choice.choose(16) == 1 and choice.choose(20) == 1


def test_one_thread_configured_is_one_thread_always():
    choice = DecodeThreads(1)
    assert _run(choice, 5, {1: 0.01}) == [1] * 5


class _Model(torch.nn.Module):
    def get_input_embeddings(self) -> torch.nn.Embedding:
        return torch.nn.Embedding(8, 16)


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_fast_path_runs_a_decode_step_on_the_chosen_count_and_times_it(torch_threads):
    fast = CpuFastPath(_Model(), threads=2, num_prepacked=0)
    _run(fast.decode_threads, RECENT + 2, {2: 0.055, 1: 0.012})  # as on a busy host
    seen = []
    with fast.step_threads(1, decode=True):
        seen.append(torch.get_num_threads())
    with fast.step_threads(64, decode=False):  # a prefill: every thread
        seen.append(torch.get_num_threads())
    assert seen == [1, 2]
    assert _run(fast.decode_threads, 1, {2: 0.055, 1: 0.012}) == [1]
    assert min(fast.decode_threads._sizes[1].recent[1]) < 0.012  # the step above, timed
