"""Tensor-parallel layout sweep: ``torchrun --nproc-per-node 2 tests/workers/tp_layouts.py CASE ...``.

Each CASE names a small model, a plan over it (torch's styles or graphshard's, the same
arguments) and how every rank holds each graph input: whole (``R``) or its own piece
(``S(d)``: the single process gets the pieces concatenated). The case runs

- the single process on the whole input,
- torch's ``parallelize_module`` with torch's styles,
- graphshard (``graphshard.compile(model, Plan(mesh, plan), lower=...)``, or
  ``graphshard.tensor_parallel.parallelize_module`` for the ``parallelize`` cases),

for two steps of SGD, and compares each rank's output with the piece of the single process's
output that torch's layout says the rank holds (or a DTensor's ``full_tensor()``), the loss,
every gradient and every parameter. The loss is ``sum(out * W)`` over the logical output, each
rank adding its own piece's share (a replicated output counts once).

A case graphshard refuses reports the exception; the test checks its message. Rank 0 prints one
JSON line per case.
"""

from __future__ import annotations

import copy
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import graphshard
from _compare import scalar_err, tensor_err, worst
from _runner import run_cases
from graphshard import tensor_parallel as gtp

R = Replicate()


# ------------------------------------------------------------------------------------------------
# Models: each passes its graph inputs straight into the module the plan names, unless the case is
# about what happens when it does not.
# ------------------------------------------------------------------------------------------------
class MLPModule(nn.Module):
    """torch's own test MLP (``common_dtensor.MLPModule``), imported when torch's test tree has it."""

    def __new__(cls):
        from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule as TorchMLP

        return TorchMLP("cpu")


class Lin(nn.Module):
    def __init__(self, i=10, o=6):
        super().__init__()
        self.lin = nn.Linear(i, o)

    def forward(self, x):
        return self.lin(x)


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids):
        return self.emb(ids)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x)


class Block(nn.Module):
    """An MLP whose forward takes an optional keyword tensor added to its output."""

    def __init__(self):
        super().__init__()
        self.net1, self.net2 = nn.Linear(10, 16), nn.Linear(16, 10)

    def forward(self, x, y=None):
        out = self.net2(torch.relu(self.net1(x)))
        return out if y is None else out + y


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, y=None):
        return self.block(x) if y is None else self.block(x, y=y)


class OuterTwo(Outer):
    def forward(self, x, y):
        return self.block(x, y)


class Act(nn.Module):
    """A module without parameters (what PrepareModuleOutput declares is the root input's)."""

    def forward(self, x):
        return torch.tanh(x)


class ActThenLin(nn.Module):
    def __init__(self):
        super().__init__()
        self.act, self.lin = Act(), nn.Linear(10, 6)

    def forward(self, x):
        return self.lin(self.act(x))


class ScaledMLP(nn.Module):
    """Computes on its input before the column-parallel layer: the layer's input is no graph input."""

    def __init__(self):
        super().__init__()
        self.net1, self.net2 = nn.Linear(10, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x * 2)))


class ResidualMLP(nn.Module):
    """Uses its input inside and outside the column-parallel layer."""

    def __init__(self):
        super().__init__()
        self.net1, self.net2 = nn.Linear(10, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x))) + x


class MeanMLP(nn.Module):
    """Reads its input outside the column-parallel layer too (a mean, which fits any row count)."""

    def __init__(self):
        super().__init__()
        self.net1, self.net2 = nn.Linear(10, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x))) + x.mean()


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------
@dataclass
class Case:
    model: Callable[[], nn.Module]
    plan: Callable  # styles module -> {fqn: style}
    inputs: list  # per graph input: (global shape or ("ids", shape, vocab), how a rank holds it)
    out: object  # the local layout torch returns (Replicate/Shard), or "dtensor"
    kwargs: dict = field(default_factory=dict)  # keyword graph inputs: name -> (shape, layout)
    lower: str = "eager"
    frontend: str = "plan"
    step_shapes: tuple | None = None  # the first input's global shape at each step, where it changes
    run_torch: bool = True  # False: torch's TP takes the process down on this case


def _c(model, plan, inputs, out, **kw) -> Case:
    return Case(model, plan, inputs, out, **kw)


X10 = (16, 10)  # an activation of 16 rows of 10 features, as one process holds it
CASES: dict[str, Case] = {
    # torch's sequence-parallel MLP test (test_tp_examples): each rank feeds its own 8 rows
    "mlp_sp": _c(MLPModule, lambda s: {"net1": s.ColwiseParallel(input_layouts=Shard(0)),
                                       "net2": s.RowwiseParallel(output_layouts=Shard(0))},
                 [(X10, Shard(0))], Shard(0), frontend="parallelize", lower="inductor"),
    "mlp_sp_eager": _c(MLPModule, lambda s: {"net1": s.ColwiseParallel(input_layouts=Shard(0)),
                                             "net2": s.RowwiseParallel(output_layouts=Shard(0))},
                       [(X10, Shard(0))], Shard(0)),
    "mlp_tp": _c(MLPModule, lambda s: {"net1": s.ColwiseParallel(), "net2": s.RowwiseParallel()},
                 [(X10, R)], R),
}


def _add_cases() -> None:
    """The sweep: every style x every layout argument value where it means something."""
    # ColwiseParallel.input_layouts on a graph input: None (Replicate), Replicate, Shard(0), Shard(1)
    for name, lay, held in [("none", None, R), ("r", R, R), ("s0", Shard(0), Shard(0)), ("s1", Shard(1), Shard(1)),
                            ("sm1", Shard(-1), Shard(1))]:
        CASES[f"col_in_{name}"] = _c(
            MLPModule, lambda s, lay=lay: {"net1": s.ColwiseParallel(**({} if lay is None else {"input_layouts": lay})),
                                           "net2": s.RowwiseParallel()},
            [(X10, held)], R)
    # ColwiseParallel.output_layouts x use_local_output on the model's output
    for name, lay, local_out in [("none", None, Shard(1)), ("sm1", Shard(-1), Shard(1)), ("s0", Shard(0), Shard(0)),
                                 ("r", R, R)]:
        for local in (True, False):
            CASES[f"col_out_{name}_{'local' if local else 'dt'}"] = _c(
                Lin, lambda s, lay=lay, local=local: {"lin": s.ColwiseParallel(
                    **({} if lay is None else {"output_layouts": lay}), use_local_output=local)},
                [(X10, R)], local_out if local else "dtensor")
    # ColwiseParallel's output feeding RowwiseParallel: the declared layouts agree
    CASES["col_r_row_r"] = _c(MLPModule, lambda s: {"net1": s.ColwiseParallel(output_layouts=R),
                                                    "net2": s.RowwiseParallel(input_layouts=R)}, [(X10, R)], R)
    CASES["col_dt_row"] = _c(MLPModule, lambda s: {"net1": s.ColwiseParallel(use_local_output=False),
                                                   "net2": s.RowwiseParallel()}, [(X10, R)], R)
    # RowwiseParallel.input_layouts on a graph input: None (Shard(-1): each rank feeds its features), Replicate
    for name, lay, held in [("none", None, Shard(1)), ("r", R, R), ("sm1", Shard(-1), Shard(1)), ("s1", Shard(1), Shard(1)),
                            ("s0", Shard(0), Shard(0))]:
        CASES[f"row_in_{name}"] = _c(
            Lin, lambda s, lay=lay: {"lin": s.RowwiseParallel(**({} if lay is None else {"input_layouts": lay}))},
            [(X10, held)], R)
    # RowwiseParallel.output_layouts x use_local_output
    for name, lay, local_out in [("none", None, R), ("r", R, R), ("s0", Shard(0), Shard(0)), ("s1", Shard(1), Shard(1))]:
        for local in (True, False):
            CASES[f"row_out_{name}_{'local' if local else 'dt'}"] = _c(
                MLPModule, lambda s, lay=lay, local=local: {
                    "net1": s.ColwiseParallel(),
                    "net2": s.RowwiseParallel(**({} if lay is None else {"output_layouts": lay}), use_local_output=local)},
                [(X10, R)], local_out if local else "dtensor")
    # Embeddings: ColwiseParallel (embedding dim), RowwiseParallel (vocabulary), ids whole or batch-sharded
    ids = ("ids", (4, 6), 16)
    CASES["emb_col"] = _c(Emb, lambda s: {"emb": s.ColwiseParallel()}, [(ids, R)], Shard(2))
    CASES["emb_col_out_r"] = _c(Emb, lambda s: {"emb": s.ColwiseParallel(output_layouts=R)}, [(ids, R)], R)
    CASES["emb_col_in_s0"] = _c(Emb, lambda s: {"emb": s.ColwiseParallel(input_layouts=Shard(0))}, [(ids, Shard(0))],
                                Shard(2))
    CASES["emb_row"] = _c(Emb, lambda s: {"emb": s.RowwiseParallel(input_layouts=R)}, [(ids, R)], R)
    # torch's default input_layouts is Shard(-1) for an embedding too: each rank passes its own positions
    CASES["emb_row_default"] = _c(Emb, lambda s: {"emb": s.RowwiseParallel()}, [(ids, Shard(1))], R)
    CASES["emb_row_out_s1"] = _c(Emb, lambda s: {"emb": s.RowwiseParallel(input_layouts=R, output_layouts=Shard(1))},
                                 [(ids, R)], Shard(1))
    CASES["emb_row_in_s0"] = _c(Emb, lambda s: {"emb": s.RowwiseParallel(input_layouts=Shard(0))}, [(ids, Shard(0))], R)
    # SequenceParallel: sequence_dim x use_local_output, the input each rank's piece of the sequence
    x3 = (4, 6, 8)
    CASES["sp_dt"] = _c(Norm, lambda s: {"norm": s.SequenceParallel()}, [(x3, Shard(1))], "dtensor")
    CASES["sp_local"] = _c(Norm, lambda s: {"norm": s.SequenceParallel(use_local_output=True)}, [(x3, Shard(1))], Shard(1))
    CASES["sp_dim0_local"] = _c(Norm, lambda s: {"norm": s.SequenceParallel(sequence_dim=0, use_local_output=True)},
                                [((6, 8), Shard(0))], Shard(0))
    # PrepareModuleInput on the block that holds the column/row-parallel pair
    inner = lambda s, **col: {"block.net1": s.ColwiseParallel(**col), "block.net2": s.RowwiseParallel()}  # noqa: E731
    pmi = [("s0_r_dt", Shard(0), R, False, Shard(0), {}), ("s0_r_local", Shard(0), R, True, Shard(0), {}),
           ("r_r", R, R, False, R, {}), ("s0_s0_local", Shard(0), Shard(0), True, Shard(0), {"input_layouts": Shard(0)}),
           ("r_s0_dt", R, Shard(0), False, R, {"input_layouts": Shard(0)}),
           ("s1_r_local", Shard(1), R, True, Shard(1), {})]
    for name, given, desired, local, held, col in pmi:
        CASES[f"pmi_{name}"] = _c(
            Outer, lambda s, given=given, desired=desired, local=local, col=col: {
                "block": s.PrepareModuleInput(input_layouts=(given,), desired_input_layouts=(desired,),
                                              use_local_output=local), **inner(s, **col)},
            [(X10, held)], R)
    # a positional input left alone (None): torch passes it as it is, here the whole tensor on every rank
    CASES["pmi_none_entry"] = _c(
        OuterTwo, lambda s: {"block": s.PrepareModuleInput(input_layouts=(Shard(0), None),
                                                           desired_input_layouts=(R, None), use_local_output=True),
                             **inner(s)},
        [(X10, Shard(0)), ((16, 10), R)], R)
    CASES["pmi_kwarg"] = _c(
        Outer, lambda s: {"block": s.PrepareModuleInput(
            input_layouts=(R,), desired_input_layouts=(R,), input_kwarg_layouts={"y": Shard(0)},
            desired_input_kwarg_layouts={"y": R}, use_local_output=True), **inner(s)},
        [(X10, R)], R, kwargs={"y": (X10, Shard(0))})
    # PrepareModuleOutput on the block: output_layouts -> desired_output_layouts, use_local_output
    pmo = [("r_s0_local", R, Shard(0), True, Shard(0), {}), ("r_s0_dt", R, Shard(0), False, "dtensor", {}),
           ("s0_r_local", Shard(0), R, True, R, {"output_layouts": Shard(0)}),
           ("s0_s1_local", Shard(0), Shard(1), True, Shard(1), {"output_layouts": Shard(0)})]
    for name, given, desired, local, out, row in pmo:
        CASES[f"pmo_{name}"] = _c(
            Outer, lambda s, given=given, desired=desired, local=local, row=row: {
                "block": s.PrepareModuleOutput(output_layouts=(given,), desired_output_layouts=(desired,),
                                               use_local_output=local),
                "block.net1": s.ColwiseParallel(), "block.net2": s.RowwiseParallel(**row)},
            [(X10, R)], out)
    # Refused by graphshard (torch runs each; what it computes is said in tests/test_tp_layouts.py)
    CASES["refuse_pmo_data"] = _c(ActThenLin, lambda s: {
        "act": s.PrepareModuleOutput(output_layouts=(Shard(0),), desired_output_layouts=(R,)),
        "lin": s.ColwiseParallel(output_layouts=R)}, [(X10, Shard(0))], R)
    CASES["refuse_computed_input"] = _c(ScaledMLP, lambda s: {"net1": s.ColwiseParallel(input_layouts=Shard(0)),
                                                              "net2": s.RowwiseParallel(output_layouts=Shard(0))},
                                        [(X10, Shard(0))], Shard(0))
    CASES["refuse_input_read_outside"] = _c(MeanMLP, lambda s: {"net1": s.ColwiseParallel(input_layouts=Shard(0)),
                                                                "net2": s.RowwiseParallel(output_layouts=Shard(0))},
                                            [(X10, Shard(0))], Shard(0))
    CASES["refuse_input_used_outside"] = _c(ResidualMLP, lambda s: {"net1": s.ColwiseParallel(input_layouts=Shard(0)),
                                                                    "net2": s.RowwiseParallel(output_layouts=Shard(0))},
                                            [(X10, Shard(0))], Shard(0))
    # Pieces of different sizes (9 rows: 5 and 4), and a row count that changes between steps
    sp_plan = lambda s: {"net1": s.ColwiseParallel(input_layouts=Shard(0)),  # noqa: E731
                         "net2": s.RowwiseParallel(output_layouts=Shard(0))}
    CASES["refuse_uneven_rows"] = _c(MLPModule, sp_plan, [((9, 10), Shard(0))], Shard(0), run_torch=False)
    CASES["refuse_dynamic_rows"] = _c(MLPModule, sp_plan, [(X10, Shard(0))], Shard(0), step_shapes=((16, 10), (12, 10)))
    # an Inductor-lowered pair among the sweep's
    CASES["pmi_s0_r_dt_inductor"] = dataclass_replace(CASES["pmi_s0_r_dt"], lower="inductor")


def dataclass_replace(case: Case, **kw) -> Case:
    import dataclasses

    return dataclasses.replace(case, **kw)


_add_cases()


# ------------------------------------------------------------------------------------------------
# Running a case
# ------------------------------------------------------------------------------------------------
def _piece(t: torch.Tensor, layout, world: int, rank: int) -> torch.Tensor:
    return t.chunk(world, dim=layout.dim % t.dim())[rank] if isinstance(layout, Shard) else t


def _global_inputs(case: Case, step: int):
    g = torch.Generator().manual_seed(100 + step)

    def make(shape):
        if shape[0] == "ids":
            return torch.randint(0, shape[2], shape[1], generator=g)
        return torch.randn(shape, generator=g)

    shapes = [shape for shape, _ in case.inputs]
    if case.step_shapes is not None:
        shapes[0] = case.step_shapes[step]
    args = [make(shape) for shape in shapes]
    kwargs = {k: make(shape) for k, (shape, _) in case.kwargs.items()}
    return args, kwargs


def _local_inputs(case: Case, args, kwargs, world, rank):
    la = [_piece(a, lay, world, rank) for a, (_, lay) in zip(args, case.inputs)]
    lk = {k: _piece(v, case.kwargs[k][1], world, rank) for k, v in kwargs.items()}
    return la, lk


def _weight(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def _step_sharded(model, case: Case, step: int, world: int, rank: int):
    """One forward/backward of a tensor-parallel model; (output as the single process's shape, loss)."""
    args, kwargs = _global_inputs(case, step)
    la, lk = _local_inputs(case, args, kwargs, world, rank)
    out = model(*la, **lk)
    if case.out == "dtensor":
        if not isinstance(out, DTensor):
            raise AssertionError(f"expected a DTensor output, got {type(out).__name__}")
        full = out.full_tensor()
        loss = (full * _weight(full.shape)).sum()
        loss.backward()
        return full.detach(), float(loss)
    if isinstance(out, DTensor):
        raise AssertionError(f"expected a local tensor output, got a DTensor {out.placements}")
    # the logical output's shape, from the local piece and the layout torch returns
    shape = list(out.shape)
    if isinstance(case.out, Shard):
        shape[case.out.dim % out.dim()] *= world
    w = _piece(_weight(tuple(shape)), case.out, world, rank)
    local_loss = (out * w).sum()
    local_loss.backward()
    total = local_loss.detach().clone()
    if isinstance(case.out, Shard):
        dist.all_reduce(total)
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out.detach().contiguous())
    full = torch.cat(gathered, dim=case.out.dim % out.dim()) if isinstance(case.out, Shard) else out.detach()
    return full, float(total)


def _step_single(model, case: Case, step: int):
    args, kwargs = _global_inputs(case, step)
    out = model(*args, **kwargs)
    loss = (out * _weight(out.shape)).sum()
    loss.backward()
    return out.detach(), float(loss)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _train(model, step_fn) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, losses, grads = [], [], None
    for step in range(2):
        out, loss = step_fn(model, step)
        outs.append(out)
        losses.append(loss)
        if grads is None:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"outs": outs, "losses": losses, "grads": grads,
            "params": {n: _full(p) for n, p in model.named_parameters()}}


def _err(x: torch.Tensor, y: torch.Tensor) -> float:
    return tensor_err(x, y) if x.shape == y.shape else float("inf")  # a missing piece is a failure too


def _errs(a: dict, b: dict) -> dict:
    def d(x, y):
        if list(x) != list(y):
            return float("inf")
        return worst(_err(x[k], y[k]) for k in x)

    return {"out": worst(_err(x, y) for x, y in zip(a["outs"], b["outs"])),
            "shapes": [list(x.shape) for x in a["outs"][:1]],
            "loss": worst(scalar_err(x, y) for x, y in zip(a["losses"], b["losses"])),
            "grad": d(a["grads"], b["grads"]), "param": d(a["params"], b["params"])}


def _message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def run(name: str) -> dict:
    case = CASES[name]
    torch._dynamo.reset()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = case.model()
    theirs, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    single = _train(ref, lambda m, s: _step_single(m, case, s))
    result = {"case": name}
    from torch.distributed.tensor import parallel as ttp

    try:
        if not case.run_torch:  # gloo aborts the process on the size mismatch of torch's all-gather
            raise RuntimeError("not run: torch's TP aborts the process on this case")
        ttp.parallelize_module(theirs, mesh, case.plan(ttp))
        t = _train(theirs, lambda m, s: _step_sharded(m, case, s, world, rank))
        result["torch"] = _errs(t, single)
    except Exception as e:  # torch's own TP cannot run this plan
        t = None
        result["torch_error"] = _message(e)[:300]
    try:
        if case.frontend == "parallelize":
            assert case.lower == "inductor"
            gtp.parallelize_module(ours, mesh, case.plan(gtp))
        else:
            graphshard.compile(ours, graphshard.Plan(mesh, case.plan(gtp)), lower=case.lower)
        o = _train(ours, lambda m, s: _step_sharded(m, case, s, world, rank))
    except Exception as e:
        result["refused"] = _message(e)
        result["traceback"] = traceback.format_exc()[-3000:]
        return result
    result["ours"] = _errs(o, single)
    if t is not None:
        result["ours_vs_torch"] = _errs(o, t)
    result["fallbacks"] = sorted({f for r in ours._graphshard.explain for f in r.fallbacks})
    return result


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
