"""The sequence state machine (only the transitions in the table, and never leaving RUNNING with blocks), and its
token slices."""

from __future__ import annotations

import pytest

from fleetllm.engine.sampling import SamplingParams
from fleetllm.engine.sequence import TRANSITIONS, InvalidTransition, Sequence, Status

FINISHED = [s for s in Status if s.finished]


def seq_in(status: Status) -> Sequence:
    s = Sequence("r", [1, 2, 3], SamplingParams(), max_tokens=4)
    s.status = status
    return s


ALLOWED = [(a, b) for a, targets in TRANSITIONS.items() for b in sorted(targets, key=lambda s: s.name)]  # a set: fixed order
FORBIDDEN = [(a, b) for a in Status for b in Status if (a, b) not in ALLOWED]


@pytest.mark.parametrize(("old", "new"), ALLOWED, ids=lambda s: s.name)
def test_allowed_transitions_succeed_without_blocks(old: Status, new: Status) -> None:
    s = seq_in(old)
    s.transition(new)
    assert s.status is new


@pytest.mark.parametrize(("old", "new"), FORBIDDEN, ids=lambda s: s.name)
def test_forbidden_transitions_raise(old: Status, new: Status) -> None:
    s = seq_in(old)
    with pytest.raises(InvalidTransition):
        s.transition(new)
    assert s.status is old


def test_finished_states_are_final() -> None:
    for f in FINISHED:
        assert f not in TRANSITIONS or not TRANSITIONS[f]


def test_a_waiting_sequence_cannot_finish_normally() -> None:
    for reason in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH):
        with pytest.raises(InvalidTransition):
            seq_in(Status.WAITING).transition(reason)


@pytest.mark.parametrize("new", [Status.PREEMPTED, *FINISHED], ids=lambda s: s.name)
def test_leaving_running_with_blocks_held_raises(new: Status) -> None:
    s = seq_in(Status.RUNNING)
    s.block_table = [0, 1]
    with pytest.raises(InvalidTransition, match="blocks held"):
        s.transition(new)
    assert s.status is Status.RUNNING


def test_becoming_running_with_blocks_is_allowed() -> None:
    s = seq_in(Status.WAITING)
    s.block_table = [0]
    s.transition(Status.RUNNING)
    assert s.status is Status.RUNNING


def test_finished_reports_only_the_finished_states() -> None:
    assert {s for s in Status if s.finished} == {
        Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, Status.FINISHED_ABORTED, Status.FINISHED_ERROR,
    }


@pytest.mark.parametrize(("start", "end"), [(0, 2), (1, 3), (2, 5), (3, 4), (4, 5), (0, 5)])
def test_a_token_slice_spans_prompt_and_output_alike(start: int, end: int) -> None:
    s = Sequence("r", [1, 2, 3], SamplingParams(), max_tokens=4)
    s.output_token_ids = [7, 8]
    assert s.token_ids_slice(start, end) == [1, 2, 3, 7, 8][start:end]
