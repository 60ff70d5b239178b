"""torch's own tensor-parallel test models under graphshard's ``parallelize_module`` (issue 75).

tests/workers/peer_dtensor.py imports ``torch.testing._internal.distributed._tensor.common_dtensor``
(``Transformer``/``ModelArgs``, ``MLPModule``, ``MLPStacked``, ``ExpertLayer``, the user-defined style
``TensorParallelForExpert`` and the helpers' own ``Transformer.parallelize``, run with graphshard's
``parallelize_module`` and styles in its globals) and trains each case two SGD steps on 2 gloo
ranks three ways: the single process on the whole batch, torch's ``parallelize_module``, graphshard's.
Every case is compared with the single process (1e-5 on outputs, losses, every gradient and
parameter; NaN fails); where torch's TP runs on a CPU, with torch's TP too.

Torch's own TP cannot run the helpers' ``Transformer`` on a CPU with its DTensor q/k/v
(``use_local_output=False``, the helpers' default; with local q/k/v it runs and is compared): DTensor has no sharding rule for CPU flash
attention (``aten._scaled_dot_product_flash_attention_for_cpu``; under the math backend it fails on
a mixed Tensor/DTensor add instead). Those cases (TORCH_CANNOT) are compared with the single process
only, and the test checks torch's error. Nothing skipped counts as passed.
"""

from __future__ import annotations

import math

import pytest

from _coverage_share import ci_share, launch_groups, lowering
from _launch import CaseResults, run_cases

pytestmark = pytest.mark.multirank
TOL = 1e-5

MATCHED = [
    # the helpers' own Transformer.parallelize: root, then each block, then the output (tied: its default)
    "helpers_tp", "helpers_sp", "helpers_tp_untied", "helpers_sp_untied",
    # the same plan with the calls the other way round, and in one call
    "reverse_order", "one_call_tp", "one_call_sp",
    # torch's recipe of local q/k/v outputs (use_local_output=True) with attn.n_heads = n_heads // tp:
    # graphshard's whole reading fails on the local head count, so the outputs are read as the pieces
    "helpers_local_attn", "helpers_local_attn_sp",
    # the helpers' user-defined style TensorParallelForExpert, in the Transformer (TP, SP) and alone
    "helpers_experts_tp", "helpers_experts_sp", "expert_style",
    # vocabulary-sharded DTensor logits, cross-entropy under loss_parallel()
    "loss_parallel",
    # MLPModule (TP; torch's sequence-parallel MLP, each rank its rows), MLPStacked one call per block
    "mlp", "mlp_sp", "mlp_stacked",
]
TORCH_CANNOT = {
    c: "does not have a sharding strategy registered"  # DTensor q/k/v meet CPU flash attention
    for c in ("helpers_tp", "helpers_sp", "helpers_tp_untied", "helpers_sp_untied", "reverse_order",
              "one_call_tp", "one_call_sp", "helpers_experts_tp", "helpers_experts_sp", "loss_parallel")
}
REFUSED = {
    # a user style whose output_fn doubles the output (no redistribution); graphshard refuses naming the
    # style and the module. torch fails on it too on a CPU (distribute_module replicates net2's weight
    # as a DTensor, and net1's plain local output meets it: "mixed torch.Tensor and DTensor")
    "odd_hook": ("NotImplementedError", "DoubledOutput on 'net2': the style's output_fn computes something "
                                        "that is no redistribution"),
}
FALLBACKS = {
    # SP experts: the experts' rows (Shard(0) of the flattened tokens, the style's output_layouts)
    # meet the sequence-sharded residual (Shard(1)); the add gathers the rows (listed by explain)
    "helpers_experts_sp": 2,
}
FULL_ONLY = {"helpers_tp", "helpers_sp_untied", "helpers_tp_untied", "one_call_tp", "one_call_sp",
             "helpers_experts_sp", "mlp", "mlp_stacked", "helpers_sp", "helpers_local_attn_sp", "loss_parallel"}
"""Run under ``--coverage full`` only: each repeats a CI case's mechanism (the helpers' own calls with a
tied weight and the user style: helpers_experts_tp; calls in the other order: reverse_order; local
q/k/v: helpers_local_attn; torch's SP MLP: mlp_sp) on another plan; loss_parallel's DTensor logits
are CI's in tests/test_multirank.py (tp_numerics)."""
INDUCTOR_IN_CI: set = set()
"""CI lowers every case as FX (one launch): the subject is the frontend's calls and styles, not the
lowering; ``--coverage full`` lowers each with Inductor."""

CASES = MATCHED + list(REFUSED)


@pytest.fixture(scope="module")
def results(request):
    out = CaseResults()
    for group, env in launch_groups(request.config, ci_share(request.config, CASES, FULL_ONLY), INDUCTOR_IN_CI):
        out.update(run_cases("peer_dtensor.py", group, nproc=2, env=env, timeout=1200))
    return out


def _within(errs: dict) -> bool:
    return all(math.isfinite(v) and v <= TOL for v in errs.values())


@pytest.mark.parametrize("case", MATCHED)
def test_matches_the_single_process_and_torch(results, request, case):
    r = results[case]
    assert "refused" not in r, f"{r['refused']}\n{r.get('traceback', '')}"
    assert r["lowering"] == lowering(request.config, case, INDUCTOR_IN_CI), r
    assert _within(r["ours"]), ("graphshard vs the single process", r["ours"])
    assert r["same_names"], "named_parameters() differs from the single process's"
    assert r["same_state_dict"], "state_dict() keys or shapes differ from the single process's"
    if case in TORCH_CANNOT:
        assert TORCH_CANNOT[case] in r.get("torch_error", ""), r.get("torch_error", r.get("torch"))
    else:
        assert "torch_error" not in r, r["torch_error"]
        assert _within(r["torch"]), ("torch's TP vs the single process", r["torch"])
        assert _within(r["ours_vs_torch"]), ("graphshard vs torch's TP", r["ours_vs_torch"])
        assert r["dtensors"] == r["torch_dtensors"], (r["dtensors"], r["torch_dtensors"])
    assert len(r["fallbacks"]) == FALLBACKS.get(case, 0), r["fallbacks"]


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_its_reason(results, case):
    kind, *messages = REFUSED[case]
    r = results[case]
    assert "refused" in r, f"{case} ran: {r}"
    assert r["refused"].startswith(kind) and all(m in r["refused"] for m in messages), r["refused"]
    assert "mixed torch.Tensor and DTensor" in r.get("torch_error", ""), r.get("torch_error", r.get("torch"))
