"""Model-coverage worker: ``torchrun --nproc-per-node N tests/workers/coverage.py CASE ...``.

Each CASE is ``arch:strategy:lower`` (``tests/workers/hf_archs.py`` lists the archs):

- ``fsdp``: ``FullyShard`` on each module of a class in the model's ``_no_split_modules``,
  plus the root, on a 1-D "dp" mesh of every rank;
- ``tp``: the architecture's tensor-parallel plan on a 1-D "tp" mesh;
- ``fsdp_tp``: both in one ``Plan`` on a 2x2 ("dp", "tp") mesh (4 ranks);
- ``lower``: ``inductor`` (regional, the default), ``whole`` (Inductor on each whole graph,
  ``regional=False``) or ``eager``;
- an optional fourth field ``ac``: HF's own switch for activation checkpointing,
  ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``,
  on the model before sharding and on the single-process reference; the case then also needs
  the compiled backward to recompute (``explain``'s count of recomputed ops); with a further
  ``nocache``, ``config.use_cache = False`` as HF's warning under checkpointing advises; with
  ``reentrant``, HF's default form ``gradient_checkpointing_enable()`` (torch's reentrant checkpoint);
  with ``hf``, the name HF documents from transformers 5.24 on, ``activation_checkpointing_enable()``
  (non-reentrant by default; skipped where transformers lacks it), and with a further ``every2``
  its ``every_n_layers=2`` on 4 blocks: checkpointed and plain blocks interleaved;
- a flag ``nccl``: ``Plan(collectives="nccl")``, the collectives a GPU (NCCL) run issues, on gloo
  (lowered by region, each unit's gather then runs in place, `lowering.InPlaceGather`);
- a flag ``deep``: 4 blocks instead of 2, so that blocks repeat and are traced once
  (``trace_once``, ``graphshard.compiler.outline``); the result's ``trace_once`` is explain's line,
  ``dynamo_regions`` and ``dynamo_bodies`` what dynamo shared (``graphshard.compiler.regions``).

Each case trains the model for STEPS steps of SGD with momentum on its rank's slice of
the global batch and compares the loss per step (averaged over the data-parallel ranks)
and every gathered parameter with a single-process run on the whole global batch; it
also counts dynamo graphs after the first step (must be none). Rank 0 prints one
JSON line per case: ``ok`` with the diffs, or the error's class and first line.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import graphshard
import hf_archs
from _compare import dict_err, seq_err
from _runner import run_cases
from graphshard import tensor_parallel as gtp
from graphshard._compat import dynamo_counters

STEPS = 3
PER_RANK = 2
TOL = 1e-5


def plan_for(arch: str, strategy: str, model: torch.nn.Module, world: int, collectives: str = "auto"):
    """The plan and the data-parallel (world, rank) the batch is split over."""
    fsdp = {fqn: graphshard.FullyShard() for fqn in hf_archs.unit_fqns(model)}
    fsdp[""] = graphshard.FullyShard()
    if strategy == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        return graphshard.Plan(mesh, fsdp, collectives=collectives), world, dist.get_rank()
    styles = hf_archs.tp_styles(arch, gtp)
    if strategy == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return graphshard.Plan(mesh, styles, collectives=collectives), 1, 0
    assert strategy == "fsdp_tp" and world == 4, "fsdp_tp runs on 4 ranks (a 2x2 mesh)"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return graphshard.Plan(mesh, {**styles, **fsdp}, collectives=collectives), 2, mesh.get_local_rank("dp")


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in model.named_parameters()}


def train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for inputs in batches:
        loss = hf_archs.loss_of(model(**inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def run_case(case: str) -> dict:
    arch, strategy, lower, *flags = case.split(":")
    torch._dynamo.reset()
    counters = dynamo_counters()
    counters.clear()
    world = dist.get_world_size()
    start = time.perf_counter()
    ref = hf_archs.build(arch, layers=4 if "deep" in flags or "every2" in flags else None)
    if "ac" in flags:
        if not ref.supports_gradient_checkpointing:
            return {"case": case, "ok": False, "skipped": f"{type(ref).__name__} has no gradient checkpointing"}
        if "hf" in flags:  # the name HF documents from 5.24 on, with its own options
            if not hasattr(ref, "activation_checkpointing_enable"):
                return {"case": case, "ok": False, "skipped": "this transformers has no activation_checkpointing_enable"}
            ref.activation_checkpointing_enable(every_n_layers=2 if "every2" in flags else 1)
        elif "reentrant" in flags:  # HF's default form (torch's reentrant checkpoint)
            ref.gradient_checkpointing_enable()
        else:
            ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if "nocache" in flags:
            ref.config.use_cache = False
    model = copy.deepcopy(ref)
    plan, dp_world, dp_rank = plan_for(arch, strategy, model, world, "nccl" if "nccl" in flags else "auto")
    # The program cache is on (the default): the suite run twice on one TORCHINDUCTOR_CACHE_DIR
    # checks every loaded program against the single process. GS_TEST_PROGRAM_CACHE=0 turns it off.
    cached = os.environ.get("GS_TEST_PROGRAM_CACHE", "1") != "0"
    if lower == "whole":
        graphshard.compile(model, plan, lower="inductor", regional=False, program_cache=cached)
    else:
        graphshard.compile(model, plan, lower=lower, program_cache=cached)
    batches = [hf_archs.batch(arch, step, PER_RANK * dp_world) for step in range(STEPS)]
    mine = [{k: v[dp_rank * PER_RANK:(dp_rank + 1) * PER_RANK] for k, v in b.items()} for b in batches]
    graphs_after_first = None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step, inputs in enumerate(mine):
        loss = hf_archs.loss_of(model(**inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if step == 0:
            graphs_after_first = int(counters["stats"]["unique_graphs"])
    new_graphs = int(counters["stats"]["unique_graphs"]) - graphs_after_first
    seconds = time.perf_counter() - start
    t = torch.stack(losses)
    dist.all_reduce(t)
    losses = (t / world).tolist()  # every model-parallel rank of a data-parallel group has the same loss
    ref_losses = [l.item() for l in train(ref, batches)]
    mine_p, ref_p = full_params(model), full_params(ref)
    assert list(mine_p) == list(ref_p), (list(mine_p), list(ref_p))
    param_err, worst = dict_err(mine_p, ref_p)
    loss_err = seq_err(losses, ref_losses)
    fallbacks = sorted({f for r in model._graphshard.explain for f in r.fallbacks})
    eager = sorted({model._graphshard.params[k].layout.unit or model._graphshard.params[k].fqn
                    for k in model._graphshard.eager_reads})
    recomputed = sum(r.recompute.get("ops", 0) for r in model._graphshard.explain)
    ok = loss_err <= TOL and param_err <= TOL and new_graphs == 0 and (recomputed > 0 or "ac" not in flags)
    return {"case": case, "ok": ok, "recomputed_ops": recomputed, "losses": losses, "loss_err": loss_err, "param_err": param_err, "worst_param": worst,
            "new_graphs": new_graphs, "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted({r.split("\n")[0][:200] for r in counters["graph_break"]}),
            "fallbacks": fallbacks, "eager_units": eager, "seconds": round(seconds, 1),
            "trace_once": [n for r in model._graphshard.explain for n in r.notes if n.startswith("trace once")],
            "program_cache": [n for r in model._graphshard.explain for n in r.notes if n.startswith("program cache")],
            "dynamo_regions": model._graphshard.dynamo_regions.lines if model._graphshard.dynamo_regions else [],
            "dynamo_bodies": [list(r.dynamo_bodies) for r in model._graphshard.explain]}


def _root_cause(e: BaseException) -> BaseException:
    """The error a compile failure wraps (dynamo's BackendCompilerFailed says only which backend)."""
    while True:
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None or inner is e:
            return e
        e = inner


def run(case: str) -> dict:
    try:
        result = run_case(case)
    except Exception as e:  # noqa: BLE001 - the table records the error class; the run goes on
        root = _root_cause(e)
        result = {"case": case, "ok": False, "error": type(root).__name__,
                  "message": (str(root).strip().splitlines() or [""])[0][:300],
                  "traceback": traceback.format_exc()[-6000:]}
    # A case that failed on one rank only must not leave the others in a collective.
    oks = [None] * dist.get_world_size()
    dist.all_gather_object(oks, result.get("error"))
    if any(oks) and not result.get("error"):
        result.update(ok=False, error="PeerFailed", message=f"another rank raised {next(e for e in oks if e)}")
    return result


if __name__ == "__main__":
    run_cases(sys.argv[1:], run, timeout=datetime.timedelta(minutes=10))
