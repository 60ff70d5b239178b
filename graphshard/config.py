"""Compile configuration: frozen, keyword-only, one docstring per field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    lower: Literal["inductor", "eager"] = "inductor"
    """'inductor' lowers forward and backward graphs with Inductor; 'eager' runs them as FX (debugging)."""
    forward_prefetch: bool = True
    """Where the forward graph issues each unit's parameter all-gather (FSDP1's
    ``forward_prefetch``; units in the order of their first use). True: the next unit's
    all-gather is issued right after the current unit's all-gather is waited, before the
    current unit's compute, so it runs under that compute (with ``limit_all_gathers=L``, unit
    k's all-gather follows the wait of unit k-L+1's). False: each unit's all-gather is issued
    at its first use, right before the unit's compute and after the previous unit's compute."""
    backward_prefetch: Literal["pre", "post"] | None = "pre"
    """Where the backward graph issues the re-gathers of FULL_SHARD units, in backward order
    (FSDP1's ``backward_prefetch``: BACKWARD_PRE, BACKWARD_POST, None). 'pre': the next
    unit's all-gather is issued right after the current unit's all-gather is waited, before
    the current unit's gradient computation that reads its parameters (gradient work that
    needs none, such as its last matmul's weight gradient, may run first). 'post': right
    after the current unit's gradient computation (every use of its gathered parameters and
    the gradients its reduction reads). Under both, the current unit's gradient reduction is
    issued after that all-gather, as FSDP1 orders them. None: each unit's all-gather is
    issued at its first use. With ``limit_all_gathers=L``, "current" is unit k-L+1 for unit k."""
    limit_all_gathers: int | None = 2
    """Units whose all-gathers may be outstanding at once, in the forward and in the
    backward: the unit being computed plus ``limit_all_gathers - 1`` gathered ahead of it
    (FSDP1's ``limit_all_gathers=True`` keeps two: 2). A prefetched all-gather of unit k is
    placed relative to unit k-L+1; the first L-1 units of a graph are issued at its start.
    1 disables prefetch (every all-gather at its first use). None: unbounded (FSDP1's
    ``limit_all_gathers=False``): with prefetch on, every unit's all-gather is issued at the
    start of its graph, and all of that graph's gathered units may be alive at once."""
    regional: bool = True
    """With Inductor: lower each compute region between communication steps on its own and
    compile each distinct region once (the layers of a model share them), instead of one
    Inductor compile of the whole graph. Inductor's work then grows with the number of
    distinct layers, not with depth; tracing still grows with depth (``graphshard.compiler.lowering``)."""
    strict: bool = False
    """Make a missing placement rule an error (naming the op and node) instead of a logged fallback."""
    share_compile: bool = True
    """Ranks on one machine share the Inductor work through its on-disk cache instead of each
    compiling the same kernels: each local rank compiles the regions (or whole graphs) it
    claims in the process group's store, keyed by their content, and loads the ones other
    ranks claimed once they are done. It never waits on a collective, so a graph that only
    some ranks compile (a recompile, a rank-dependent branch) compiles there alone."""
    batch_cpp_kernels: bool = False
    """On the CPU, build the C++ kernels of graphshard's Inductor compiles as one library per
    block of regions instead of one gcc run each (most of a gcc run is fixed cost; see
    ``docs/design/compile-time.md``). Experimental, off by default (`graphshard.compiler.experimental`):
    Inductor has no hook for it, so while a graphshard
    compile runs, ``AsyncCompile.cpp_pybinding`` and ``wait`` are replaced class-wide (under
    a lock; calls made on any other thread go to Inductor's own methods unchanged)."""
    fast_isa_check: bool = False
    """On x86 CPUs, run Inductor's vector-ISA build check for the ISA it will pick only, not
    for every ISA the CPU reports (~3 s instead of ~7 s on a cold cache). Off by default:
    Inductor caches its list of valid ISAs for the process, so a later Inductor compile in
    the process uses the list this check produced (the same list whenever the picked ISA
    builds; see ``inductor_cpu.inductor_cpu_settings``)."""
    check_collectives: bool = True
    """At each compiled program's first run, compare its collectives (op, group, dtype, sizes,
    order) with the other ranks' through the job's store before issuing any: a rank that would
    issue different ones (a rank-dependent branch, another plan or shape) raises an error naming
    the first that differs, on every rank, instead of hanging the job. No collective is used and
    every wait is bounded (``graphshard.compiler.collective_check``); ``explain`` prints its cost
    (a store round trip per process group and peer, once per program). With a model-parallel axis,
    every call also compares its inputs' shapes over each model-parallel group (a store round trip
    per call), so a rank fed another batch at any step stops the same way."""
    trace_once: bool = True
    """Trace, differentiate and partition each distinct repeated unit once: units whose per-rank
    programs are identical (a model's repeated blocks) are outlined into one shared body for
    aot_autograd and put back in place after the partition (``graphshard.compiler.outline``),
    so that part of the first step grows with the distinct units, not with depth. False: every
    unit traced in line (torch < 2.13 always does that; ``explain`` says which applied)."""
    program_cache: bool = True
    """Keep each compiled program in torch's on-disk AOTAutogradCache (torch >= 2.13, Inductor
    lowering): a later process with the same model, plan, inputs and settings loads the lowered
    forward and backward programs instead of differentiating, partitioning, scheduling and
    lowering again (``graphshard.compiler.program_cache``; dynamo, the trace to ATen and the
    pre-autograd passes still run, since the key is taken of their result). ``explain`` says
    whether a program was loaded, stored or why not. False: compile every program afresh (what
    torch < 2.13, ``lower="eager"`` and CUDA graphs always do)."""
    dump_graphs: str | None = None
    """Directory to write every pass's graph before and after, with the op-count diff."""

    def __post_init__(self):
        if self.lower not in ("inductor", "eager"):
            raise ValueError(f"lower={self.lower!r}: expected 'inductor' or 'eager'")
        limit = self.limit_all_gathers
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit_all_gathers={limit!r}: expected an int >= 1 (1 disables prefetch) or None "
                             "(unbounded); FSDP1's limit_all_gathers=True is 2, False is None")
        if self.backward_prefetch not in ("pre", "post", None):
            raise ValueError(f"backward_prefetch={self.backward_prefetch!r}: expected 'pre', 'post' or None "
                             "(FSDP1's BackwardPrefetch.BACKWARD_PRE, BACKWARD_POST, None)")
        if not isinstance(self.forward_prefetch, bool):
            raise ValueError(f"forward_prefetch={self.forward_prefetch!r}: expected True or False")
