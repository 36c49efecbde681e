"""The step phases' booking rules (engine/step/phases.py): what the executor's dispatch and a worker's `between`
take, so the served phases add up to the step's wall time without counting a wait twice."""

from __future__ import annotations

import pytest

from engine.step.phases import BETWEEN, DISPATCH, HOST, book_between, book_dispatch


def test_between_is_the_workers_time_from_its_last_result_or_the_plans_sending() -> None:
    phases: dict[str, float] = {}
    # The plan was queued before the worker returned its last result (asynchronous scheduling): the worker's
    # time between the two steps is all channel work.
    book_between(phases, started=10.3, last_returned=10.0, sent_at=9.5, sent_host=HOST)
    assert phases[BETWEEN] == pytest.approx(0.3)
    # The router sent the plan late: the wait before it is the router's, only the plan's trip is the worker's.
    book_between(phases, started=10.3, last_returned=10.0, sent_at=10.25, sent_host=HOST)
    assert phases[BETWEEN] == pytest.approx(0.05)


@pytest.mark.parametrize("sent_at,host", [(0.0, HOST), (9.5, "another-host")])
def test_between_is_not_booked_without_a_comparable_clock(sent_at: float, host: str) -> None:
    phases: dict[str, float] = {}
    book_between(phases, started=10.3, last_returned=10.0, sent_at=sent_at, sent_host=host)
    assert BETWEEN not in phases


def test_dispatch_is_what_the_booked_phases_leave_of_the_wall_time() -> None:
    phases = {"propose": 0.004, "verify": 0.006, BETWEEN: 0.001}
    book_dispatch(phases, 0.0125)
    assert phases[DISPATCH] == pytest.approx(0.0015)
    short = {"verify": 0.006}
    book_dispatch(short, 0.005)  # clocks of two processes: never negative
    assert short[DISPATCH] == 0.0
