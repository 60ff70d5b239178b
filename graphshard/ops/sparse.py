"""The sparse ops of the traced program.

``graphshard::embedding_bags`` is the *logical* lookup of one embedding collection: what the
user's module computes, as one node with the output's shape (``[batch, total_dim]``). The
``shard_embeddings`` pass replaces it with the collection's sharded program
(``program.sharded_lookup``). Run eagerly it computes the same forward (a debugging path, no
gradient: a sharded collection trains compiled).

``graphshard::embedding_bags_received`` is the same lookup where a training pipeline exchanged
the ids a batch ahead (`graphshard.sparse.input_dist`): ``received`` holds what arrived, per
exchanged group (``groups``), and the pass expands a program that starts at the lookup.

``graphshard::embedding_seqs`` is the same for a sequence collection (TorchRec's
``EmbeddingCollection``): each feature's rows, one per id (``[ids, dim]``; the counts are the
data's, so the fake impl gives each a new unbacked size), then, with ``need_indices``, each
feature's ids.

``graphshard::scale_grad`` is the identity whose gradient is scaled (a gradient computed
whole on every rank, made the global batch's mean).

``graphshard::check_ids`` is the input's bounds check: every id of a feature must lie in its
table's rows; the error names the feature and the table.
"""

from __future__ import annotations

import torch

from graphshard.kernels.tbe_reference import first_out_of_range
from graphshard.params import resolve

lib = torch.library.Library("graphshard", "FRAGMENT")
lib.define("embedding_bags(Tensor values, Tensor lengths, Tensor? weights, Tensor[] state, str key, "
           "str[] keys, int total_dim) -> Tensor")
lib.define("embedding_bags_received(Tensor values, Tensor lengths, Tensor? weights, Tensor[] state, str key, "
           "str[] keys, int total_dim, Tensor[] received, str[] groups) -> Tensor")
lib.define("embedding_seqs(Tensor values, Tensor lengths, Tensor[] state, str key, str[] keys, int dim, "
           "int features, bool need_indices) -> Tensor[]")
lib.define("scale_grad(Tensor x, float scale) -> Tensor")
lib.define("check_ids(Tensor values, Tensor lengths, int[] limits, str names) -> Tensor")


def _embedding_bags_eager(values, lengths, weights, state, key, keys, total_dim):
    return resolve(key).run(values, lengths, weights, list(state), list(keys))


def _embedding_bags_received_eager(values, lengths, weights, state, key, keys, total_dim, received, groups):
    return resolve(key).run(values, lengths, weights, list(state), list(keys), received=(list(groups), list(received)))


def _embedding_bags_fake(values, lengths, weights, state, key, keys, total_dim, *received):
    return values.new_empty((lengths.shape[0] // len(keys), total_dim), dtype=torch.float32)


def _embedding_bags_setup(ctx, inputs, output):
    ctx.key = inputs[4]


def _embedding_bags_backward(ctx, grad):
    raise RuntimeError(
        f"graphshard's sharded embedding collection {ctx.key.split('/', 1)[-1]!r} ran eagerly with autograd; "
        "it trains compiled: call the DistributedModelParallel module (or torch.compile(..., backend='graphshard'))"
    )


torch.library.impl(lib, "embedding_bags", "CompositeExplicitAutograd")(_embedding_bags_eager)
torch.library.register_fake("graphshard::embedding_bags")(_embedding_bags_fake)
torch.library.register_autograd("graphshard::embedding_bags", _embedding_bags_backward,
                                setup_context=_embedding_bags_setup)
torch.library.impl(lib, "embedding_bags_received", "CompositeExplicitAutograd")(_embedding_bags_received_eager)
torch.library.register_fake("graphshard::embedding_bags_received")(_embedding_bags_fake)
torch.library.register_autograd("graphshard::embedding_bags_received", _embedding_bags_backward,
                                setup_context=_embedding_bags_setup)


def _embedding_seqs_eager(values, lengths, state, key, keys, dim, features, need_indices):
    return resolve(key).run(values, lengths, None, list(state), list(keys))


def _embedding_seqs_fake(values, lengths, state, key, keys, dim, features, need_indices):
    ctx = torch.library.get_ctx()
    sizes = [ctx.new_dynamic_size() for _ in range(features)]
    rows = [values.new_empty((n, dim), dtype=torch.float32) for n in sizes]
    return rows + ([values.new_empty(n) for n in sizes] if need_indices else [])


torch.library.impl(lib, "embedding_seqs", "CompositeExplicitAutograd")(_embedding_seqs_eager)
torch.library.register_fake("graphshard::embedding_seqs")(_embedding_seqs_fake)
torch.library.register_autograd("graphshard::embedding_seqs", _embedding_bags_backward,
                                setup_context=lambda ctx, inputs, output: setattr(ctx, "key", inputs[3]))


torch.library.impl(lib, "scale_grad", "CompositeExplicitAutograd")(lambda x, scale: x.clone())
torch.library.register_fake("graphshard::scale_grad")(lambda x, scale: torch.empty_like(x))
torch.library.register_autograd("graphshard::scale_grad", lambda ctx, g: (g * ctx.scale, None),
                                setup_context=lambda ctx, inputs, output: setattr(ctx, "scale", inputs[1]))


def _in_range(ids: torch.Tensor, limit: int) -> bool:
    """Whether every id lies in ``[0, limit)`` (a negative limit: ``[0, inf)``)."""
    if ids.numel() == 0:
        return True
    lo, hi = torch.aminmax(ids)
    return int(lo) >= 0 and (limit < 0 or int(hi) < limit)


def _check_ids_eager(values, lengths, limits, names):
    # the common case, all ids in range, costs one min/max pass per feature (one in all where the
    # tables have the same rows); only a failed check locates the offending id
    same = len(set(limits)) == 1
    segments = [values] if same else values.split(lengths.view(len(limits), -1).sum(1).tolist())
    if all(_in_range(ids, limit) for ids, limit in zip(segments, limits)):
        return values.clone()
    counts = lengths.view(len(limits), -1).sum(1)
    found = first_out_of_range(values, counts, torch.tensor(limits, dtype=values.dtype, device=values.device))
    if found is not None:
        i, row = found
        raise ValueError(
            f"id {int(values[i])} of {names.splitlines()[row]} is outside the table's {limits[row]} rows; "
            "ids must lie in [0, num_embeddings)"
        )
    return values.clone()


torch.library.impl(lib, "check_ids", "CompositeExplicitAutograd")(_check_ids_eager)
torch.library.register_fake("graphshard::check_ids")(lambda values, lengths, limits, names: torch.empty_like(values))

ops = torch.ops.graphshard


def lookup_args(node) -> tuple | None:
    """A graph node's (values, lengths, weights, state, key, keys) if it is a logical lookup
    (pooled or sequence), else None."""
    if node.op != "call_function":
        return None
    if node.target in (ops.embedding_bags, ops.embedding_bags.default,  # dynamo's graph calls the packet
                       ops.embedding_bags_received, ops.embedding_bags_received.default):
        return tuple(node.args[:6])
    if node.target in (ops.embedding_seqs, ops.embedding_seqs.default):
        values, lengths, state, key, keys = node.args[:5]
        return values, lengths, None, state, key, keys
    return None


def received_args(node) -> tuple[list, list[str]] | None:
    """A pooled lookup node's ids exchanged a batch ahead: (the received tensors' nodes, their
    groups), or None where the lookup exchanges its own."""
    if node.target in (ops.embedding_bags_received, ops.embedding_bags_received.default):
        return list(node.args[7]), list(node.args[8])
    return None
