"""A user's own tensor-parallel style (a subclass of torch's ``ParallelStyle``) as graphshard plan specs.

Torch runs such a style through its ``_apply(module, device_mesh)``, which calls
``distribute_module(module, mesh, partition_fn, input_fn, output_fn)``: ``partition_fn`` turns
parameters into DTensors, ``input_fn`` / ``output_fn`` become forward hooks that redistribute
the module's plain local tensors (``DTensor.from_local(x, mesh, [given]).redistribute(mesh,
[desired]).to_local()``). graphshard's program is logical, so the hooks cannot run in it as they
are (a ``from_local(out, [Partial()])`` on the logical value would sum it over the ranks again).
Instead graphshard runs the style's own ``_apply`` on a shadow of the module whose parameters
are on the meta device, and reads what it did:

- the placement ``partition_fn`` gave each parameter of the module and of its submodules (the
  parameters it left alone are replicated, as ``distribute_module`` replicates them);
- what each hook does to a tensor: the hook runs on the ranks' probe tensors (each rank's own
  values) and its result is matched against every redistribution ``given -> desired`` of
  ``Replicate()``, ``Partial()`` and ``Shard(d)``; the one it computes becomes the module's
  declared input layout (``PrepareModuleInput``) or output layout (``PrepareModuleOutput``).
  A hook that returns a DTensor declares ``use_local_output=False``.

What has no such reading is refused with the module's FQN: a placement other than
``Shard``/``Replicate`` or on another mesh, a hook on a submodule, ``_apply`` returning another
module, a hook whose result is no redistribution of its input.
"""

from __future__ import annotations

import copy
import itertools
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle as TorchStyle

from graphshard import _compat
from graphshard.plan import fqn_join, fqn_match
from graphshard.styles import Layout, ModuleIO, ParallelStyle, is_torch_style

log = logging.getLogger("graphshard")


def is_torch_builtin(style) -> bool:
    """Whether ``style`` is one of torch's own styles (``ColwiseParallel`` ...), which graphshard
    spells with its own classes of the same arguments."""
    return isinstance(style, TorchStyle) and is_torch_style(style)


def is_user_style(style) -> bool:
    """A user's subclass of torch's ``ParallelStyle`` (torch runs its ``_apply``)."""
    return isinstance(style, TorchStyle) and not is_torch_builtin(style)


class DerivedStyle(ParallelStyle):
    """What a user's style does to one module, as a graphshard style: its parameters' placements
    and its declared input and output layouts (read from the style by `derive`)."""

    def __init__(self, source: str, placements: dict, module_io: ModuleIO | None):
        self.source = source
        self.placements = dict(placements)
        self.module_io = module_io

    def param_placements(self, fqn, module):
        return dict(self.placements)

    def io(self, fqn, module):
        return self.module_io


def expand(root: nn.Module, mesh: DeviceMesh, rules: dict) -> dict:
    """``rules`` with each user style replaced by a `DerivedStyle` per module it changes (the module
    each key matches, and its submodules whose parameters ``partition_fn`` placed)."""
    out = {}
    for key, style in rules.items():
        if not is_user_style(style):
            out[key] = style
            continue
        hits = [(fqn, m) for fqn, m in root.named_modules() if fqn_match(fqn, key)]
        if not hits:
            raise ValueError(f"plan key {key!r} matches no module of {type(root).__name__}")
        for fqn, mod in hits:
            for sub, derived in derive(style, fqn, mod, mesh).items():
                out[fqn_join(fqn, sub)] = derived
    return out


def derive(style: TorchStyle, fqn: str, module: nn.Module, mesh: DeviceMesh) -> dict[str, DerivedStyle]:
    """Runs ``style._apply`` on a meta-device shadow of ``module`` and reads what it did (module
    docstring); returns a `DerivedStyle` per submodule FQN (relative to ``module``; ``""`` is it)."""
    name = f"{type(style).__name__} on {fqn or '<root>'!r}"
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
                    if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
            for t in itertools.chain(module.parameters(), module.buffers())}
    shadow = copy.deepcopy(module, memo)
    before = {sub: _compat.forward_hooks(m) for sub, m in shadow.named_modules()}
    try:
        got = style._apply(shadow, mesh)
    except Exception as e:
        raise NotImplementedError(f"{name}: graphshard runs the style's _apply on a copy of the module on the meta "
                                  f"device to read its layouts, and it raised {type(e).__name__}: {e}") from e
    if got is not shadow:
        raise NotImplementedError(f"{name}: the style's _apply returned another module ({type(got).__name__}); "
                                  "graphshard compiles styles that lay out the module they are given "
                                  "(distribute_module), not ones that replace it")
    out: dict[str, DerivedStyle] = {}
    added = {}
    for sub, m in shadow.named_modules():
        added[sub] = [[h for h in now if not any(h is o for o in old)]
                      for now, old in zip(_compat.forward_hooks(m), before[sub])]
        if sub and any(added[sub]):
            raise NotImplementedError(
                f"{name}: the style's _apply registered a forward hook on submodule {fqn_join(fqn, sub)!r}; graphshard "
                "reads a style's input_fn and output_fn from the module it is applied to only: apply a style to that "
                "submodule instead")
        placements = {pname: _placement(name, fqn_join(fqn_join(fqn, sub), pname), p, mesh)
                      for pname, p in m._parameters.items() if p is not None}
        if placements:
            out[sub] = DerivedStyle(name, placements, None)
    new_pre, new_post = added[""]
    inputs = outputs = ()
    local = True
    if new_pre:
        layout, dtensor = _probe(name, "input_fn", new_pre, mesh, shadow, output=False)
        inputs = (layout,) if layout is not None else ()
        local = local and not dtensor
    if new_post:
        layout, dtensor = _probe(name, "output_fn", new_post, mesh, shadow, output=True)
        outputs = (layout,) if layout is not None else ()
        local = local and not dtensor
    if inputs or outputs:
        mine = out.get("")
        out[""] = DerivedStyle(name, mine.placements if mine else {},
                               ModuleIO(inputs=inputs, outputs=outputs, use_local_output=local))
    log.info("graphshard: %s reads as %s", name, {sub or "<module>": (d.placements, d.module_io) for sub, d in out.items()})
    return out


def _placement(name: str, where: str, p, mesh: DeviceMesh):
    if not isinstance(p, DTensor):
        raise NotImplementedError(f"{name}: after the style's _apply, parameter {where!r} is a "
                                  f"{type(p).__name__}, not a DTensor; graphshard reads each parameter's layout from "
                                  "the DTensor partition_fn makes of it")
    if p.device_mesh != mesh:
        raise NotImplementedError(f"{name}: partition_fn lays parameter {where!r} out over {p.device_mesh}, not over "
                                  f"the mesh parallelize_module was given ({mesh}); graphshard compiles one "
                                  "tensor-parallel mesh per model")
    (pl,) = p.placements
    if type(pl) not in (Shard, Replicate):
        raise NotImplementedError(f"{name}: partition_fn lays parameter {where!r} out as {pl!r}; graphshard stores "
                                  "parameters as Shard(dim) or Replicate()")
    return pl


def _candidates(ndim: int):
    """Every redistribution ``(given, desired)`` of a tensor of ``ndim`` dims that moves data."""
    shards = [Shard(d) for d in range(ndim)]
    for given in [Replicate(), Partial(), *shards]:
        for desired in [Replicate(), *shards]:
            if given != desired:
                yield given, desired


def _expected(given, desired, mine: torch.Tensor, every: list[torch.Tensor], world: int, rank: int):
    if isinstance(given, Replicate):
        whole = mine
    elif isinstance(given, Partial):
        whole = torch.stack(every).sum(0)
    else:
        whole = torch.cat(every, dim=given.dim)
    return whole if isinstance(desired, Replicate) else whole.chunk(world, dim=desired.dim)[rank]


def _probe(name: str, what: str, hooks: list, mesh: DeviceMesh, module: nn.Module, output: bool):
    """The layout a forward hook declares: ``(Layout or None, returns_dtensor)``. The hook runs on a
    probe tensor of each rank's own values (3-D, then 2-D, then 1-D, each dim a multiple of the
    mesh size); its result is matched against every redistribution (`_candidates`); the ranks
    agree on the match."""
    group = mesh.get_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    errors = []
    for ndim in (3, 2, 1):
        shape = tuple(2 * world + i * world for i in range(ndim))
        x = torch.arange(float(torch.Size(shape).numel())).reshape(shape) * (rank + 2) + 1000 * rank
        try:
            y = x
            for hook in hooks:
                got = hook(module, (x,), y) if output else hook(module, (y,))
                if got is not None:
                    y = got if output else (got[0] if isinstance(got, tuple) else got)
        except Exception as e:  # this rank count of dims does not fit the hook
            errors.append(f"{ndim}-D: {type(e).__name__}: {e}")
            continue
        break
    else:
        raise NotImplementedError(f"{name}: graphshard runs the style's {what} on probe tensors to read the layout it "
                                  f"declares, and it fails on each ({'; '.join(errors)[:600]})")
    dtensor = isinstance(y, DTensor)
    got = y.to_local() if dtensor else y
    if not isinstance(got, torch.Tensor):
        raise NotImplementedError(f"{name}: the style's {what} returned {type(got).__name__}; graphshard reads "
                                  "hooks that take and return one tensor")
    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x, group=group)
    options = [(None, None)] + list(_candidates(ndim))
    fits = torch.tensor([_fits(got, x if g is None else _expected(g, d, x, every, world, rank)) for g, d in options],
                        dtype=torch.int32)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=group)
    matches = [o for o, ok in zip(options, fits.tolist()) if ok]
    if not matches:
        raise NotImplementedError(
            f"{name}: the style's {what} computes something that is no redistribution of its tensor (from_local "
            "with Replicate(), Partial() or Shard(d), then redistribute to Replicate() or Shard(d)); graphshard "
            "compiles a style's hooks only as declared layouts. Write that computation in the module's forward, "
            "or use PrepareModuleInput / PrepareModuleOutput")
    given, desired = matches[0]
    if dtensor:
        desired = y.placements[0]
        if given is None:
            given = desired
    if given is None:
        return None, dtensor
    if isinstance(desired, Partial) or (not output and isinstance(given, Partial)):
        raise NotImplementedError(f"{name}: the style's {what} declares {given!r} -> {desired!r}; graphshard "
                                  "declares only Shard(dim) or Replicate() module layouts")
    return Layout(None if output or isinstance(given, Partial) else given, desired), dtensor


def _fits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.allclose(got.to(want.dtype), want, rtol=1e-6, atol=1e-3))


__all__ = ["TorchStyle", "DerivedStyle", "derive", "expand", "is_torch_builtin", "is_user_style"]
