"""A multi-rank test job whose ranks disagree fails in seconds to minutes, not at the launcher's limit;
a job past that limit still reports the cases it finished."""

from __future__ import annotations

import time

import pytest

from _launch import launch, run_cases

pytestmark = pytest.mark.multirank


def test_a_rank_that_never_joins_a_collective_fails_the_job_at_the_timeout():
    t0 = time.perf_counter()
    results, proc = launch("hang.py", ["5"], nproc=2, timeout=300)
    seconds = time.perf_counter() - t0
    assert proc.returncode != 0 and not results, proc.stdout[-2000:]
    assert seconds < 120, seconds  # the 5 s collective timeout ended it, not rank 1's 600 s sleep
    assert "timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower(), proc.stderr[-3000:]


def test_a_case_that_takes_its_job_down_fails_alone():
    results = run_cases("fails.py", ["ok:a", "raise:b", "ok:c"], nproc=2, timeout=300)
    assert results["ok:a"]["sum"] == results["ok:c"]["sum"] == 2.0  # the job was launched again for ok:c
    with pytest.raises(AssertionError, match=r"raise:b took its job down: .*case raise:b raised"):
        results["raise:b"]


def test_a_job_past_its_limit_keeps_what_it_printed_and_fails_the_case_it_was_in():
    results = run_cases("fails.py", ["ok:a", "sleep:b", "ok:c"], nproc=2, timeout=30)
    assert results["ok:a"]["sum"] == results["ok:c"]["sum"] == 2.0  # printed before the limit; launched again
    with pytest.raises(AssertionError, match=r"sleep:b took its job down: TimeoutError: the job ran past its 30 s limit"):
        results["sleep:b"]


def test_a_rank_that_dies_fails_the_case_it_was_in_with_its_own_stack():
    # rank 0 records the lost connection for abort:b and would for every case after it; those
    # run again in a job of their own, and abort:b's failure shows the dead rank's stack
    results = run_cases("fails.py", ["ok:a", "abort:b", "ok:c", "ok:d"], nproc=2, timeout=300)
    assert results["ok:a"]["sum"] == results["ok:c"]["sum"] == results["ok:d"]["sum"] == 2.0
    with pytest.raises(AssertionError, match=r"(?s)abort:b took its job down: .*Fatal Python error: Aborted.*fails\.py"):
        results["abort:b"]
