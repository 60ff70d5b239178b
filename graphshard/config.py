"""Compile configuration: frozen, keyword-only, one docstring per field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    lower: Literal["inductor", "eager"] = "inductor"
    """'inductor' lowers forward and backward graphs with Inductor; 'eager' runs them as FX (debugging)."""
    limit_all_gathers: int = 2
    """Units whose all-gathers may be outstanding at once: the unit being computed plus
    ``limit_all_gathers - 1`` prefetched ahead of it (FSDP's ``limit_all_gathers``). 1 disables prefetch."""
    regional: bool = True
    """With Inductor: lower each compute region between communication steps on its own and
    compile each distinct region once (the layers of a model share them), instead of one
    Inductor compile of the whole graph. Inductor's work then grows with the number of
    distinct layers, not with depth; tracing still grows with depth (``graphshard.lowering``)."""
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
    ``docs/design.md``). Off by default: Inductor has no hook for it, so while a graphshard
    compile runs, ``AsyncCompile.cpp_pybinding`` and ``wait`` are replaced class-wide (under
    a lock; calls made on any other thread go to Inductor's own methods unchanged)."""
    fast_isa_check: bool = False
    """On x86 CPUs, run Inductor's vector-ISA build check for the ISA it will pick only, not
    for every ISA the CPU reports (~3 s instead of ~7 s on a cold cache). Off by default:
    Inductor caches its list of valid ISAs for the process, so a later Inductor compile in
    the process uses the list this check produced (the same list whenever the picked ISA
    builds; see ``_compat.inductor_cpu_settings``)."""
    dump_graphs: str | None = None
    """Directory to write every pass's graph before and after, with the op-count diff."""

    def __post_init__(self):
        if self.lower not in ("inductor", "eager"):
            raise ValueError(f"lower={self.lower!r}: expected 'inductor' or 'eager'")
        if self.limit_all_gathers < 1:
            raise ValueError(f"limit_all_gathers={self.limit_all_gathers}: must be at least 1")
