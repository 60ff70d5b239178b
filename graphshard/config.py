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
    Inductor compile of the whole graph. Compile time then grows with the number of
    distinct layers, not with depth (``graphshard.lowering``)."""
    strict: bool = False
    """Make a missing placement rule an error (naming the op and node) instead of a logged fallback."""
    share_compile: bool = True
    """Ranks on one machine share the Inductor work through its on-disk cache instead of each
    compiling the same kernels: with ``regional`` lowering each local rank compiles a share of
    the distinct regions, then loads the others'; without, local rank 0 compiles first."""
    dump_graphs: str | None = None
    """Directory to write every pass's graph before and after, with the op-count diff."""

    def __post_init__(self):
        if self.lower not in ("inductor", "eager"):
            raise ValueError(f"lower={self.lower!r}: expected 'inductor' or 'eager'")
        if self.limit_all_gathers < 1:
            raise ValueError(f"limit_all_gathers={self.limit_all_gathers}: must be at least 1")
