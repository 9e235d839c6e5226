"""Sequential test-time scaling: window selection by hand, the next round's context, round metrics."""

import math

import pytest

from drkernel.prompts import feedback_message, first_turn_messages
from drkernel.stts import best_window, context_messages, format_iterations, iteration_metrics, round_turns
from drkernel.tasks import load_bundled


@pytest.mark.parametrize("rewards, window, expected", [
    ([0, 1, 0.5, 0, 2], 2, (3, 5)),  # window sums 1, 1.5, 0.5, 2
    ([0.5, 0, 0, 0, 0.9], 4, (1, 5)),  # the paper's shape: 5 turns, 4-turn window; sums 0.5, 0.9
    ([0.9, 0, 0, 0, 0.5], 4, (0, 4)),  # sums 0.9, 0.5
    ([1, 0, 1, 0], 2, (0, 2)),  # sums 1, 1, 1: a tie goes to the earliest window (KernelGYM)
    ([0, 0, 0], 1, (0, 1)),  # all failures: the first turn
    ([-1, -1, 0], 1, (2, 3)),
    ([2, 0, 0, 1], 1, (0, 1)),  # the best single turn, not the last one
    ([0.3, 0.2], 4, (0, 2)),  # fewer turns than the window: keep them all
    ([1, 2], 2, (0, 2)),  # exactly the window
    ([], 3, (0, 0)),
    ([1, 2, 3], 0, (3, 3)),  # window 0: a fresh start
    ([float("nan"), 0.5, None, 0.2], 2, (0, 2)),  # NaN/None count 0: sums 0.5, 0.5, 0.2 -> earliest tie
])
def test_best_window_by_hand(rewards, window, expected):
    assert best_window(rewards, window) == expected


@pytest.mark.parametrize("rewards, window, expected", [
    ([1, 0, 1, 0], 2, (2, 4)), ([0, 0, 0], 1, (2, 3)), ([float("nan"), 0.5, None, 0.2], 2, (1, 3))])
def test_ties_can_go_to_the_latest_window(rewards, window, expected):
    assert best_window(rewards, window, ties="latest") == expected


@pytest.mark.parametrize("num_turns, window, iterations, counts, expected", [
    (5, 4, 10, True, [5] + [1] * 9),  # the paper's STTS: 14 turns, never more than 5 in a context
    (5, 4, 10, False, [5] * 10),  # every round adds num_turns: 50 turns
    (5, 2, 3, True, [5, 3, 3]),
    (3, 9, 3, True, [3, 1, 1]),  # the window holds every earlier turn: still one new turn per round
    (2, 4, 3, True, [2, 1, 1]),  # round 1 keeps both earlier turns (fewer than the window)
    (5, 0, 3, True, [5, 5, 5]),  # window 0: independent restarts
])
def test_round_turns(num_turns, window, iterations, counts, expected):
    assert round_turns(num_turns, window, iterations, counts) == expected


def test_best_window_rejects_negative_window():
    with pytest.raises(ValueError, match="window"):
        best_window([1.0], -1)


def _row(response, reward, verdict, **kw):
    return {"response": response, "reward": reward, "verdict": verdict, "correct": verdict == "correct",
            "compiled": verdict in ("correct", "incorrect"), "hacks": [], **kw}


def test_context_messages_keep_the_best_window_renumbered():
    task = load_bundled([1])[0]
    turns = [_row("answer A", 0.0, "compile_error", error="SyntaxError: boom"),
             _row("answer B", 0.6, "correct", speedup=1.2, ref_ms=1.2, candidate_ms=1.0),
             _row("answer C", 0.0, "format_error", error="no code"),
             _row("answer D", 0.1, "incorrect", max_abs_err=0.5)]
    head = first_turn_messages(task)

    one = context_messages(task, turns, 1)  # B alone is best
    assert one[:2] == head and len(one) == 4
    assert one[2] == {"role": "assistant", "content": "answer B"}
    assert one[3] == {"role": "user", "content": feedback_message(turns[1], 1)}
    assert one[3]["content"].startswith("Evaluation of your answer (turn 1)") and "verdict: correct" in one[3]["content"]

    two = context_messages(task, turns, 2)  # sums 0.6, 0.6, 0.1: the earlier of the tied windows, A B
    assert [m["content"] for m in two[2::2]] == ["answer A", "answer B"]
    assert two[5]["content"] == feedback_message(turns[1], 2) and "(turn 2)" in two[5]["content"]
    latest = context_messages(task, turns, 2, ties="latest")
    assert [m["content"] for m in latest[2::2]] == ["answer B", "answer C"]

    assert context_messages(task, turns, 0) == head  # fresh start
    assert [m["content"] for m in context_messages(task, turns, 9)[2::2]] == ["answer A", "answer B", "answer C",
                                                                               "answer D"]


def _m(sample, turn, speedup=None):
    """A metrics row: level 0, problem 1, 2 turns per round; speedup None = a failure."""
    ok = speedup is not None
    return {"level": 0, "problem_id": 1, "sample": sample, "turn": turn, "iteration": turn // 2,
            "verdict": "correct" if ok else "incorrect", "correct": ok, "compiled": True,
            "speedup": speedup, "hacks": [], "triton_time_share": None}


def test_iteration_metrics_by_hand():
    rows = [_m(0, 0), _m(0, 1, 1.5), _m(0, 2), _m(0, 3),  # sample 0: correct only in round 0
            _m(1, 0), _m(1, 1), _m(1, 2, 2.5), _m(1, 3, 1.1)]  # sample 1: correct only in round 1
    per = iteration_metrics(rows, [(0, 1)], samples=2, turns_per_round=[2, 2])
    assert [p["iteration"] for p in per] == [0, 1]
    r0, r1 = per
    assert r0["last_turn"]["correct_rate"] == 0.5 and r0["last_turn"]["fast_1"] == 0.5
    assert r0["best"]["correct_rate"] == 0.5 and r0["best_so_far"]["correct_rate"] == 0.5
    # round 1's last turn: sample 0 fails, sample 1 is correct at 1.1x
    assert r1["last_turn"]["correct_rate"] == 0.5 and r1["last_turn"]["fast_1"] == 0.5
    assert r1["last_turn"]["fast_1.2"] == 0.0
    # round 1's best: only sample 1 (2.5x)
    assert r1["best"]["correct_rate"] == 0.5 and r1["best"]["fast_2"] == 0.5
    # best over every turn so far: 1.5x and 2.5x
    so_far = r1["best_so_far"]
    assert so_far["correct_rate"] == 1.0 and so_far["fast_1.2"] == 1.0 and so_far["fast_2"] == 0.5
    assert so_far["geomean_speedup"] == pytest.approx(math.sqrt(1.5 * 2.5))
    assert so_far["num_samples"] == 2 and so_far["num_missing"] == 0

    # a missing round counts as failure
    partial = iteration_metrics(rows[:4] + rows[4:6], [(0, 1)], samples=2, turns_per_round=[2, 2])
    assert partial[1]["last_turn"]["num_missing"] == 1 and partial[1]["best"]["correct_rate"] == 0.0

    table = format_iterations(per)
    lines = table.splitlines()
    assert len(lines) == 2 + 6 and "best_so_far" in lines[-1] and "100.0%" in lines[-1]


def test_iteration_metrics_with_one_new_turn_per_later_round():
    """Round 0: turns 0-1; round 1: turn 2 only (the kept window counted toward the turns)."""
    def row(sample, turn, iteration, speedup=None):
        return dict(_m(sample, turn, speedup), iteration=iteration)

    rows = [row(0, 0, 0), row(0, 1, 0), row(0, 2, 1, 2.5)]
    r0, r1 = iteration_metrics(rows, [(0, 1)], samples=1, turns_per_round=[2, 1])
    assert r0["last_turn"]["correct_rate"] == 0.0 and r1["last_turn"]["fast_2"] == 1.0
    assert r1["best_so_far"]["num_missing"] == 0 and r1["best_so_far"]["correct_rate"] == 1.0


def test_rollout_start_messages_must_match_trajectories():
    from drkernel.rollout import RolloutConfig, rollout

    task = load_bundled([1])[0]
    with pytest.raises(ValueError, match="start_messages"):
        rollout(None, None, [task], lambda pairs: [], RolloutConfig(num_generations=2),
                start_messages=[first_turn_messages(task)])
