"""A fault on one rank ends the job on every rank, within a stated bound, with a message naming the cause.

Each case is a 2-rank job of its own (tests/workers/faults.py: a graphshard-compiled model, rank 1
misbehaving at step 2). Bounds, from the moment rank 1 reaches the fault:

- rank 1 raises or is killed: rank 0 ends at once with gloo's "Connection closed (or reset) by peer ... Check
  the logs of the remote worker" (torchrun then stops it); torchrun's summary names rank 1 and its error or signal;
- rank 1 stalls: rank 0 ends after the process group's timeout (``init_process_group(timeout=...)``, here
  `PG_TIMEOUT` s; torch's default is 30 minutes for gloo and 10 for NCCL), with the timeout in its message;
- rank 1 is fed another shape under tensor parallelism, or runs another plan: every rank raises
  `graphshard.CollectiveMismatch` before the first collective, naming both sides.

The bounds asserted here are hang detectors with slack for a loaded machine, not performance figures;
the closing notes give the measured times.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from _launch import launch

PG_TIMEOUT = 10
SLACK = 20  # seconds: process start-up and torchrun's reaction on a loaded 2-core machine
FULL_ONLY = ("killed", "plan")  # `plan` is also tests/test_collective_check.py's; both run under --coverage full


def _job(case: str):
    t0 = time.perf_counter()
    _, proc = launch("faults.py", [case], nproc=2, timeout=PG_TIMEOUT + 240, env={"GS_PG_TIMEOUT": str(PG_TIMEOUT)})
    outcomes = {}
    decoder = json.JSONDecoder()
    for found in re.finditer("OUTCOME ", proc.stdout):  # two ranks' lines may share one line of the merged output
        o, _ = decoder.raw_decode(proc.stdout, found.end())
        outcomes[o["rank"]] = o
    return proc, outcomes, time.perf_counter() - t0


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["raise", "killed", "stall", "shape", "plan"])
def test_a_fault_on_one_rank_ends_every_rank_with_its_cause(case):
    proc, outcomes, seconds = _job(case)
    assert proc.returncode != 0, "the job must fail"
    assert "TimeoutError: the job ran past" not in proc.stderr, proc.stderr[-3000:]
    summary = proc.stderr.split("Root Cause (first observed failure):", 1)
    assert len(summary) == 2, proc.stderr[-3000:]  # torchrun's own report of which rank failed first
    if case in ("raise", "killed"):
        peer = outcomes[0]
        # gloo's words vary with the moment the socket closed: "Connection closed by peer" or "Read error ...
        # Connection reset by peer", both followed by "Check the logs of the remote worker"
        assert re.search(r"Connection (closed|reset) by peer", peer["error"]) and peer["after"] < SLACK, peer
        if case == "raise":
            assert "injected fault: rank 1 raised" in outcomes[1]["error"], outcomes
            assert "injected fault: rank 1 raised" in proc.stderr, proc.stderr[-3000:]  # the traceback, in the log
        else:
            assert 1 not in outcomes and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]  # SIGKILL, as torchrun says
    elif case == "stall":
        waited = outcomes[0]
        assert f"Timed out waiting {PG_TIMEOUT * 1000}ms" in waited["error"], waited
        assert PG_TIMEOUT - 1 <= waited["after"] < PG_TIMEOUT + SLACK, waited
    else:
        assert set(outcomes) == {0, 1}, outcomes  # every rank ends on its own, with the same error
        assert all(o["error"].startswith("CollectiveMismatch: graphshard: ranks 0 and 1") for o in outcomes.values())
        assert outcomes[0]["message"] == outcomes[1]["message"], outcomes
        # another shape: 5 s from the fault (the call); another plan differs from the first step on, so its time
        # counts that step's compile, which a loaded machine stretches
        assert all(o["after"] < (5 if case == "shape" else SLACK) for o in outcomes.values()), outcomes
        named = "inputs of other shapes" if case == "shape" else "would issue different collectives"
        assert named in outcomes[0]["message"], outcomes[0]["message"]
