"""``DistributedModelParallel``: TorchRec's DMP API over graphshard's compiler.

The constructor shards each planned ``EmbeddingBagCollection`` and ``EmbeddingCollection`` in
place (its fused tables move into fused TBEs on the ranks that own them, on ``device``: fbgemm's
on the CPU, graphshard's Triton TBE on CUDA; its forward becomes the logical lookup the
``shard_embeddings`` pass expands) and moves the rest of the module to ``device``, then
``init_data_parallel`` lays the dense parameters (and data-parallel tables) out with a graphshard
``Plan`` (``Replicate``: DDP's semantics) and compiles the whole model as one program with the
graphshard backend: the ids' all-to-alls, the lookups, the pooled embeddings' distribution and
the dense network are one graph.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from graphshard import _compat
from graphshard.api import compile_config, compile_sharded
from graphshard.compiler.collective_check import CollectiveMismatch
from graphshard.frontends.model_parallel import _batches, _state
from graphshard.planning.embedding_planner import EmbeddingShardingPlanner
from graphshard.plan import FullyShard, Plan, Replicate
from graphshard.sparse import torchrec_plan
from graphshard.sparse.collection import new_key
from graphshard.sparse.torchrec import collection_layout, install
from graphshard.storage import shard, state_of

log = logging.getLogger("graphshard.model_parallel")


def _device(device) -> torch.device:
    """TorchRec's ``device`` argument: the CPU (gloo) or a CUDA device (NCCL); a bare "cuda" is this
    rank's current device, as TorchRec takes it."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device}: this torch sees no CUDA device (a CPU-only build, or no GPU); use "
                             "device='cpu' (gloo)")
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device.type != "cpu":
        raise NotImplementedError(f"device={device}: graphshard's DistributedModelParallel runs on 'cpu' (gloo) or "
                                  "'cuda' (NCCL)")
    return device


class FullyShardDense:
    """``data_parallel_wrapper=FullyShardDense()``: the dense parameters sharded (graphshard's
    ``FullyShard`` on the root: FSDP) instead of replicated. Keywords are ``FullyShard``'s."""

    def __init__(self, **kwargs):
        self.spec = FullyShard(**kwargs)


def _dense_spec(wrapper):
    if wrapper is None:
        return Replicate()
    if isinstance(wrapper, FullyShardDense):
        return wrapper.spec
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

    if type(wrapper) is DefaultDataParallelWrapper:
        return Replicate()
    raise NotImplementedError(
        f"data_parallel_wrapper={type(wrapper).__name__}: graphshard compiles the dense part's data parallelism "
        "itself; pass None or DefaultDataParallelWrapper (replicated) or graphshard.model_parallel.FullyShardDense() "
        "(sharded)"
    )


def _proxies(args, kwargs) -> list[torch.fx.Proxy]:
    """The fx proxies among the call's arguments: torch.fx is tracing it (TorchRec's training
    pipelines trace the model to find the ``ShardedModule`` calls whose input distribution they
    run a batch ahead). Traced as the root, ``args`` and ``kwargs`` are themselves proxies."""
    if isinstance(args, torch.fx.Proxy) or isinstance(kwargs, torch.fx.Proxy):
        return [a for a in (args, kwargs) if isinstance(a, torch.fx.Proxy)]
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Proxy)]


def _call(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    return module(*args, **kwargs)


def _opaque_call(module: nn.Module, args, kwargs) -> Any:
    """The compiled model, as fx sees it: one call, not traced into. It holds no TorchRec
    ``ShardedModule`` (the ids' distribution is part of the compiled program, which the compiler
    overlaps with the dense compute itself), so a TorchRec pipeline's search finds none and the
    pipeline calls the model as it is. Traced as the root, fx hands ``*args`` and ``**kwargs``
    over as one proxy each; the node unpacks them when the traced graph runs."""
    tracer = _proxies(args, kwargs)[0].tracer
    target = tracer.create_proxy("get_attr", tracer.path_of_module(module), (), {})
    return tracer.create_proxy("call_function", _call, (target, args, kwargs), {})


class DistributedModelParallel(nn.Module):
    """TorchRec's ``DistributedModelParallel`` (same signature), compiled by graphshard.

    ``plan`` is a TorchRec ``ShardingPlan``; ``None`` asks graphshard's
    ``EmbeddingShardingPlanner`` for one (its collective plan: the same on every rank;
    ``explain`` prints it with its estimates and the measured step time); a graphshard ``Plan``
    from ``graphshard.auto_plan`` brings the TorchRec plan and the dense part's layout together.
    ``sharders`` supply the fused optimizer's
    ``fused_params`` (``EmbeddingBagCollectionSharder(fused_params=...)``); an
    ``apply_optimizer_in_backward`` optimizer on the tables takes precedence. Unlike TorchRec
    on the CPU, the tables keep the module's weights; ``init_parameters`` materializes what is on
    the meta device as TorchRec does (tables drawn uniformly in their init bounds, each rank its
    shards; other modules ``reset_parameters()``, then synced from rank 0).
    ``data_parallel_wrapper`` says how the dense part is laid out: None or TorchRec's ``DefaultDataParallelWrapper`` replicate it (DDP), `FullyShardDense`
    shards it (FSDP); graphshard compiles that data parallelism itself, so other wrappers are
    refused. Keyword arguments beyond TorchRec's are `graphshard.compile`'s compile options
    (``lower="eager"``, ``dump_graphs=...``).
    """

    def __init__(self, module: nn.Module, env=None, device: torch.device | None = None, plan=None,
                 sharders=None, init_data_parallel: bool = True, init_parameters: bool = True,
                 data_parallel_wrapper=None, **compile_options) -> None:
        super().__init__()
        self._compile_config = compile_config("DistributedModelParallel", **compile_options)
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.types import ShardingEnv

        self._dense_spec = _dense_spec(data_parallel_wrapper)
        self._auto = None  # a graphshard Plan (auto_plan's): its rules lay the dense part out
        if isinstance(plan, Plan):
            if data_parallel_wrapper is not None or plan.torchrec_plan is None:
                raise ValueError(
                    "plan is a graphshard Plan: DistributedModelParallel takes one from graphshard.auto_plan (its "
                    "torchrec_plan shards the embedding modules, its rules lay the dense part out), with "
                    "data_parallel_wrapper=None; otherwise pass a TorchRec ShardingPlan"
                )
            self._auto, plan = plan, plan.torchrec_plan
        self._env = env if env is not None else ShardingEnv.from_process_group(dist.group.WORLD)
        self.device = _device(device)
        self.init_parameters = init_parameters
        self._dmp_wrapped_module = module
        self._sharders = (list(sharders) if sharders is not None
                          else [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
        found = torchrec_plan.find_modules(module)
        world, rank = self._env.world_size, self._env.rank
        self._plan_estimate = None
        if plan is None:  # TorchRec's default: its planner's collective plan; here graphshard's planner
            planner = EmbeddingShardingPlanner(debug=False)
            plan = planner.collective_plan(module, self._sharders, self._env.process_group)
            self._plan_estimate = planner.estimate
            log.info("DistributedModelParallel: no plan given; graphshard's planner chose:\n%s",
                     self._plan_estimate.format())
        self._last_forward: float | None = None
        was_meta = [fqn for fqn, p in module.named_parameters() if p.is_meta]
        known = {f for _, fqns in found.values() for f in fqns}
        for fqn in plan.plan:
            if fqn not in known:
                raise ValueError(
                    f"the sharding plan names module {fqn!r}, which is not an EmbeddingBagCollection or "
                    "EmbeddingCollection of this model; "
                    f"its embedding modules are {sorted(known) or 'none'}"
                )
        self._plan = plan
        group = self._env.process_group.group_name
        hosts = self._host_groups(plan, world)
        self._sharded: list[torchrec_plan.Sharded] = []
        self._collections = []
        for mod, fqns in found.values():
            mp = torchrec_plan.module_plan(fqns, plan)
            if mp is None:
                log.warning("DistributedModelParallel: %s is not in the plan; it stays a dense, data-parallel module", fqns[0])
                continue
            sharder = self._sharder_for(mod)
            fused = torchrec_plan.fused_params_of(mod, fqns[0], sharder)
            layout = collection_layout(mod, tuple(fqns), mp, world=world, rank=rank, group=group,
                                       key=new_key(fqns[0]), hosts=hosts, device=self.device.type)
            if layout.kernel_note:
                log.warning("DistributedModelParallel: %s", layout.kernel_note)
            self._collections.append(install(mod, layout, fused))
            self._sharded.append(torchrec_plan.Sharded(mod, tuple(fqns), mp, fused, sharder))
        _state.materialize_meta(module, self.device, self._env.process_group, init_parameters, was_meta)
        module.to(self.device)  # the dense part (the sharded tables are already there, in their TBEs)
        self._sequence = any(c.layout.sequence for c in self._collections)
        from graphshard.frontends.model_parallel._optimizer import FusedOptimizer

        self._optim = FusedOptimizer(self._collections)
        self._ddp_wrapped = False
        if init_data_parallel:
            self.init_data_parallel()

    def _host_groups(self, plan, world: int):
        """For table-row-wise tables: ranks per host (``LOCAL_WORLD_SIZE``, as TorchRec reads it) and
        the c10d groups of a host's ranks and of the ranks sharing a local index (a 2-D mesh)."""
        if not any(str(ps.sharding_type) == "table_row_wise" for mp in plan.plan.values() for ps in mp.values()):
            return None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % local:
            raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}")
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(self.device.type, torch.arange(world).view(world // local, local),
                          mesh_dim_names=("host", "local"))
        return local, mesh.get_group("local").group_name, mesh.get_group("host").group_name

    def _sharder_for(self, mod: nn.Module):
        for s in self._sharders:
            if isinstance(mod, s.module_type):
                return s
        raise ValueError(f"no sharder in `sharders` handles {type(mod).__name__}; add its TorchRec sharder "
                         "(EmbeddingBagCollectionSharder() or EmbeddingCollectionSharder())")

    # ---- data parallelism and compilation ----
    def init_data_parallel(self) -> None:
        """Lays the dense parameters out (replicated) and compiles the model. Safe to call more than once."""
        if self._ddp_wrapped:
            return
        module = self._dmp_wrapped_module
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(self._env.process_group, self.device.type, mesh_dim_names=("dp",))
        if state_of(module) is None:
            shard(module, Plan(mesh, self._dense_rules(), ignored_params=self._whole_gradients(),
                               notes=self._auto.notes if self._auto is not None else ()))
            state_of(module).collections.extend(self._collections)
            if self._plan_estimate is not None:
                state_of(module).preamble.append(self._plan_estimate)
        compile_sharded(module, module, self._compile_config)
        self._ddp_wrapped = True

    def _dense_rules(self) -> dict:
        """The dense parameters replicated (DDP); each data-parallel table of a sequence collection
        its own unit, so its (large) gradient is reduced on its own, as soon as it is computed."""
        rules = dict(self._auto.rules) if self._auto is not None else {"": self._dense_spec}
        for coll in self._collections:
            if not coll.layout.dp_gathered:
                for t in coll.plan.dp_tables:
                    rules[f"{coll.layout.fqns[0]}.{coll.layout.attr}.{t.name}"] = Replicate()
        return rules

    def _whole_gradients(self) -> list[str]:
        """The data-parallel tables whose gradient every rank computes whole (``dp_gathered``: every
        rank's bags are looked up on every rank): plain replicated tensors, nothing to reduce."""
        return [f"{coll.layout.fqns[0]}.{coll.layout.attr}.{t.name}.weight"
                for coll in self._collections if coll.layout.dp_gathered for t in coll.plan.dp_tables]

    def forward(self, *args, **kwargs) -> Any:
        if _proxies(args, kwargs):
            return _opaque_call(self._dmp_wrapped_module, args, kwargs)
        _state.check_inputs(args, kwargs)
        # variable batches (per feature, per rank) made the program's one shape (_batches.py)
        state = state_of(self._dmp_wrapped_module)
        args, kwargs = _batches.prepare(args, kwargs, state.preamble if state is not None else [])
        if self._plan_estimate is not None:  # the measured step beside the planner's estimate (explain)
            now = time.perf_counter()
            if self._last_forward is not None:
                measured = self._plan_estimate.measured
                measured.append(now - self._last_forward)
                del measured[:-100]
            self._last_forward = now
        try:
            if self._sequence:
                # a sequence lookup's rows per feature are as many as its ids: traced, not a graph break
                with _compat.trace_data_dependent_outputs():
                    return self._dmp_wrapped_module(*args, **kwargs)
            return self._dmp_wrapped_module(*args, **kwargs)
        except CollectiveMismatch as e:  # raised on every rank together: they can compare their batches
            differ = _batches.batches_differ(args, kwargs, self._env.process_group)
            if differ is None:
                raise
            raise NotImplementedError(
                f"the ranks' KeyedJaggedTensors have different batch sizes ({differ}; TorchRec's "
                "variable_batch_size): graphshard compiles each rank's step from its own input shapes, and with "
                "different batches the ranks' programs (and their collectives) differ. Give every rank the same "
                "batch size (empty bags for the samples a rank lacks, its dense input padded to match), or a "
                "variable batch per feature within one batch size (VBE), which works") from e

    # ---- TorchRec's accessors ----
    @property
    def module(self) -> nn.Module:
        """The sharded module, without any wrapper."""
        return self._dmp_wrapped_module

    @property
    def plan(self):
        return self._plan

    @property
    def fused_optimizer(self):
        """The sharded tables' fused optimizer: a TorchRec ``KeyedOptimizer`` (`_optimizer.FusedOptimizer`)."""
        return self._optim

    def copy(self, device: torch.device) -> "DistributedModelParallel":
        device = _device(device)
        if device != self.device:
            raise NotImplementedError(f"copy({device}): the model is sharded on {self.device}; graphshard does not "
                                      "move a sharded model to another device")
        return self

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        return _state.state_dict(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict, prefix: str = "", strict: bool = True):
        return _state.load_state_dict(self, state_dict, prefix, strict)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return _state.named_parameters(self, prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return _state.named_buffers(self, prefix, recurse, remove_duplicate)
