"""Compile work shared by the ranks on one machine, which share its on-disk Inductor cache
(``CompileConfig.share_compile``): claims in the process group's store, keyed by the work's
content, and never a collective (see `SharedCompile`)."""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from graphshard import _compat

log = logging.getLogger(__name__)


def local_ranks() -> tuple[int, int] | None:
    """(local rank, local world size) when several ranks of a real process group share this
    machine (and so its on-disk Inductor cache); None otherwise."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if local_world == 1:
        return None
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())), local_world


def compile_threads() -> int:
    """Inductor's compile workers per rank: the machine's cores divided between the local
    ranks, which already compile side by side; Inductor's default (one worker per core in
    every rank) oversubscribes them. ``TORCHINDUCTOR_COMPILE_THREADS``, when set, wins."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = local_ranks()
    return max(1, cores // (local[1] if local else 1))


# How long a rank waits for compile work another local rank claimed before compiling it
# itself. The claimer does not wait on anything while it compiles, so the bound is only a
# safety net (a claimer that died or stalls); it is far above one rank's share of a compile.
CLAIM_WAIT_S = 300.0


def shared_compile(enabled: bool) -> SharedCompile | None:
    """Compile work shared by the local ranks (they share the on-disk Inductor cache), or None
    (one rank on this machine, the FX graph cache off, ``share_compile=False``)."""
    local = local_ranks() if enabled and _compat.inductor_fx_graph_cache_enabled() else None
    if local is None:
        return None
    node = os.environ.get("GROUP_RANK", "0")  # local ranks share a cache; other machines claim apart
    return SharedCompile(_compat.default_store(), f"graphshard/compile/{node}/")


class SharedCompile:
    """Claims on compile work in the process group's store, keyed by the work's content.

    A rank compiles what it wins the claim of (``claim``: the first ``store.add`` on the
    key), says so when its result is in the on-disk cache (``done``), and waits for work
    another rank claimed (``wait``, bounded by ``CLAIM_WAIT_S``) before loading it from the
    cache. Nothing here is a collective: a rank waits only for a key another rank has
    already claimed, so a graph only some ranks compile (a recompile on one rank, a
    rank-dependent branch) never waits on ranks that do not compile it. A key claimed in an
    earlier compile of the job is done already, and every rank loads that work from the cache.
    """

    def __init__(self, store, prefix: str, wait_s: float = CLAIM_WAIT_S):
        self.store, self.prefix, self.wait_s = store, prefix, wait_s

    def claim(self, digest: str) -> bool:
        return self.store.add(f"{self.prefix}{digest}/claims", 1) == 1

    def done(self, digest: str) -> None:
        self.store.set(f"{self.prefix}{digest}/done", b"1")

    def deadline(self) -> float:
        return time.monotonic() + self.wait_s

    def wait(self, digest: str, deadline: float) -> bool:
        """Until the claimer of ``digest`` is done or ``deadline`` passes; True when it was done."""
        key = f"{self.prefix}{digest}/done"
        if self.store.check([key]):
            return True
        left = deadline - time.monotonic()
        if left >= 0.001:  # a zero timeout is "no timeout" to c10d's stores
            try:
                self.store.wait([key], datetime.timedelta(seconds=left))
                return True
            except Exception:  # noqa: BLE001 - the store's timeout error type varies by store and version
                pass
        log.warning("graphshard: compile work %s claimed by another local rank is not done after %.0f s; "
                    "compiling it here", digest[:12], self.wait_s)
        return False


def shared_whole_graph(share: SharedCompile | None, g: fx.GraphModule, inputs, is_backward: bool,
                        compile_fn: Callable[[], Callable]) -> Callable:
    """Whole-graph lowering, shared: the rank that claims the graph compiles it first; the
    others wait for it (bounded) and then compile with its kernels in the on-disk cache."""
    if share is None:
        return compile_fn()
    metas = [(tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in inputs]
    digest = hashlib.sha256(repr((is_backward, g.code, metas)).encode()).hexdigest()
    if not share.claim(digest):
        share.wait(digest, share.deadline())
        return compile_fn()
    try:
        return compile_fn()
    finally:
        share.done(digest)
