"""FSDP1 checkpoint-interchange worker: ``torchrun --nproc-per-node N tests/workers/fsdp1_state.py CASE ...``.

One user program (the small transformer, ``ModuleWrapPolicy({Block})``, AdamW, ``STEPS`` steps,
then a checkpoint, then one more step) runs with torch's FSDP1, graphshard's FSDP1 and unwrapped
on the global batch. Checkpoints written by each are loaded into fresh models of the others
(different initial values and, where the reader trains first, different optimizer state); the
reader's next step must give the uninterrupted run's loss and parameters. CASEs:

- ``full:<strategy>:<params>``: FULL_STATE_DICT and ``optim_state_dict`` (``rank0_only``,
  ``offload_to_cpu``), graphshard <-> torch <-> unwrapped; ``strict=False`` key lists.
- ``sharded:<params>:<dir>``: SHARDED_STATE_DICT through ``torch.distributed.checkpoint``,
  graphshard <-> torch both ways; leaves ``<dir>/{gs,torch}_<params>`` and ``<dir>/ref.pt``.
- ``reshard:<dir>``: at this world size, loads the checkpoints the ``sharded`` cases left.
- ``local:<params>:<dir>``: LOCAL_STATE_DICT save (``torch.save`` per rank) / load round trip.
- ``ignored:<params>``: FULL_STATE_DICT with ``rank0_only`` and an ignored module, beside torch's.
- ``legacy:<params>``: ``full_``/``sharded_optim_state_dict``, ``shard_``/``scatter_full_``,
  ``flatten_sharded_optim_state_dict``, ``rekey_optim_state_dict``.

``<params>`` is flat | orig (``use_orig_params``). Rank 0 prints one RESULT per case: ``err``
(largest differences, checked against a tolerance), ``ok`` (facts that must hold) and ``info``.

graphshard's models run their compiled graphs as FX (``lower="eager"``, a compile option the
wrapper passes on): what a checkpoint holds and loads does not depend on the lowering, and each
case compiles several fresh models, so Inductor here only added CI time. The same wrapper under
Inductor trains against the single process and torch's FSDP1 in ``tests/test_fsdp1.py``.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from _compare import tensor_err, worst
from _runner import run_cases
from graphshard.fsdp import FullyShardedDataParallel as GraphshardFSDP
from graphshard.testing.models import Block, Transformer, TransformerConfig, lm_loss, token_batch

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

SMALL = TransformerConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
GLOBAL_BATCH = 4
STEPS = 2
IMPLS = {"torch": TorchFSDP, "gs": GraphshardFSDP}
GS_OPTIONS = {"gs": {"lower": "eager"}}  # see the module docstring
BUFFERS = ("layers.0.scale", "offset")
FULL = StateDictType.FULL_STATE_DICT
SHARDED = StateDictType.SHARDED_STATE_DICT
LOCAL = StateDictType.LOCAL_STATE_DICT


# ---------------------------------------------------------------------------------------------
# the user's program
# ---------------------------------------------------------------------------------------------
def base(seed: int = 0) -> Transformer:
    """The model; ``seed`` != 0 for readers, so that a load that misses a value shows."""
    torch.manual_seed(seed)
    model = Transformer(SMALL)
    model.layers[0].register_buffer("scale", torch.arange(4.0) + seed)  # BUFFERS: one inside a unit
    model.register_buffer("offset", torch.full((3,), float(seed)))      # and one in the root
    return model


def wrap(impl: str, model, strategy: str = "full_shard", params: str = "flat"):
    return IMPLS[impl](model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                       sharding_strategy=ShardingStrategy[strategy.upper()], use_orig_params=params == "orig",
                       **hybrid_mesh(strategy), **GS_OPTIONS.get(impl, {}))


def hybrid_mesh(strategy: str) -> dict:
    """Hybrid sharding: shard over pairs of ranks, replicate across the pairs (a 2-D mesh)."""
    if "hybrid" not in strategy:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return {"device_mesh": init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))}


def adamw(model):
    """AdamW with eps=1e-3: at eps=1e-8 its g / (sqrt(v) + eps) turns float rounding in near-zero
    gradients into ~5e-5 parameter differences between any two correct runs (torch's FSDP1 vs the
    single process too); at 1e-3 two correct runs agree to ~2e-7, so 1e-5 tells load errors apart."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def step(model, opt, s: int, wrapped: bool = True, seed: int = 1) -> float:
    """One training step on the global batch of step ``s`` (each rank its slice when wrapped)."""
    x, y = token_batch(s, GLOBAL_BATCH, SMALL.max_seq_len, SMALL.vocab_size, seed=seed)
    if wrapped:
        per = GLOBAL_BATCH // dist.get_world_size()
        mine = slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)
        x, y = x[mine], y[mine]
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach().clone()
    if wrapped:
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss.item()


def train(impl: str | None, strategy="full_shard", params="flat", seed=0, steps=STEPS):
    model = base(seed) if impl is None else wrap(impl, base(seed), strategy, params)
    opt = adamw(model)
    for s in range(steps):
        step(model, opt, s, wrapped=impl is not None)
    return model, opt


def clone(tree):
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def full_sd(impl: str | None, model) -> dict:
    if impl is None:
        return clone(model.state_dict())
    with IMPLS[impl].state_dict_type(model, FULL, FullStateDictConfig(rank0_only=False),
                                     FullOptimStateDictConfig(rank0_only=False)):
        return clone(model.state_dict())


def full_osd(impl: str | None, model, opt, offload_to_cpu: bool = False) -> dict:
    """The optimizer state keyed by FQN with full tensors (unwrapped: torch's rekey by name).
    ``offload_to_cpu=False``: torch's FSDP1 gets it wrong on CPU devices with use_orig_params
    (TORCH_WRONG in tests/test_fsdp1_state.py)."""
    if impl is None:
        return clone(TorchFSDP.rekey_optim_state_dict(opt.state_dict(), OptimStateKeyType.PARAM_NAME, model))
    with IMPLS[impl].state_dict_type(model, FULL, FullStateDictConfig(rank0_only=False),
                                     FullOptimStateDictConfig(rank0_only=False, offload_to_cpu=offload_to_cpu)):
        return clone(IMPLS[impl].optim_state_dict(model, opt))


def ctx(impl: str, model, kind, rank0_only_optim: bool = False):
    if kind == FULL:
        return IMPLS[impl].state_dict_type(model, FULL, FullStateDictConfig(rank0_only=False),
                                           FullOptimStateDictConfig(rank0_only=rank0_only_optim,
                                                                    offload_to_cpu=impl == "gs"))
    return IMPLS[impl].state_dict_type(model, kind)


def load(impl: str | None, model, opt, sd: dict, osd: dict, kind=FULL, rank0_only_optim: bool = False):
    """The user's checkpoint load: model state, then the optimizer state through FSDP's converter.
    The checkpoint is copied first, as if read from a file: ``optim.load_state_dict`` keeps the
    ``step`` tensors it is given and steps them in place."""
    sd, osd = clone(sd), clone(osd)
    if impl is None:
        model.load_state_dict(sd)
        opt.load_state_dict(TorchFSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, model))
        return
    with ctx(impl, model, kind, rank0_only_optim):
        model.load_state_dict(sd)
        opt.load_state_dict(IMPLS[impl].optim_state_dict_to_load(model, opt, osd))


# ---------------------------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------------------------
class Result(dict):
    def __init__(self, case: str):
        super().__init__(case=case, err={}, ok={}, info={})

    def err(self, name: str, value: float, why: str = ""):
        self["err"][name] = value if math.isfinite(value) else 1e30
        if why:
            self["info"][name] = why

    def ok(self, name: str, value: bool, why=None):
        self["ok"][name] = bool(value)
        if not value and why is not None:
            self["info"][name] = str(why)[:2000]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def t_err(a, b) -> float:
    a, b = _full(a), _full(b)
    if tuple(a.shape) != tuple(b.shape):
        return math.inf
    return tensor_err(a, b)


def sd_err(a: dict, b: dict) -> tuple[float, str]:
    if set(a) != set(b):
        return math.inf, f"keys differ: {sorted(set(a) ^ set(b))}"
    return worst(t_err(a[k], b[k]) for k in b), ""


def osd_err(a: dict, b: dict) -> tuple[float, str]:
    """Largest state difference; inf if the FQNs, state names or param_groups (params as sets) differ."""
    if set(a["state"]) != set(b["state"]):
        return math.inf, f"state keys differ: {sorted(map(str, set(a['state']) ^ set(b['state'])))}"
    err = 0.0
    for k, sb in b["state"].items():
        sa = a["state"][k]
        if set(sa) != set(sb):
            return math.inf, f"{k}: state names {sorted(sa)} vs {sorted(sb)}"
        for n, vb in sb.items():
            err = worst([err, t_err(sa[n], vb) if torch.is_tensor(vb) else (0.0 if sa[n] == vb else math.inf)])
    groups = [[{**g, "params": sorted(g["params"])} for g in x["param_groups"]] for x in (a, b)]
    if groups[0] != groups[1]:
        return math.inf, f"param_groups differ: {groups[0]} vs {groups[1]}"
    return err, ""


def check_sd(r: Result, name: str, a, b):
    r.err(name, *sd_err(a, b))


def check_osd(r: Result, name: str, a, b):
    r.err(name, *osd_err(a, b))


def finish(r: Result, name: str, impl: str | None, model, opt, writer: dict):
    """The reader's next step equals the writer's uninterrupted one (loss and parameters)."""
    loss = step(model, opt, STEPS, wrapped=impl is not None)
    r.err(f"{name}: next-step loss", abs(loss - writer["loss3"]))
    check_sd(r, f"{name}: params after the next step", full_sd(impl, model), writer["sd3"])


def writer(impl: str | None, strategy="full_shard", params="flat", save=None) -> dict:
    """A writer's run: ``save(model, opt)`` after STEPS (its result under "saved"), its full
    state then, and its loss and parameters after one more step."""
    model, opt = train(impl, strategy, params)
    out = {"saved": save(model, opt) if save else None, "sd": full_sd(impl, model), "osd": full_osd(impl, model, opt)}
    out["loss3"] = step(model, opt, STEPS, wrapped=impl is not None)
    out["sd3"] = full_sd(impl, model)
    return out


def check_writers(r: Result, writers: dict):
    """Each wrapper's run against the single process (state, optimizer state, next step)."""
    u = writers["unwrapped"]
    for impl, w in writers.items():
        if impl != "unwrapped":
            check_sd(r, f"{impl} state dict vs unwrapped", w["sd"], u["sd"])
            check_osd(r, f"{impl} optim_state_dict vs unwrapped", w["osd"], u["osd"])
            r.err(f"{impl} next-step loss vs unwrapped", abs(w["loss3"] - u["loss3"]))
            check_sd(r, f"{impl} params after the next step vs unwrapped", w["sd3"], u["sd3"])


def no_wrapper_names(tree) -> bool:
    return "_fsdp_wrapped_module" not in repr(list(tree) if isinstance(tree, dict) else tree)


def on_every_rank(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------
def case_full(r: Result, strategy: str, params: str):
    other = "orig" if params == "flat" else "flat"

    def rank0_only(impl):
        def save(model, opt):
            # torch's FSDP1 offloads wrongly from CPU devices (see the end of this case): not asked to
            cfg = (FullStateDictConfig(rank0_only=True, offload_to_cpu=impl == "gs"),
                   FullOptimStateDictConfig(rank0_only=True, offload_to_cpu=impl == "gs"))
            with IMPLS[impl].state_dict_type(model, FULL, *cfg):
                out = clone(model.state_dict()), clone(IMPLS[impl].optim_state_dict(model, opt))
            if impl == "torch" and params == "orig":  # torch's default offload_to_cpu=True, for the record
                out += (full_osd(impl, model, opt, offload_to_cpu=True),)
            return out
        return save

    w = {"unwrapped": writer(None), "gs": writer("gs", strategy, params, rank0_only("gs")),
         "torch": writer("torch", strategy, params, rank0_only("torch"))}
    check_writers(r, w)
    g, t, u = w["gs"], w["torch"], w["unwrapped"]
    check_sd(r, "gs state dict vs torch", g["sd"], t["sd"])
    check_osd(r, "gs optim_state_dict vs torch", g["osd"], t["osd"])
    r.ok("gs state-dict keys: the user's, in order", list(g["sd"]) == list(u["sd"]), list(g["sd"]))
    r.ok("gs param_groups: torch's (same FQN order)", g["osd"]["param_groups"] == t["osd"]["param_groups"],
         (g["osd"]["param_groups"], t["osd"]["param_groups"]))
    r.ok("gs optim state: no wrapper names",
         no_wrapper_names(g["osd"]["state"]) and no_wrapper_names(g["osd"]["param_groups"]))
    # rank0_only + offload_to_cpu: rank 0 has everything on the CPU, the others what torch gives them
    (sd_g0, osd_g0), (sd_t0, osd_t0) = g["saved"], t["saved"][:2]
    if params == "orig":  # torch's defect: its optim_state_dict with offload_to_cpu=True (the default) on CPU
        check_osd(r, "torch optim_state_dict with offload_to_cpu=True vs unwrapped", t["saved"][2], u["osd"])
    if dist.get_rank() == 0:
        check_sd(r, "gs rank0_only state dict vs full", sd_g0, g["sd"])
        check_osd(r, "gs rank0_only optim_state_dict vs full", osd_g0, g["osd"])
        on_cpu = all(v.device.type == "cpu" and type(v) is torch.Tensor for v in sd_g0.values()) and all(
            v.device.type == "cpu" and type(v) is torch.Tensor for st in osd_g0["state"].values() for v in st.values())
        r.ok("gs offload_to_cpu: plain CPU tensors", on_cpu)
    others = on_every_rank(((type(sd_g0).__name__, len(sd_g0), osd_g0 == {}),
                            (type(sd_t0).__name__, len(sd_t0), osd_t0 == {})))
    r.ok("gs rank0_only: an empty OrderedDict and {} on the other ranks",
         all(o[0] == ("OrderedDict", 0, True) for o in others[1:]), others)
    r["info"]["rank0_only on the other ranks"] = {"gs": others[-1][0], "torch": others[-1][1]}
    # strict=False key lists: the user's FQNs, as torch's
    partial = {k: v for k, v in g["sd"].items() if k != "norm.weight"}
    partial["extra.weight"] = torch.zeros(1)
    lists = {}
    for impl in ("gs", "torch"):
        model = wrap(impl, base(3), strategy, params)
        with ctx(impl, model, FULL):
            res = model.load_state_dict(partial, strict=False)
        lists[impl] = (list(res.missing_keys), list(res.unexpected_keys))
    r.ok("gs strict=False missing/unexpected keys: torch's", lists["gs"] == lists["torch"], lists)
    r.ok("gs strict=False keys: the user's FQNs", lists["gs"] == (["norm.weight"], ["extra.weight"]), lists)
    readers = [  # (writer, its model state, its optimizer state, reader, reader's use_orig_params, rank0_only optim)
        ("gs", g["sd"], osd_g0, "torch", params, True),
        ("torch", t["sd"], osd_t0, "gs", other, True),
        ("gs", g["sd"], g["osd"], None, None, False),
        ("unwrapped", u["sd"], u["osd"], "gs", params, False),
        ("gs", g["sd"], g["osd"], "gs", other, False),
    ]
    for src, sd, osd, impl, p, r0 in readers:
        name = f"{src} ckpt -> {impl or 'unwrapped'}" + (f" ({p})" if impl else "")
        model = base(5) if impl is None else wrap(impl, base(5), strategy, p)
        opt = adamw(model)
        load(impl, model, opt, sd, osd, rank0_only_optim=r0)
        check_sd(r, f"{name}: state dict after load", full_sd(impl, model), w[src]["sd"])
        check_osd(r, f"{name}: optimizer state after load", full_osd(impl, model, opt), w[src]["osd"])
        finish(r, name, impl, model, opt, w[src])
    # under mixed precision the full state dict holds the parameters as stored (fp32), not param_dtype
    for impl in ("gs", "torch"):
        model = IMPLS[impl](base(0), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                            sharding_strategy=ShardingStrategy[strategy.upper()], use_orig_params=params == "orig",
                            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), **hybrid_mesh(strategy),
                            **GS_OPTIONS.get(impl, {}))
        check_sd(r, f"{impl} mixed precision: full state dict vs the fp32 model", full_sd(impl, model),
                 base(0).state_dict())
    # torch's defect: FULL_STATE_DICT with offload_to_cpu=True on a CPU device raises (both ranks
    # alike) with use_orig_params=False; with True it crashes the process (SIGSEGV), so not tried here
    if params == "orig":
        return
    model = wrap("torch", base(0), strategy, params)
    try:
        with TorchFSDP.state_dict_type(model, FULL, FullStateDictConfig(offload_to_cpu=True)):
            model.state_dict()
        r["info"]["torch offload_to_cpu on CPU"] = "works"
    except RuntimeError as e:
        r["info"]["torch offload_to_cpu on CPU"] = f"raises: {str(e)[:200]}"


def case_ignored(r: Result, params: str):
    """FULL_STATE_DICT with ``rank0_only`` and an ignored module: every rank keeps what FSDP does not
    manage (the ignored module's parameters), as torch's FSDP1; rank 0 has everything."""
    got = {}
    for impl in ("gs", "torch"):
        model = base()
        wrapped = IMPLS[impl](model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                              use_orig_params=params == "orig", ignored_modules=[model.layers[0].ffn],
                              **GS_OPTIONS.get(impl, {}))
        with IMPLS[impl].state_dict_type(wrapped, FULL, FullStateDictConfig(rank0_only=True)):
            got[impl] = clone(wrapped.state_dict())
    g, t = got["gs"], got["torch"]
    kept = on_every_rank(sorted(g))
    same_keys = on_every_rank((list(g), list(t)))
    r.ok("gs rank0_only keys: torch's, on every rank", all(a == b for a, b in same_keys), same_keys)
    r.ok("gs rank0_only: the other ranks keep the ignored module's parameters",
         all(ks and all(k.startswith("layers.0.ffn.") for k in ks) for ks in kept[1:]), kept)
    r.err("gs rank0_only state dict vs torch's, every rank", max(on_every_rank(sd_err(g, t)[0])))
    r["info"]["rank0_only keys on the last rank"] = kept[-1]


def case_sharded(r: Result, params: str, root: str):
    """Writers save with DCP; readers (own optimizer state first) load a checkpoint of the other kind."""
    other = "orig" if params == "flat" else "flat"

    def save(impl):
        def do(model, opt):
            with IMPLS[impl].state_dict_type(model, SHARDED):
                state = {"model": model.state_dict(), "optim": IMPLS[impl].optim_state_dict(model, opt)}
                dcp.save(state, checkpoint_id=os.path.join(root, f"{impl}_{params}"))
            kinds = {type(v).__name__ for k, v in state["model"].items() if k not in BUFFERS} | {
                type(v).__name__ for st in state["optim"]["state"].values() for n, v in st.items() if n != "step"}
            return kinds, list(state["model"]), no_wrapper_names(state["optim"]["state"])
        return do

    w = {"unwrapped": writer(None), "gs": writer("gs", "full_shard", params, save("gs")),
         "torch": writer("torch", "full_shard", params, save("torch"))}
    check_writers(r, w)
    kinds, keys, clean = w["gs"]["saved"]
    r.ok("gs sharded values are DTensors", kinds == {"DTensor"}, kinds)
    r.ok("gs sharded keys: the user's FQNs", keys == list(w["unwrapped"]["sd"]) and clean, keys)
    r["info"]["torch sharded value types"] = sorted(w["torch"]["saved"][0])
    if dist.get_rank() == 0:
        torch.save({f"{k}_{params}": {n: v for n, v in x.items() if n != "saved"} for k, x in w.items()},
                   os.path.join(root, f"ref_{params}.pt"))
    for src, impl, p in (("gs", "torch", params), ("torch", "gs", other), ("gs", "gs", other)):
        name = f"{src}_{params} -> {impl} ({p})"
        model, opt = train(impl, "full_shard", p, seed=5, steps=1)  # the reader has optimizer state of its own
        dcp_load(impl, model, opt, os.path.join(root, f"{src}_{params}"))
        check_sd(r, f"{name}: state dict after load", full_sd(impl, model), w[src]["sd"])
        check_osd(r, f"{name}: optim_state_dict after load", full_osd(impl, model, opt), w[src]["osd"])
        finish(r, name, impl, model, opt, w[src])


def dcp_load(impl: str, model, opt, path: str):
    with IMPLS[impl].state_dict_type(model, SHARDED):
        state = {"model": model.state_dict(), "optim": IMPLS[impl].optim_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(IMPLS[impl].optim_state_dict_to_load(model, opt, state["optim"]))


def case_reshard(r: Result, root: str):
    """The checkpoints of the 2-rank ``sharded`` cases, loaded at this world size."""
    ref = {**torch.load(os.path.join(root, "ref_flat.pt"), weights_only=False),
           **torch.load(os.path.join(root, "ref_orig.pt"), weights_only=False)}
    world = dist.get_world_size()
    for src, impl, p in (("gs_flat", "gs", "orig"), ("gs_orig", "gs", "flat"), ("torch_orig", "gs", "flat"),
                         ("gs_flat", "torch", "flat")):
        name = f"{src} (2 ranks) -> {impl} ({p}, {world} ranks)"
        model, opt = train(impl, "full_shard", p, seed=5, steps=1)
        dcp_load(impl, model, opt, os.path.join(root, src))
        check_sd(r, f"{name}: state dict after load", full_sd(impl, model), ref[src]["sd"])
        check_osd(r, f"{name}: optim_state_dict after load", full_osd(impl, model, opt), ref[src]["osd"])
        finish(r, name, impl, model, opt, ref[src])


def case_local(r: Result, params: str, root: str):
    path = os.path.join(root, f"local_{params}_rank{dist.get_rank()}.pt")

    def save(model, opt):
        with GraphshardFSDP.state_dict_type(model, LOCAL):
            sd, osd = model.state_dict(), GraphshardFSDP.optim_state_dict(model, opt)
            torch.save({"model": sd}, path)
            return list(sd), all(v.dim() == 1 for k, v in sd.items() if k.endswith("_flat_param")), clone(osd)

    g = writer("gs", "full_shard", params, save)
    keys, flat_1d, osd = g["saved"]
    tmodel = wrap("torch", base(0), "full_shard", params)
    with TorchFSDP.state_dict_type(tmodel, LOCAL):
        torch_keys = list(tmodel.state_dict())
    if params == "flat":  # with use_orig_params=True torch's LOCAL mixes flat parameters and views
        r.ok("gs LOCAL keys: torch's", keys == torch_keys, (keys, torch_keys))
    r.ok("gs LOCAL keys: no wrapper names", no_wrapper_names(keys), keys)
    r.ok("gs LOCAL flat shards are 1-D", flat_1d)
    reader, ropt = train("gs", "full_shard", params, seed=5, steps=1)
    with GraphshardFSDP.state_dict_type(reader, LOCAL):
        loaded = torch.load(path, weights_only=False)["model"]
        res = reader.load_state_dict({**{k: v for k, v in loaded.items() if k != "offset"}, "extra": torch.ones(1)},
                                     strict=False)
        r.ok("gs LOCAL strict=False keys", (res.missing_keys, res.unexpected_keys) == (["offset"], ["extra"]),
             (res.missing_keys, res.unexpected_keys))
        reader.load_state_dict(loaded)
        ropt.load_state_dict(GraphshardFSDP.optim_state_dict_to_load(reader, ropt, osd))
    check_sd(r, "LOCAL round trip: state dict", full_sd("gs", reader), g["sd"])
    check_osd(r, "LOCAL round trip: optimizer state", full_osd("gs", reader, ropt), g["osd"])
    finish(r, "LOCAL round trip", "gs", reader, ropt, g)


def case_legacy(r: Result, params: str):
    rank = dist.get_rank()

    def legacy(impl):
        def save(model, opt):
            return (clone(IMPLS[impl].full_optim_state_dict(model, opt)),
                    clone(IMPLS[impl].full_optim_state_dict(model, opt, rank0_only=False)),
                    clone(IMPLS[impl].sharded_optim_state_dict(model, opt)) if impl == "gs" else None,
                    rekey_wrapped(impl, model, opt))
        return save

    w = {"unwrapped": writer(None), "gs": writer("gs", "full_shard", params, legacy("gs")),
         "torch": writer("torch", "full_shard", params, legacy("torch"))}
    full0, full_all, sharded, rekeyed = w["gs"]["saved"]
    tfull0, tfull_all, _, trekeyed = w["torch"]["saved"]
    check_osd(r, "full_optim_state_dict(rank0_only=False) vs optim_state_dict", full_all, w["gs"]["osd"])
    check_osd(r, "full_optim_state_dict(rank0_only=False) vs torch's", full_all, tfull_all)
    check_osd(r, "full_optim_state_dict(rank0_only=False) vs unwrapped", full_all, w["unwrapped"]["osd"])
    if rank == 0:
        check_osd(r, "full_optim_state_dict (rank 0) vs torch's", full0, tfull0)
        check_osd(r, "full_optim_state_dict (rank 0) vs unwrapped", full0, w["unwrapped"]["osd"])
    others = on_every_rank((full0 == {}, tfull0 == {}))
    r.ok("full_optim_state_dict on other ranks: torch's ({})", all(a == b for a, b in others[1:]), others)
    r.ok("sharded_optim_state_dict: DTensors", all(isinstance(v, DTensor) for st in sharded["state"].values()
                                                   for n, v in st.items() if n != "step"))
    reader, ropt = train("gs", "full_shard", params, seed=5, steps=1)
    with GraphshardFSDP.state_dict_type(reader, FULL):
        reader.load_state_dict(w["gs"]["sd"])
    loads = {
        "shard_full_optim_state_dict": lambda: GraphshardFSDP.shard_full_optim_state_dict(full_all, reader, optim=ropt),
        "scatter_full_optim_state_dict": lambda: GraphshardFSDP.scatter_full_optim_state_dict(
            full0 if rank == 0 else None, reader, optim=ropt),
        "flatten_sharded_optim_state_dict": lambda: GraphshardFSDP.flatten_sharded_optim_state_dict(
            sharded, reader, ropt),
    }
    for name, convert in loads.items():
        for st in ropt.state.values():  # forget the previous load
            for v in st.values():
                v.zero_()
        ropt.load_state_dict(convert())
        check_osd(r, f"{name}: optimizer state after load", full_osd("gs", reader, ropt), w["gs"]["osd"])
    by_model = GraphshardFSDP.shard_full_optim_state_dict(full_all, reader)  # ids from model.parameters()
    r.ok("shard_full_optim_state_dict without optim: the same ids",
         sorted(by_model["state"]) == sorted(ropt.state_dict()["state"]))
    finish(r, "legacy loads", "gs", reader, ropt, w["gs"])
    # rekey_optim_state_dict against torch's: the unwrapped model both ways, the wrapped one by name
    umodel, uopt = train(None)
    by_id = uopt.state_dict()
    ours = GraphshardFSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, umodel)
    theirs = TorchFSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, umodel)
    check_osd(r, "rekey PARAM_NAME (unwrapped) vs torch's", ours, theirs)
    r.ok("rekey PARAM_NAME param_groups: torch's", ours["param_groups"] == theirs["param_groups"])
    back = GraphshardFSDP.rekey_optim_state_dict(ours, OptimStateKeyType.PARAM_ID, umodel, optim=uopt)
    r.ok("rekey PARAM_ID round trip",
         back["param_groups"] == by_id["param_groups"] and sorted(back["state"]) == sorted(by_id["state"]))
    check_osd(r, "rekey PARAM_ID round trip values", back, by_id)
    r["info"]["rekey of the wrapped model (gs, torch)"] = [str(rekeyed)[:300], str(trekeyed)[:300]]
    if params == "flat":  # a flat parameter has no one name: both refuse (torch RuntimeError, graphshard ValueError)
        r.ok("rekey of flat parameters refused, as torch", all(isinstance(x, str) for x in (rekeyed, trekeyed)))
    else:  # torch's rank holds state only for the parameters in its shard; graphshard's for all (local shards)
        r.ok("rekey of the wrapped model: torch's names", set(trekeyed[0]) <= set(rekeyed[0]) and
             rekeyed[0] == sorted(osd_names(w["unwrapped"]["osd"])) and rekeyed[1] == trekeyed[1], (rekeyed, trekeyed))


def osd_names(osd: dict) -> list[str]:
    return list(osd["state"])


def rekey_wrapped(impl: str, model, opt):
    try:
        keyed = IMPLS[impl].rekey_optim_state_dict(opt.state_dict(), OptimStateKeyType.PARAM_NAME, model, optim=opt)
        return (sorted(keyed["state"]), keyed["param_groups"][0]["params"])
    except (ValueError, RuntimeError) as e:
        return f"raises {type(e).__name__}"


def run_case(case: str) -> dict:
    torch._dynamo.reset()
    kind, *rest = case.split(":", 1)
    r = Result(case)
    args = rest[0].split(":") if rest else []
    if kind == "full":
        case_full(r, *args)
    elif kind == "sharded":
        case_sharded(r, args[0], ":".join(args[1:]))
    elif kind == "reshard":
        case_reshard(r, ":".join(args))
    elif kind == "local":
        case_local(r, args[0], ":".join(args[1:]))
    elif kind == "legacy":
        case_legacy(r, args[0])
    elif kind == "ignored":
        case_ignored(r, args[0])
    else:
        raise ValueError(f"unknown case {case!r}")
    return r


if __name__ == "__main__":
    run_cases(sys.argv[1:], run_case)
