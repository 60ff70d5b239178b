"""torch's own tensor-parallel test models, under graphshard's ``parallelize_module``:
``torchrun --nproc-per-node 2 tests/workers/peer_dtensor.py CASE ...``.

The models, the plans and the helpers' own ``Transformer.parallelize`` come from
``torch.testing._internal.distributed._tensor.common_dtensor`` (``Transformer``/``ModelArgs``,
``MLPModule``, ``MLPStacked``, ``TensorParallelForExpert``). ``Transformer.parallelize`` calls the
``parallelize_module`` and styles of its module's namespace; the graphshard run calls the same
function's code with graphshard's names in its globals (`rebound`), nothing in torch is changed.

Each case builds one model (seeded), copies it three ways and trains each for two SGD steps on the
same batches:

- the single process on the whole batch (the unsharded model);
- torch's ``parallelize_module`` (the helpers' code as it is);
- graphshard's ``parallelize_module`` (lowered as ``GS_TEST_LOWER`` says, tests/_coverage_share.py).

It reports the worst difference of the outputs, losses, every gradient and every parameter (each
gathered whole) of graphshard against the single process and against torch's TP, and of torch's
TP against the single process; NaN and inf count as infinite (`_compare`). A case graphshard
refuses reports the exception. Rank 0 prints one JSON line per case.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import time
import traceback
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor import parallel as ttp
from torch.testing._internal.distributed._tensor import common_dtensor as cd

from _compare import scalar_err, tensor_err, worst
from _runner import lowering, run_cases
from graphshard import tensor_parallel as gtp

STEPS = 2
BATCH, SEQ = 8, 8


def rebound(fn, names: dict):
    """``fn`` (a function of torch's test helpers) with ``names`` in place of its module's globals:
    the same code, calling graphshard's ``parallelize_module`` and styles."""
    return types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__)


def graphshard_names() -> dict:
    lower = {} if lowering() == "inductor" else {"lower": lowering()}  # parallelize_module's default: Inductor
    return {"parallelize_module": functools.partial(gtp.parallelize_module, **lower),
            "ColwiseParallel": gtp.ColwiseParallel, "RowwiseParallel": gtp.RowwiseParallel,
            "SequenceParallel": gtp.SequenceParallel, "PrepareModuleInput": gtp.PrepareModuleInput,
            "PrepareModuleOutput": gtp.PrepareModuleOutput}


TORCH_NAMES = {"parallelize_module": ttp.parallelize_module, "ColwiseParallel": ttp.ColwiseParallel,
               "RowwiseParallel": ttp.RowwiseParallel, "SequenceParallel": ttp.SequenceParallel,
               "PrepareModuleInput": ttp.PrepareModuleInput, "PrepareModuleOutput": ttp.PrepareModuleOutput}


# ------------------------------------------------------------------------------------------------
# Ways to parallelize: each takes (model, mesh, names) where names are torch's or graphshard's
# ------------------------------------------------------------------------------------------------
def helpers(seq: bool, local_attn: bool = False):
    """The helpers' own ``Transformer.parallelize`` (root first, then each block, then the output)."""
    def apply(model, mesh, names):
        rebound(cd.Transformer.parallelize, names)(model, mesh, use_seq_parallel=seq, local_output_for_attn=local_attn)
    return apply


def block_plan(s, layer, seq: bool) -> dict:
    """The helpers' per-block plan (``Transformer.parallelize``'s), in the styles of ``s``."""
    plan = {}
    if seq:
        plan["attention"] = s["PrepareModuleInput"](input_layouts=Shard(1), desired_input_layouts=Replicate())
        plan["attention_norm"] = s["SequenceParallel"]()
        plan["ffn_norm"] = s["SequenceParallel"]()
    for w in ("wq", "wk", "wv"):
        plan[f"attention.{w}"] = s["ColwiseParallel"](use_local_output=False)
    plan["attention.wo"] = s["RowwiseParallel"](output_layouts=Shard(1)) if seq else s["RowwiseParallel"]()
    if layer.has_experts:
        plan["expert_layer.experts"] = (cd.TensorParallelForExpert(input_layouts=Shard(0), output_layouts=Shard(0))
                                        if seq else cd.TensorParallelForExpert())
    else:
        plan["feed_forward.w1"] = s["ColwiseParallel"](input_layouts=Shard(1)) if seq else s["ColwiseParallel"]()
        plan["feed_forward.w2"] = s["RowwiseParallel"](output_layouts=Shard(1)) if seq else s["RowwiseParallel"]()
    return plan


def reverse_order(model, mesh, s):
    """The helpers' plan with the calls the other way round: each block, the output, then the root."""
    for layer in model.layers:
        s["parallelize_module"](layer, mesh, block_plan(s, layer, False))
    s["parallelize_module"](model.output, mesh, s["ColwiseParallel"](output_layouts=Replicate()))
    s["parallelize_module"](model, mesh, {
        "tok_embeddings": s["RowwiseParallel"](input_layouts=Replicate(), output_layouts=Replicate()),
        "pos_embeddings": s["RowwiseParallel"](input_layouts=Replicate(), output_layouts=Replicate())})


def one_call(seq: bool):
    """The helpers' plan in one call on the root (``layers.*``), as a reference for the split calls."""
    def apply(model, mesh, s):
        plan = {f"layers.{i}.{k}": v for i, layer in enumerate(model.layers)
                for k, v in block_plan(s, layer, seq).items()}
        if seq:
            plan.update({"tok_embeddings": s["RowwiseParallel"](input_layouts=Replicate(), output_layouts=Shard(1)),
                         "pos_embeddings": s["RowwiseParallel"](input_layouts=Replicate(), output_layouts=Shard(0)),
                         "norm": s["SequenceParallel"](),
                         "output": s["ColwiseParallel"](input_layouts=Shard(1), output_layouts=Replicate())})
        else:
            plan.update({"tok_embeddings": s["RowwiseParallel"](input_layouts=Replicate(), output_layouts=Replicate()),
                         "pos_embeddings": s["RowwiseParallel"](input_layouts=Replicate(), output_layouts=Replicate()),
                         "output": s["ColwiseParallel"](output_layouts=Replicate())})
        s["parallelize_module"](model, mesh, plan)
    return apply


def loss_parallel_plan(model, mesh, s):
    """torch's loss-parallel recipe on the helpers' model: logits stay sharded on the vocabulary (a
    DTensor), cross-entropy under ``loss_parallel()``."""
    s["parallelize_module"](model, mesh, {
        "tok_embeddings": s["RowwiseParallel"](input_layouts=Replicate(), output_layouts=Replicate()),
        "pos_embeddings": s["RowwiseParallel"](input_layouts=Replicate(), output_layouts=Replicate())})
    for layer in model.layers:
        s["parallelize_module"](layer, mesh, block_plan(s, layer, False))
    s["parallelize_module"](model.output, mesh, s["ColwiseParallel"](use_local_output=False))


def mlp(model, mesh, s):
    s["parallelize_module"](model, mesh, {"net1": s["ColwiseParallel"](), "net2": s["RowwiseParallel"]()})


def mlp_sp(model, mesh, s):
    """torch's sequence-parallel MLP (test_tp_examples): each rank passes its own rows."""
    s["parallelize_module"](model, mesh, {"net1": s["ColwiseParallel"](input_layouts=Shard(0)),
                                          "net2": s["RowwiseParallel"](output_layouts=Shard(0))})


def mlp_stacked(model, mesh, s):
    """MLPStacked, one call per layer (the blocks are parallelized after one another)."""
    for layer in model.layers:
        s["parallelize_module"](layer, mesh, {"net1": s["ColwiseParallel"](), "net2": s["RowwiseParallel"]()})


class DoubledOutput(ttp.ParallelStyle):
    """A user style whose output_fn is no redistribution (it doubles the output): torch runs it."""

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, output_fn=lambda mod, out, mesh: out * 2)


def odd_hook(model, mesh, s):
    s["parallelize_module"](model, mesh, {"net1": s["ColwiseParallel"](), "net2": DoubledOutput()})


def expert_style(model, mesh, s):
    """The helpers' TensorParallelForExpert alone, on an ExpertLayer."""
    s["parallelize_module"](model, mesh, {"experts": cd.TensorParallelForExpert()})


# ------------------------------------------------------------------------------------------------
# Cases: model, how to parallelize, input kind (tokens or features, and how ranks hold them), loss
# ------------------------------------------------------------------------------------------------
def transformer(**kw):
    return lambda: cd.Transformer(cd.ModelArgs(dropout_p=0.0, **kw))


CASES = {
    # the helpers' own Transformer.parallelize: tied weights (its default) and untied, TP and SP
    "helpers_tp": (transformer(), helpers(False), "tokens"),
    "helpers_sp": (transformer(), helpers(True), "tokens"),
    "helpers_tp_untied": (transformer(weight_tying=False), helpers(False), "tokens"),
    "helpers_sp_untied": (transformer(weight_tying=False), helpers(True), "tokens"),
    # the helpers' per-block calls in the other order, and all in one call
    "reverse_order": (transformer(), reverse_order, "tokens"),
    "one_call_tp": (transformer(), one_call(False), "tokens"),
    "one_call_sp": (transformer(), one_call(True), "tokens"),
    # local q/k/v outputs with the model's head count set to the local one (torch's recipe)
    "helpers_local_attn": (transformer(weight_tying=False), helpers(False, local_attn=True), "tokens"),
    "helpers_local_attn_sp": (transformer(), helpers(True, local_attn=True), "tokens"),
    # the helpers' user-defined style: experts under TP, and under SP
    "helpers_experts_tp": (transformer(num_experts=2), helpers(False), "tokens"),
    "helpers_experts_sp": (transformer(num_experts=2), helpers(True), "tokens"),
    "expert_style": (lambda: cd.ExpertLayer(2, 16, 32), expert_style, "features3"),
    # loss_parallel on vocabulary-sharded DTensor logits
    "loss_parallel": (transformer(weight_tying=False), loss_parallel_plan, "tokens_loss_parallel"),
    # MLPModule / MLPStacked
    "mlp": (lambda: cd.MLPModule("cpu"), mlp, "features"),
    "mlp_sp": (lambda: cd.MLPModule("cpu"), mlp_sp, "features_rows"),
    "mlp_stacked": (lambda: cd.MLPStacked("cpu"), mlp_stacked, "features"),
    # a user style graphshard cannot read as layouts
    "odd_hook": (lambda: cd.MLPModule("cpu"), odd_hook, "features"),
}


def _batch(kind: str, step: int):
    g = torch.Generator().manual_seed(10 + step)
    if kind.startswith("tokens"):
        tokens = torch.randint(0, 8, (BATCH, SEQ), generator=g)
        return tokens, torch.randint(0, 8, (BATCH, SEQ), generator=g)
    shape = (BATCH, SEQ, 16) if kind == "features3" else (BATCH * 2, 10)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _loss(kind: str, out, target, rows: int):
    """Cross-entropy of the tokens, or the squared error summed over this rank's rows and divided by
    all ``rows``: the ranks' losses add up to the single process's mean."""
    if kind.startswith("tokens"):
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))
    return ((out - target) ** 2).sum() / (rows * out[0].numel())


def _train(model, kind: str, sharded: bool) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, losses, grads = [], [], None
    for step in range(STEPS):
        x, y = _batch(kind, step)
        n = x.shape[0]
        rows = sharded and kind == "features_rows"
        if rows:  # each rank passes its rows, and gets its rows back
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        ctx = gtp.loss_parallel() if sharded and kind == "tokens_loss_parallel" else contextlib.nullcontext()
        with ctx:
            out = model(x)
            loss = _loss(kind, out, y, n)
            loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        out = out.full_tensor() if isinstance(out, DTensor) else out.detach()
        if rows:
            pieces = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(pieces, out.contiguous())
            out = torch.cat(pieces)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        outs.append(out.detach())
        losses.append(float(loss.detach()))
        if grads is None:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"outs": outs, "losses": losses, "grads": grads,
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "names": [n for n, _ in model.named_parameters()]}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _errs(a: dict, b: dict) -> dict:
    def d(x, y):
        if list(x) != list(y):
            return float("inf")
        return worst(tensor_err(x[k], y[k]) if x[k].shape == y[k].shape else float("inf") for k in x)

    return {"out": worst(tensor_err(x, y) for x, y in zip(a["outs"], b["outs"])),
            "loss": worst(scalar_err(x, y) for x, y in zip(a["losses"], b["losses"])),
            "grad": d(a["grads"], b["grads"]), "param": d(a["params"], b["params"])}


def _message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1200]


def run(name: str) -> dict:
    make, parallelize, kind = CASES[name]
    torch._dynamo.reset()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = make()
    theirs, ours = copy.deepcopy(ref), copy.deepcopy(ref)
    result = {"case": name, "lowering": lowering()}
    single = _train(ref, kind, sharded=False)
    try:
        parallelize(theirs, mesh, TORCH_NAMES)
        t = _train(theirs, kind, sharded=True)
        result["torch"] = _errs(t, single)
    except Exception as e:  # torch's own TP cannot run this case on a CPU
        t = None
        result["torch_error"] = _message(e)[:400]
    start = time.perf_counter()
    try:
        parallelize(ours, mesh, graphshard_names())
        o = _train(ours, kind, sharded=True)
    except Exception as e:
        result["refused"] = _message(e)
        result["traceback"] = traceback.format_exc()[-3000:]
        return result
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["ours"] = _errs(o, single)
    if t is not None:
        result["ours_vs_torch"] = _errs(o, t)
    result["same_names"] = o["names"] == single["names"]
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731 (DTensors: the whole shape)
    result["same_state_dict"] = shapes(ours) == shapes(ref)
    result["dtensors"] = sorted(n for n, p in ours.named_parameters() if isinstance(p, DTensor))
    result["torch_dtensors"] = sorted(n for n, p in theirs.named_parameters() if isinstance(p, DTensor))
    states = [m._graphshard for m in ours.modules() if "_graphshard" in m.__dict__]  # a model per compiled call
    result["compiled"] = len(states)
    result["fallbacks"] = sorted({f for s in states for r in s.explain for f in r.fallbacks})
    return result


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
