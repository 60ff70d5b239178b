"""The vector-ISA check before the first C++ kernel.

By default local ranks split Inductor's own check (``inductor_cpu.share_isa_checks``): each builds
the ISAs it claims, and Inductor's list is then what it is without the split. Opt-in through
``CompileConfig.fast_isa_check`` (``inductor_cpu.inductor_cpu_settings``): graphshard checks only
the ISA Inductor will pick, starts that check when the joint graph is partitioned, and compiles
CPU code with Inductor told the check is done; by default it does none of that
(``test_kernel_batch.py``)."""

import os
import platform
import subprocess
import sys
import tempfile
from unittest import mock

import pytest
import torch
from torch._inductor import config as inductor_config

import graphshard
from _models import fsdp_plan, stack
from graphshard import _compat
from graphshard.compiler import inductor_cpu

x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the shortcut is x86-only")


def _env(cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    env.pop("ATEN_CPU_CAPABILITY", None)
    return env


def _picked(script: str, cache: str) -> str:
    out = subprocess.run([sys.executable, "-c", script], env=_env(cache), capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def inductors_own_check():
    """Inductor's own check of every ISA in a fresh process and cache, graphshard not imported:
    the ISA it picks and its list of valid ones."""
    own = ("from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list\n"
           "print(pick_vec_isa(), '|', ';'.join(map(str, valid_vec_isa_list())))")
    with tempfile.TemporaryDirectory() as cache:
        picked, listed = _picked(own, cache).split(" | ")
    return picked, listed.split(";") if listed else []


_SPLIT = """
import json, sys, torch
from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list
from graphshard.compiler import inductor_cpu
from graphshard.compiler.compile_share import SharedCompile
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=True)
store.set(f"ready{rank}", "1"); store.wait(["ready0", "ready1"])  # start together
mine = inductor_cpu.share_isa_checks(SharedCompile(store, "job/"), [torch.ones(1)])
again = inductor_cpu.share_isa_checks(SharedCompile(store, "job/"), [torch.ones(1)])  # Inductor has its list: nothing to do
print(json.dumps({"mine": sorted(mine), "again": again, "picked": str(pick_vec_isa()),
                  "listed": [str(i) for i in valid_vec_isa_list()]}))
store.set(f"done{rank}", "1"); store.wait(["done0", "done1"])
"""


@x86
def test_ranks_split_inductors_check_and_get_its_own_list(inductors_own_check):
    # Two processes on one fresh cache, as two local ranks: each builds the ISAs it claims, and
    # Inductor's list and pick in each are those of Inductor's own check in an untouched cache.
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as cache:
        procs = [subprocess.Popen([sys.executable, "-c", _SPLIT, str(rank), str(port)], env=_env(cache),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    picked, listed = inductors_own_check
    candidates = [str(i) for i in _compat.inductor_cpu_vec_isa().supported_vec_isa_list
                  if all(f in _compat.inductor_cpu_vec_isa().x86_isa_checker() for f in str(i).split())]
    assert listed, "Inductor finds no valid vector ISA here: nothing to split"
    # every ISA the CPU reports built once, by one rank; both ranks took a share where there are two
    # to take (an AVX2-only CPU reports one: one rank builds it, the other waits for it)
    assert sorted(outs[0]["mine"] + outs[1]["mine"]) == sorted(candidates)
    assert sum(bool(out["mine"]) for out in outs) == min(2, len(candidates)), outs
    for out in outs:
        assert out["listed"] == listed and out["picked"] == picked
        assert out["again"] == {}


@x86
def test_graphshards_compile_splits_the_check_between_its_ranks(inductors_own_check):
    # the same through graphshard.compile on 2 gloo ranks: explain notes each rank's share, the
    # shares are apart and cover every ISA the CPU reports, and Inductor's list is its own
    from _launch import torchrun

    (result,) = torchrun("isa_split.py", ["split"], nproc=2)
    ranks = result["ranks"]
    # a note on each rank that took a share: both, unless the CPU reports a single ISA
    assert sorted(r["notes"] for r in ranks) == ([0, 1] if len(ranks[0]["reported"]) == 1 else [1, 1]), ranks
    assert sorted(ranks[0]["mine"] + ranks[1]["mine"]) == sorted(ranks[0]["reported"]), ranks
    assert all(r["listed"] == inductors_own_check[1] for r in ranks), (ranks, inductors_own_check)


def test_split_declines_when_inductor_is_told_or_has_checked():
    class NoClaims:
        def claim(self, digest):
            raise AssertionError(f"claimed {digest}")

    cpu = [torch.ones(1)]
    assert inductor_cpu.share_isa_checks(NoClaims(), [torch.ones(1, device="meta"), 3]) == {}  # no CPU work
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        assert inductor_cpu.share_isa_checks(NoClaims(), cpu) == {}
    listed = _compat.inductor_cpu_vec_isa().valid_vec_isa_list
    listed()  # this process's list, as after its first C++ kernel
    assert inductor_cpu.share_isa_checks(NoClaims(), cpu) == {}


@x86
def test_inductor_picks_the_same_isa_after_graphshards_check(inductors_own_check):
    # Each in a fresh process: Inductor's own check of every ISA, and graphshard's check of the
    # one it picks followed by Inductor's pick under the setting it returns.
    ours = ("from graphshard.compiler import inductor_cpu\n"
            "from torch._inductor import config\n"
            "from torch._inductor.cpu_vec_isa import pick_vec_isa\n"
            "settings = inductor_cpu.inductor_cpu_settings()\n"
            "assert settings == {'cpp.vec_isa_ok': True}, settings\n"
            "with config.patch(settings):\n"
            "    print(pick_vec_isa())\n")
    expected = inductors_own_check[0]
    assert expected not in ("", "INVALID_VEC_ISA")
    with tempfile.TemporaryDirectory() as cache:
        assert _picked(ours, cache) == expected


def test_declines_when_another_isa_is_asked_for():
    for asked in (mock.patch.dict(os.environ, {"ATEN_CPU_CAPABILITY": "default"}),
                  inductor_config.patch({"cpp.simdlen": 256}),
                  inductor_config.patch({"cpp.vec_isa_ok": False})):
        with asked:
            assert inductor_cpu._picked_isa() is None
            assert inductor_cpu.inductor_cpu_settings() == {}


def test_cpu_compile_starts_the_check_and_compiles_with_it():
    events = []
    warmup, compile_region = inductor_cpu.inductor_cpu_warmup, _compat.inductor_compile_region
    partition = _compat.inductor_partition_fn

    def record_partition(*args, **kwargs):
        events.append("partition")
        return partition(*args, **kwargs)

    def record_warmup():
        events.append("warmup")
        return warmup()

    def record_region(*args, **kwargs):
        events.append(("region", inductor_config.cpp.vec_isa_ok))
        return compile_region(*args, **kwargs)

    with (mock.patch.object(inductor_cpu, "inductor_cpu_warmup", record_warmup),
          mock.patch.object(_compat, "inductor_partition_fn", record_partition),
          mock.patch.object(_compat, "inductor_compile_region", record_region)):
        model = stack()
        graphshard.compile(model, fsdp_plan(), lower="inductor", fast_isa_check=True)
        model(torch.randn(4, 8)).sum().backward()
    # Started at the partition, before the first region compiles; every region compiles
    # with the check's outcome.
    regions = [e for e in events if e not in ("warmup", "partition")]
    assert events[:2] == ["warmup", "partition"] and regions
    # what Inductor's own check finds on this machine, not graphshard's: a usable vector ISA means
    # every region compiled told the check is done (True); none means graphshard left it alone (None)
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    assert set(regions) == {("region", True if pick_vec_isa() else None)}
