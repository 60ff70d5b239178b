"""Many sharded models in one process: each compiles (dynamo's recompile limit is per code object, and
every model's compiled forward has its own), and a call dynamo runs eagerly anyway is loud.

Reference: the graph count of each model's own ``explain`` (one graph per model, none "no graph
compiled yet") and the model's gradients against the same module run in one plain process.
"""

from __future__ import annotations

import logging

import pytest
import torch

import graphshard
from _models import mesh1d, mlp
from graphshard.fsdp import FullyShardedDataParallel as FSDP
from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

MODELS = 12  # past dynamo's recompile limit (8) on a shared code object


def _fsdp(m):
    return FSDP(m, lower="eager")


def _tp(m):
    return parallelize_module(m, mesh1d("tp"), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _compile(m):
    return graphshard.compile(m, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")


def _dmp(m):
    pytest.importorskip("torchrec")
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from graphshard.model_parallel import DistributedModelParallel

    class Dense(torch.nn.Module):  # no tables: the frontend's dense compile path, which is what this counts
        def __init__(self):
            super().__init__()
            self.dense = m

        def forward(self, x):
            return self.dense(x)

    return DistributedModelParallel(Dense(), env=ShardingEnv.from_process_group(dist.group.WORLD), plan=ShardingPlan({}),
                                    sharders=[EmbeddingBagCollectionSharder(fused_params={})], lower="eager")


@pytest.mark.parametrize("frontend", [_fsdp, _tp, _compile, _dmp], ids=["fsdp", "tensor_parallel", "compile", "dmp"])
def test_every_model_in_the_process_compiles_its_own_graph(frontend, caplog):
    models = []
    with caplog.at_level(logging.WARNING, logger="graphshard"):
        for i in range(MODELS):
            torch.manual_seed(i)
            m = frontend(mlp())
            m(torch.randn(4, 16)).sum().backward()
            models.append(m)
    for i, m in enumerate(models):
        text = graphshard.explain(m)
        assert "no graph compiled yet" not in text and "fallbacks (model)" not in text, i
        assert text.count("graph 0 (") == 1 and "graph 1 (" not in text, i
    assert not [r for r in caplog.records if "eagerly" in r.getMessage()]


def test_a_call_dynamo_runs_eagerly_is_logged_and_explained(caplog):
    torch.manual_seed(0)
    model = _fsdp(mlp())
    x = torch.randn(4, 16)
    with caplog.at_level(logging.WARNING, logger="graphshard"), torch.compiler.set_stance("force_eager"):
        model(x).sum().backward()
    messages = [r.getMessage() for r in caplog.records]
    assert any("FullyShardedDataParallel around MLP (model m" in m and "ran its forward eagerly" in m
               and "recompile_limit" in m for m in messages), messages
    text = graphshard.explain(model)
    assert "fallbacks (model): FullyShardedDataParallel around MLP" in text
    assert "no graph compiled yet" not in text
    # logged once, however many calls run eagerly
    with caplog.at_level(logging.WARNING, logger="graphshard"), torch.compiler.set_stance("force_eager"):
        model(x).sum().backward()
    assert sum("ran its forward eagerly" in r.getMessage() for r in caplog.records) == 1


def test_a_frame_dynamo_skips_inside_a_compiled_call_is_logged_naming_the_model(caplog):
    from graphshard.testing.models import MLP

    class Skipping(MLP):
        @torch.compiler.disable
        def head(self, h):  # a frame dynamo does not trace: runs eagerly, reading fc2 gathered
            return self.fc2(h)

        def forward(self, x):
            return self.head(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = graphshard.compile(Skipping(16, 32, 8), graphshard.Plan(mesh1d("dp"), {"fc2": graphshard.FullyShard(),
                                                                                 "": graphshard.FullyShard()}),
                               lower="eager")
    with caplog.at_level(logging.WARNING, logger="graphshard"):
        model(torch.randn(4, 16)).sum().backward()
    messages = [r.getMessage() for r in caplog.records]
    assert any("unit 'fc2' of Skipping (model m" in m and "runs eagerly inside the compiled model" in m
               for m in messages), messages
    text = graphshard.explain(model)
    assert "fallbacks (model): eager regions" in text and "unit 'fc2': 2 parameter(s)" in text
