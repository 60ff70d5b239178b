"""The vector-ISA check before the first C++ kernel (``inductor_cpu.inductor_cpu_settings``, opt-in
through ``CompileConfig.fast_isa_check``): graphshard checks only the ISA Inductor will pick,
starts that check when the joint graph is partitioned, and compiles CPU code with Inductor
told the check is done. By default it does none of this (``test_kernel_batch.py``)."""

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


def _picked(script: str, cache: str) -> str:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    env.pop("ATEN_CPU_CAPABILITY", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


@x86
def test_inductor_picks_the_same_isa_after_graphshards_check():
    # Each in a fresh process: Inductor's own check of every ISA, and graphshard's check of the
    # one it picks followed by Inductor's pick under the setting it returns.
    own = "from torch._inductor.cpu_vec_isa import pick_vec_isa; print(pick_vec_isa())"
    ours = ("from graphshard.compiler import inductor_cpu\n"
            "from torch._inductor import config\n"
            "from torch._inductor.cpu_vec_isa import pick_vec_isa\n"
            "settings = inductor_cpu.inductor_cpu_settings()\n"
            "assert settings == {'cpp.vec_isa_ok': True}, settings\n"
            "with config.patch(settings):\n"
            "    print(pick_vec_isa())\n")
    with tempfile.TemporaryDirectory() as cache:
        expected = _picked(own, cache)
        assert expected not in ("", "INVALID_VEC_ISA")
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
