"""Activation checkpointing (AC) compiled as recomputation: the ways users turn it on, under every
layout, against the single process running the same AC eagerly (``tests/workers/ac_numerics.py``);
golden graphs of a checkpointed unit's backward; the plan option and its bad input.

The frontends' own idioms are in their suites: FSDP1's ``apply_activation_checkpointing`` before and
after wrapping (``test_fsdp1.py``), HF's ``gradient_checkpointing_enable()`` on every architecture
(``test_model_coverage.py``'s AC column), DMP's dense part (``test_model_parallel.py``).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import graphshard
from _golden import compiled_stages
from _coverage_share import full_coverage
from conftest import COVERAGE_DIR
from _launch import CaseResults, run_cases
from _models import mesh1d, seeded

TOL = 1e-5

TWO_RANK = ["fn:full_shard:inductor", "reentrant:full_shard:eager", "wrapper:shard_grad_op:eager",
            "plan:full_shard:eager", "plan_sac:full_shard:eager", "sac:tp:eager", "plan:tp:inductor",
            "fn:replicate:eager", "dropout:full_shard:eager", "dropout:tp:eager", "skipped:full_shard:inductor",
            "offload:full_shard:eager"]
FOUR_RANK = ["plan:fsdp_tp:eager", "fn:hybrid:eager"]
"""CI's 4-rank share (4 ranks on CI's 2 cores are its slowest runs): FSDP + TP and hybrid sharding
once each; the wrapper and skipped-frame forms run on 2 ranks above, and under every layout with
``--coverage full``."""
FORMS = ("fn", "reentrant", "wrapper", "sac", "plan", "plan_sac", "skipped", "offload")
"""``--coverage full`` runs every form under every layout and lowering (and dropout under each)."""


def _cases(config) -> tuple[list[str], list[str]]:
    if not full_coverage(config):
        return TWO_RANK, FOUR_RANK
    cases = [f"{f}:{layout}:{lower}" for f in FORMS for lower in ("inductor", "eager")
             for layout in ("full_shard", "shard_grad_op", "replicate", "hybrid", "tp", "fsdp_tp")]
    cases += [f"dropout:{layout}:{lower}" for layout in ("full_shard", "tp") for lower in ("inductor", "eager")]
    four = (":fsdp_tp:", ":hybrid:")
    return [c for c in cases if not any(f in c for f in four)], [c for c in cases if any(f in c for f in four)]


def pytest_generate_tests(metafunc):
    if "ac_case" in metafunc.fixturenames:
        two, four = _cases(metafunc.config)
        metafunc.parametrize("ac_case", two + four)


@pytest.fixture(scope="module")
def ac_results(request):
    two, four = _cases(request.config)
    out = CaseResults()
    for i in range(0, len(two), 5):  # five cases per process
        out.update(run_cases("ac_numerics.py", two[i:i + 5], nproc=2))
    out.update(run_cases("ac_numerics.py", four, nproc=4))
    _write_grid(out)
    return out


GRID = os.path.join(COVERAGE_DIR, "activation_checkpointing.md")


def _write_grid(results: CaseResults) -> None:
    """Writes ``coverage_out/activation_checkpointing.md``: per case, its errors against the single
    process and what its compiled backward recomputes (the table a run's reader asks for; the
    assertions are the tests below)."""
    lines = ["| case | loss err | param err | ops recomputed | saved MiB (without AC) | graphs | eager units |",
             "|---|---|---|---|---|---|---|"]
    for case, r in results.items():
        if "loss_err" not in r:
            lines.append(f"| {case} | FAIL {r.get('error')}: {(r.get('message') or '')[:120]} | | | | | |")
            continue
        saved = f"{r['saved_bytes'] / 2**20:.2f} ({r['saved_bytes_without_ac'] / 2**20:.2f})"
        lines.append(f"| {case} | {r['loss_err']:.1e} | {r['param_err']:.1e} | {r['recomputed_ops']} | {saved} "
                     f"| {r['graphs']} | {len(r['eager_units'])} |")
    os.makedirs(COVERAGE_DIR, exist_ok=True)
    with open(GRID, "w") as f:
        f.write("\n".join(lines) + "\n")


@pytest.mark.multirank
def test_matches_single_process_with_the_same_checkpointing(ac_results, ac_case):
    r = ac_results[ac_case]
    assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r  # inf (NaN) fails
    if ac_case.startswith(("skipped", "offload")):
        # dynamo skips the frame with the blocks (a logging loop; save_on_cpu, which it does not trace):
        # they and their recomputation run eagerly inside the compiled model, their parameters
        # gathered at each read, and every one is listed as such
        assert not r["fallbacks"] and r["recomputed_ops"] == 0, r
        if ac_case.startswith("skipped"):
            assert r["graphs"] == 2, r  # around the skipped frame (offload also compiles what lies between blocks)
        assert r["eager_units"] and all(u.startswith("layers.") for u in r["eager_units"]), r
        assert {u.split(".")[1] for u in r["eager_units"]} == {"0", "1"} and r["explain_lists_eager_regions"], r
        return
    assert not r["eager_units"] and not r["explain_lists_eager_regions"], r  # every block compiled
    assert r["graphs"] == 1 and not r["fallbacks"], r  # one graph (no break, no recompile), nothing gathered by fallback
    assert r["regions"] == 2 and r["recomputed_ops"] > 0, r  # two checkpointed blocks, recomputed in the backward
    if ac_case.startswith("dropout"):
        assert 0.5 < r["kept_fraction"] < 0.9, r  # p=0.3: the masks are real draws (the reference multiplies by them)
        # under data parallelism the recomputed dropouts draw from keys, not from torch's replay of the
        # generator state (which 2.13's partitioner would also do: parity alone cannot tell)
        keyed = any("in recomputed regions drawn from a per-call key" in n for n in r["notes"])
        assert keyed == (":tp:" not in ac_case), r["notes"]
    else:
        assert r["saved_bytes"] < r["saved_bytes_without_ac"], r


@pytest.mark.multirank
def test_selective_saves_between_full_and_none(ac_results):
    full, sac = ac_results["plan:full_shard:eager"], ac_results["plan_sac:full_shard:eager"]
    assert full["saved_bytes"] < sac["saved_bytes"] < sac["saved_bytes_without_ac"], (full, sac)
    assert sac["recomputed_ops"] < full["recomputed_ops"], (full, sac)


class MLPBlocks(nn.Module):
    """Two ``fc1 -> GELU -> fc2`` blocks: a checkpointed block recomputes its matmul and GELU."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16, bias=False), nn.GELU(), nn.Linear(16, 8, bias=False))
                                    for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _plan(**checkpoint):
    return graphshard.Plan(mesh1d("dp"), {"layers.*": graphshard.FullyShard(), "": graphshard.FullyShard()},
                           checkpoint=checkpoint)


class TestCheckpointedBackward(TestCase):
    def test_backward_regathers_then_recomputes_each_block(self):
        # Each block's backward starts with its unit's all-gather (issued one block ahead, as without
        # AC), then recomputes the block's first matmul and GELU from the saved block input (tagged
        # PREFER_RECOMPUTE in region 1 or 2), then computes the gradients. A first compile moves
        # torch's process-wide region counter on: the regions are still numbered 1 and 2.
        compiled_stages(seeded(MLPBlocks), _plan(**{"layers.*": graphshard.Checkpoint()}), (torch.randn(4, 8),))
        g = compiled_stages(seeded(MLPBlocks), _plan(**{"layers.*": graphshard.Checkpoint()}), (torch.randn(4, 8),))
        bw = g["backward"]
        self.assertEqual(bw.count("torch.ops.aten.gelu.default("), 2)  # recomputed: one per block
        self.assertEqual(bw.count("all_gather_into_tensor.default("), 2)
        self.assertExpectedInline(_calls(bw), """\
all_gather_into_tensor
wait_tensor <- layers.1
all_gather_into_tensor
mm (region 2)
gelu
mm
mm
gelu_backward
mm
reduce_scatter_tensor <- layers.1
mm
wait_tensor <- layers.0
mm (region 1)
gelu
mm
mm
gelu_backward
mm
reduce_scatter_tensor <- layers.0
wait_tensor <- layers.1
wait_tensor <- layers.0""")

    def test_without_checkpointing_the_forward_saves_the_gelu_inputs(self):
        g = compiled_stages(seeded(MLPBlocks), _plan(), (torch.randn(4, 8),))
        self.assertNotIn("torch.ops.aten.gelu.default(", g["backward"])  # nothing recomputed
        self.assertNotIn("region", _calls(g["backward"]))

    def test_explain_lists_recomputation_and_saved_bytes(self):
        model = seeded(MLPBlocks)
        compiled_stages(model, _plan(**{"layers.*": graphshard.Checkpoint(mode="selective")}), (torch.randn(4, 8),))
        text = graphshard.explain(model)
        self.assertIn("activation checkpointing (plan):\n  layers.0: selective (saves ", text)
        self.assertRegex(text, r"activation checkpointing: 2 region\(s\); the forward saves [\d.]+ \w*B for the "
                               r"backward \([\d.]+ \w*B without checkpointing\)")
        self.assertRegex(text, r"layers\.1: recomputes \d+ ops \(.*gelu x1")  # selective: the matmuls are saved
        self.assertNotRegex(text, r"recomputes .*\bmm x")


class Prelude(nn.Module):
    """The user's own code outside any checkpointed region feeds one: ``tanh(inp(x))``, then
    checkpointed blocks; and one block applied twice (one parameter read by two regions)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.block = nn.Sequential(nn.Linear(8, 16, bias=False), nn.GELU(), nn.Linear(16, 8, bias=False))

    def forward(self, x):
        h = self.inp(x).tanh()  # read by the first region only
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        return h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)


class TestRegions(TestCase):
    def _tagged(self, model, plan):
        from _golden import capture_dynamo
        from graphshard.compiler.prepare import prepare, trace
        from graphshard.config import CompileConfig
        from graphshard.passes.pipeline import pre_autograd_passes, run_passes

        graphshard.shard(model, plan)
        gm, inputs = capture_dynamo(model, torch.randn(4, 8))
        prepared = trace(prepare(gm, inputs), CompileConfig(lower="eager"), (model._graphshard,))
        g = run_passes(prepared.graph, prepared.ctx, pre_autograd_passes())
        return {n.name: (n.meta["recompute"].name, n.meta.get("ac_graph_id")) for n in g.graph.nodes if "recompute" in n.meta}

    def test_the_users_code_before_a_region_stays_out_of_it(self):
        plan = graphshard.Plan(mesh1d("dp"), {"block": graphshard.FullyShard(), "": graphshard.FullyShard()})
        tags = self._tagged(seeded(Prelude), plan)
        self.assertNotIn("tanh", tags)  # it feeds region 1 only, but it is not checkpointed
        self.assertEqual({r for name, (_, r) in tags.items() if name.startswith("gelu")}, {1, 2})

    def test_a_parameter_read_by_two_regions_is_gathered_again_not_saved(self):
        # the unit's gather is numbered as the later region that reads it: the partitioner's boundary
        # rule (a recomputed value read by a later region is saved) does not keep it for the backward
        plan = graphshard.Plan(mesh1d("dp"), {"block": graphshard.FullyShard(), "": graphshard.FullyShard()})
        tags = self._tagged(seeded(Prelude), plan)
        gathers = {r for name, (policy, r) in tags.items() if name.startswith("unshard") and policy == "MUST_RECOMPUTE"}
        self.assertEqual(gathers, {2})
        g = compiled_stages(seeded(Prelude), plan, (torch.randn(4, 8),))
        self.assertEqual(g["backward"].count("all_gather_into_tensor.default("), 1)  # block's unit, gathered again


def _calls(text: str) -> str:
    """The backward's compute and communication calls in order: collectives with their unit, the
    recomputed forward ops with their region; views, casts and packing left out."""
    import re

    out, note = [], None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            note = line
            continue
        m = re.search(r"torch\.ops\.(?:aten|_c10d_functional)\.(\w+)\.", line)
        if m and m.group(1) in ("mm", "gelu", "gelu_backward", "all_gather_into_tensor", "reduce_scatter_tensor",
                                "wait_tensor"):
            unit = re.search(r"'graphshard_unit': '([^']*)'", note or "")
            region = re.search(r"ac_graph_id: (\d+) - PREFER_RECOMPUTE", note or "")
            out.append(m.group(1) + (f" <- {unit.group(1)}" if unit else "") + (f" (region {region.group(1)})" if region else ""))
        note = None if not line.startswith("#") else note
    return "\n".join(out)


class TestCheckpointPlanOption(TestCase):
    def test_selective_that_saves_nothing_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"saves nothing, which is full checkpointing: use Checkpoint\(\)"):
            graphshard.Checkpoint(mode="selective", save=())

    def test_a_policy_needs_selective_mode(self):
        with self.assertRaisesRegex(ValueError, "is a selective policy: pass mode='selective'"):
            graphshard.Checkpoint(policy=lambda ctx, op, *a, **k: True)
        with self.assertRaisesRegex(ValueError, "expected 'full' or 'selective'"):
            graphshard.Checkpoint(mode="some")

    def test_a_key_that_matches_no_module_names_the_closest(self):
        model = seeded(MLPBlocks)
        with self.assertRaisesRegex(ValueError, r"Plan\(checkpoint=...\) key 'layer.\*' matches no module of MLPBlocks; "
                                                r"closest FQNs: \[.*'layers.0'"):
            graphshard.shard(model, _plan(**{"layer.*": graphshard.Checkpoint()}))

    def test_a_value_that_is_not_a_checkpoint_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"expected module FQN globs mapped to graphshard.Checkpoint"):
            _plan(**{"layers.*": "full"})

    def test_checkpointing_a_module_that_is_not_a_unit_is_a_logged_listed_choice(self):
        # inside a unit: its recomputation reads the unit's parameters again; spanning units: all at once
        model = seeded(MLPBlocks)
        with self.assertLogs("graphshard", logging.INFO) as logs:
            graphshard.shard(model, _plan(**{"layers.0.0": graphshard.Checkpoint(), "layers": graphshard.Checkpoint()}))
        text = graphshard.explain(model)
        for expected in ("checkpointed module 'layers.0.0' is part of unit 'layers.0'",
                         "checkpointed module 'layers' spans units ['layers.0', 'layers.1']"):
            self.assertIn(expected, text)
            self.assertTrue(any(expected in line for line in logs.output), logs.output)

    def test_users_checkpoint_runs_uncompiled_too(self):
        # the uncompiled path: torch's checkpoint recomputes in the backward, where its reads of the
        # parameters count as a forward's (gathered), not as the sharded DTensors
        class Checkpointed(MLPBlocks):
            def forward(self, x):
                for layer in self.layers:
                    x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
                return x

        self._uncompiled_matches(Checkpointed)

    def test_plan_checkpointing_runs_eagerly_too(self):
        # graphshard.shard without compiling (the eager debugging path) runs the same checkpointed forward
        self._uncompiled_matches(MLPBlocks, checkpoint={"layers.*": graphshard.Checkpoint()})

    def _uncompiled_matches(self, cls, **plan_options):
        """``cls`` sharded (replicated) and run without compiling: outputs and gradients equal plain torch's."""
        ref, model = seeded(cls), seeded(cls)
        graphshard.shard(model, graphshard.Plan(mesh1d("dp"), {"layers.*": graphshard.Replicate(),
                                                               "": graphshard.Replicate()}, **plan_options))
        x = torch.randn(4, 8)
        out, ref_out = model(x), ref(x)
        torch.testing.assert_close(out, ref_out)
        F.mse_loss(out, torch.zeros_like(out)).backward()
        F.mse_loss(ref_out, torch.zeros_like(ref_out)).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n].full_tensor() if hasattr(grads[n], "full_tensor") else grads[n], p.grad)
