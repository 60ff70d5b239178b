"""What every pass reads (`PassContext`) and where passes log: the passes import this, and the
pipeline (`pipeline.py`) imports the passes."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from graphshard.config import CompileConfig
from graphshard.fingerprint import unkeyed
from graphshard.report import GraphReport
from graphshard.params import AxisGroup
from graphshard.ops.rng import RandomDraws
from graphshard.sharding import ShardedModel, ShardedParam

log = logging.getLogger("graphshard.passes")

Pass = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]

TRACED = "graphshard_traced"
"""``node.meta`` key the backend sets on every node of the trace to ATen (the user's program):
nodes without it were inserted by passes (``tag_recomputation`` joins only those to regions)."""

BLOCK = "graphshard_block"
"""``node.meta`` key of a node the trace to ATen copied from a block's shared body (a
``nested_compile_region`` call dynamo stamped out): the FQN of the call's block. ``outline`` cuts
a plan without data-parallel units (tensor parallelism alone) into segments at these blocks."""


@dataclass
class PassContext:
    """What every pass may read, built once per graph by the backend (`compiler.prepare.trace`) from the
    sharded models the graph reads; passes record what they did in the outputs at the end."""

    config: CompileConfig
    models: tuple[ShardedModel, ...]        # the sharded models whose parameters or layouts the graph reads
    params: dict[str, ShardedParam] = field(  # their parameters, by the key a marker carries
        metadata=unkeyed("the models' own parameters, keyed in models"))
    model_parallel: dict[str, AxisGroup]    # model-parallel mesh axes by name
    group_axes: dict[str, str]              # mesh axis name -> c10d group name
    meshes: dict                            # model-parallel mesh axis -> its 1-D DeviceMesh (DTensor outputs)
    sparse: dict                            # embedding-collection key -> its SparseCollection on this rank
    input_units: list                       # per graph input: the unit of the parameter shard it is, or None
    input_requires_grad: list               # per graph input: whether it requires grad
    fake_mode: object = field(metadata=unkeyed("this compile's fake tensors: aot_autograd keys the inputs' fakes"))
    graph_index: int = field(metadata=unkeyed("names dumps and explain's reports"))
    # ---- what passes and the backend record as the compile goes ----
    report: GraphReport = field(metadata=unkeyed("what the compile writes for explain"))
    random: RandomDraws | None = None  # set by localize_random: the graph then reads a key and coordinates per call
    stage: str = field(  # set by the backend: which graph the post-partition passes are on
        default="pre_autograd", metadata=unkeyed("set as the compile goes; the key is taken before aot_autograd"))
    dump_counter: collections.Counter = field(default_factory=collections.Counter, metadata=unkeyed("dump files' numbers"))
