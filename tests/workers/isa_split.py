"""Inductor's vector-ISA build check split between the local ranks, seen from a compile:
``torchrun --nproc-per-node 2 tests/workers/isa_split.py split``.

Each rank compiles a small FSDP model with Inductor in a fresh process (no list of valid ISAs
yet), trains one step and reports the ISA build check ``explain`` says it ran, the ISAs the CPU
reports in Inductor's order, and the list Inductor then holds. Rank 1's figures reach rank 0
through ``all_gather_object``.
"""

from __future__ import annotations

import re
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from graphshard.compiler.inductor_cpu import ISA_SPLIT_NOTE
from _runner import run_cases

NOTE = ISA_SPLIT_NOTE


def run(case: str) -> dict:
    from torch._inductor import cpu_vec_isa

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    # compiled afresh: a program loaded from an earlier run's cache would lower nothing, check nothing
    graphshard.compile(model, graphshard.Plan(mesh, {"": graphshard.FullyShard()}), lower="inductor",
                       program_cache=False)
    model(torch.randn(4, 16)).sum().backward()
    notes = [n for r in model._graphshard.explain for n in r.notes if n.startswith(NOTE)]
    mine = [re.sub(r" [\d.]+s$", "", part) for n in notes for part in n[len(NOTE):].split(", ")]
    flags = cpu_vec_isa.x86_isa_checker()
    reported = [str(i) for i in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]
    figures = {"notes": len(notes), "mine": mine, "reported": reported,
               "listed": [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, figures)
    return {"case": case, "ranks": ranks}


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
