"""relax_views: ``view`` becomes ``reshape``, so no pass depends on the strides of the first trace.

``make_fx`` records ``aten.view`` where the user wrote ``view`` (or where a decomposition
chose a view because the traced strides allowed one). The strides it saw are those of the
first trace; they change afterwards: ``localize_shapes`` re-derives values whose producer
now sees a gathered (contiguous) input instead of a transposed one, and under Inductor,
aot_autograd retraces with decompositions that give other strides (Inductor's ``cat`` drops
an empty input and returns a stride-preserving copy of the other). A ``view`` that was
valid for the first strides then raises "Cannot view a tensor with shape ... and strides
...". ``reshape`` is ``view`` wherever a view is possible (the same alias, no copy), and
copies only where it is not, so the rewrite changes nothing that ran before and makes the
rest run. Only ``aten.view.default`` is rewritten: ``_unsafe_view`` is emitted on fresh
contiguous results (a matmul's), where strides cannot differ.

``lower="eager"`` runs the partitioned graphs through the same rewrite (``aot._as_fx``):
aot_autograd traced them with fake kernels, and an eager kernel may return other strides.
"""

from __future__ import annotations

import torch.fx as fx

from graphshard.passes._graph import aten
from graphshard.passes.context import PassContext


def relax_views(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.find_nodes(op="call_function", target=aten.view.default):
        node.target = aten.reshape.default
    return gm
