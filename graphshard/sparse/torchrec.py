"""TorchRec's types in graphshard's sharded embeddings (TorchRec is an optional dependency).

- ``collection_layout``: a TorchRec ``EmbeddingBagCollection`` (or ``EmbeddingCollection``) and its module sharding plan
  (``ParameterSharding`` per table, as ``construct_module_sharding_plan`` and the
  ``table_wise`` / ``row_wise`` / ``column_wise`` / ``data_parallel`` helpers make them) ->
  graphshard's ``CollectionLayout``.
- ``install``: the collection's sharded state goes under the user's module (its fused tables'
  parameters are replaced by the TBEs; a table built on the meta device is drawn as TorchRec's
  kernels draw one, uniformly in its config's init bounds, each rank its own shards), and the module's forward becomes the logical lookup
  ``graphshard::embedding_bags`` on the KJT, returning TorchRec's ``KeyedTensor``
  (``graphshard::embedding_seqs``, returning ``{name: JaggedTensor}``, for an
  ``EmbeddingCollection``). The module object, its class and its FQN stay the user's.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from graphshard import _compat
from graphshard.sparse.fused_tbe import choose_kernel
from graphshard.sparse.collection import SparseCollection
from graphshard.sparse.input_dist import received_of
from graphshard.sparse.layout import CollectionLayout, TableLayout, TableShard
from graphshard.ops.sparse import ops as sparse_ops
from graphshard.sparse.program import group_state

_POOLING = {"SUM": "sum", "MEAN": "mean"}


def is_sequence(module: nn.Module) -> bool:
    """An ``EmbeddingCollection`` (one row per id), not an ``EmbeddingBagCollection``."""
    from torchrec.modules.embedding_modules import EmbeddingCollection

    return isinstance(module, EmbeddingCollection)


_KERNELS = {"fused": "fused", "fused_triton": "triton"}
"""TorchRec's compute kernels graphshard runs on sharded tables -> the kernel asked of ``choose_kernel``
("fused": fbgemm's TBE where it runs, else graphshard's Triton TBE)."""


def table_configs(module: nn.Module) -> list:
    """The module's table configs (``EmbeddingBagConfig`` s or ``EmbeddingConfig`` s), in its output order."""
    return list(module.embedding_configs() if is_sequence(module) else module.embedding_bag_configs())


def collection_layout(module: nn.Module, fqns: tuple[str, ...], module_plan: dict, *, world: int, rank: int,
                      group: str, key: str, hosts: tuple | None = None, device: str = "cpu") -> CollectionLayout:
    """``module_plan``: table name -> TorchRec ``ParameterSharding``. Every table needs an entry.
    ``device``: the device type the tables live on (it decides what the 'fused' kernel runs)."""
    configs = table_configs(module)
    sequence = is_sequence(module)
    names = [c.name for c in configs]
    unknown = sorted(set(module_plan) - set(names))
    if unknown:
        raise ValueError(
            f"the sharding plan for {fqns[0]!r} names table(s) {unknown} that the module does not have; "
            f"its tables are {names}"
        )
    missing = [n for n in names if n not in module_plan]
    if missing:
        raise ValueError(
            f"the sharding plan for {fqns[0]!r} has no entry for table(s) {missing}; give every table a "
            "ParameterSharding (construct_module_sharding_plan with per_param_sharding)"
        )
    tables = []
    kernels: dict[str, list[str]] = {}  # TBE kernel -> the sharded tables that ask for it
    for c in configs:
        ps = module_plan[c.name]
        pooling = "sum" if sequence else _POOLING.get(getattr(c.pooling, "name", str(c.pooling)))
        if pooling is None:
            raise NotImplementedError(f"{fqns[0]}: table {c.name!r} pools by {c.pooling}; graphshard pools by SUM or MEAN")
        st = str(ps.sharding_type)
        if st == "data_parallel":
            shards = tuple(TableShard(r, 0, c.num_embeddings, 0, c.embedding_dim) for r in range(world))
        else:
            if ps.sharding_spec is None:
                raise ValueError(f"{fqns[0]}: table {c.name!r} is {st} but its ParameterSharding has no sharding_spec")
            shards = tuple(
                TableShard(md.placement.rank(), md.shard_offsets[0], md.shard_sizes[0], md.shard_offsets[1],
                           md.shard_sizes[1])
                for md in ps.sharding_spec.shards
            )
        if st != "data_parallel" and str(ps.compute_kernel) not in _KERNELS:
            raise NotImplementedError(
                f"{fqns[0]}: table {c.name!r} is {st} with compute kernel {ps.compute_kernel!r}; graphshard shards "
                "tables with the 'fused' kernel (fbgemm TBE, optimizer in the backward) or 'fused_triton' "
                "(graphshard's Triton TBE): build the plan with compute_kernel='fused' "
                "(table_wise(rank=0, compute_kernel='fused'), ...). TorchRec's helpers default to 'dense' on the "
                "CPU, a dense gradient for the user's optimizer, which graphshard does not run yet"
            )
        if st != "data_parallel":
            kernels.setdefault(_KERNELS[str(ps.compute_kernel)], []).append(c.name)
        tables.append(TableLayout(c.name, c.num_embeddings, c.embedding_dim, tuple(c.feature_names), pooling, st, shards))
    if len(kernels) > 1:
        raise NotImplementedError(
            f"{fqns[0]}: tables {kernels.get('fused')} use compute kernel 'fused' and {kernels.get('triton')} "
            "'fused_triton'; a module's sharded tables share one kernel: give them the same compute_kernel"
        )
    kernel, note = choose_kernel(next(iter(kernels), "fused"), device, fqns[0])
    local_world, host_group, cross_group = hosts or (None, None, None)
    return CollectionLayout(kernel=kernel, device=device, kernel_note=note if kernels else "", key=key, fqns=fqns,
                            tables=tuple(tables),
                            weighted=False if sequence else bool(module.is_weighted()), world=world, rank=rank,
                            group=group, local_world=local_world, host_group=host_group, cross_group=cross_group,
                            sequence=sequence, attr="embeddings" if sequence else "embedding_bags",
                            dp_gathered=not sequence)


def _permute_pooled_embs_setup(ctx, inputs, output) -> None:
    _, offsets, permute, inv_offsets, inv_permute = inputs
    ctx.save_for_backward(offsets, permute, inv_offsets, inv_permute)


def _permute_pooled_embs_backward(ctx, grad):
    offsets, permute, inv_offsets, inv_permute = ctx.saved_tensors
    # the inverse permutation of the gradient's columns: fbgemm's own backward of
    # permute_pooled_embs_auto_grad (PermutePooledEmbsFunction), the offsets and permutes swapped
    return torch.ops.fbgemm.permute_pooled_embs(grad, inv_offsets, inv_permute, offsets, permute), None, None, None, None


def differentiable_fbgemm_ops() -> None:
    """Gives ``fbgemm::permute_pooled_embs`` an autograd formula (idempotent). TorchRec's
    ``KeyedTensor.regroup`` calls ``permute_pooled_embs_auto_grad``, whose autograd kernel is a C++
    autograd function around ``permute_pooled_embs``, an op with no derivative of its own. graphshard
    traces the model to ATen before aot_autograd differentiates it, and that trace runs below
    autograd: it records the inner op, whose gradient autograd's fallback then dropped with a
    warning (the pooled embeddings, and so the tables, got no gradient through a regroup). With
    this formula the inner op differentiates as the outer one does; eager code is unchanged (the
    outer op's kernel calls the inner one below autograd)."""
    name = "fbgemm::permute_pooled_embs"
    if not hasattr(torch.ops, "fbgemm") or not hasattr(torch.ops.fbgemm, "permute_pooled_embs"):
        return
    if _compat.has_autograd_kernel(name):
        return  # fbgemm's own (a newer fbgemm), or ours from an earlier call
    torch.library.register_autograd(name, _permute_pooled_embs_backward, setup_context=_permute_pooled_embs_setup)


def install(module: nn.Module, layout: CollectionLayout, fused_params: dict, bounds_check: bool = True) -> SparseCollection:
    """Shards ``module``'s tables by ``layout`` on this rank and makes its forward the logical lookup."""
    differentiable_fbgemm_ops()
    tables = getattr(module, layout.attr)
    bounds = init_bounds(module)
    on_meta = {t.name: bounds[t.name] for t in layout.tables if tables[t.name].weight.is_meta}
    for t in layout.tables:
        if not t.fused and t.name in on_meta:  # a replicated table: here; the DMP syncs it from rank 0
            with torch.no_grad():
                weight = torch.empty_like(tables[t.name].weight, device=layout.device).uniform_(*on_meta[t.name])
            tables[t.name].weight = nn.Parameter(weight)
    weights = {t.name: tables[t.name].weight.detach() for t in layout.tables}
    dp = {t.name: tables[t.name].weight for t in layout.tables if not t.fused}
    coll = SparseCollection(layout, weights, dp, fused_params, bounds_check,
                            need_indices=layout.sequence and module.need_indices(), inits=on_meta)
    for t in layout.tables:
        if t.fused:  # the TBE holds it now; the state dict shows it as a sharded tensor
            del tables[t.name]._parameters["weight"]
    module._graphshard_tbes = coll.tbes
    module._graphshard_sparse = coll
    module.forward = types.MethodType(_sequence_forward if layout.sequence else _forward, module)
    return coll


def init_bounds(module: nn.Module) -> dict[str, tuple[float, float]]:
    """Each table's ``(weight_init_min, weight_init_max)`` from its TorchRec config (by default
    -+sqrt(1 / num_embeddings)): where TorchRec's sharded kernels draw a table's initial rows
    uniformly, and so graphshard draws the rows of a table built on the meta device."""
    configs = module.embedding_configs() if is_sequence(module) else module.embedding_bag_configs()
    return {c.name: (c.get_weight_init_min(), c.get_weight_init_max()) for c in configs}


def _checked_keys(layout: CollectionLayout, features) -> list[str]:
    keys = list(features.keys())
    missing = [f for f in layout.features if f not in keys]
    if missing:
        raise ValueError(
            f"{layout.fqns[0]}: the KeyedJaggedTensor has no feature(s) {missing}; its keys are {keys} and the "
            f"module looks up {list(layout.features)}"
        )
    if features.variable_stride_per_key():
        raise NotImplementedError(f"{layout.fqns[0]}: a KeyedJaggedTensor with a variable batch per feature "
                                  "(stride_per_key_per_rank) reached the sharded lookup inside the model; "
                                  "DistributedModelParallel expands one it is given (top level or one attribute "
                                  "down, as TorchRec's ModelInput and Batch hold them): pass it in, or give every "
                                  "feature the batch's stride")
    return keys


def _sequence_forward(self, features):
    """TorchRec's ``EmbeddingCollection.forward``: ``{embedding name: JaggedTensor}`` of each
    feature's rows, with the feature's lengths (and its ids as weights with ``need_indices``)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    coll: SparseCollection = self._graphshard_sparse
    layout = coll.layout
    keys = _checked_keys(layout, features)
    lengths = features.lengths()
    out = sparse_ops.embedding_seqs(features.values(), lengths, _state(self, coll), layout.key, keys,
                                    layout.tables[0].embedding_dim, len(layout.features), coll.need_indices)
    lengths2d = lengths.view(len(keys), -1)
    names = [n for per_table in self.embedding_names_by_table() for n in per_table]
    n = len(layout.features)
    return {name: JaggedTensor(values=out[i], lengths=lengths2d[keys.index(f)],
                               weights=out[n + i] if coll.need_indices else None)
            for i, (name, f) in enumerate(zip(names, layout.features))}


def _forward(self, features):
    from torchrec.sparse.jagged_tensor import KeyedTensor

    coll: SparseCollection = self._graphshard_sparse
    layout = coll.layout
    keys = _checked_keys(layout, features)
    weights = features.weights_or_none() if layout.weighted else None
    if layout.weighted and weights is None:
        raise ValueError(f"{layout.fqns[0]} is weighted (is_weighted=True): the KeyedJaggedTensor needs weights")
    state = _state(self, coll)
    ahead = received_of(features, layout.key)  # exchanged a batch ahead by a pipeline (input_dist.py)
    if ahead is not None:
        pooled = sparse_ops.embedding_bags_received(features.values(), features.lengths(), weights, state, layout.key,
                                                    keys, layout.total_dim, ahead[1], list(ahead[0]))
    else:
        pooled = sparse_ops.embedding_bags(features.values(), features.lengths(), weights, state, layout.key, keys,
                                           layout.total_dim)
    return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=pooled)


def _state(module: nn.Module, coll: SparseCollection) -> list[torch.Tensor]:
    """The program's state read through the module (so dynamo sees module buffers and parameters)."""
    tables = getattr(module, coll.layout.attr)
    return group_state(module._graphshard_tbes) + [tables[t.name].weight for t in coll.plan.dp_tables]
