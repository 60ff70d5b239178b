"""Speedups of Inductor's CPU builds. On by default: the vector-ISA build check split between local
ranks (`share_isa_checks`, Inductor's own check, nothing set). Opt-in, off by default
(``CompileConfig.fast_isa_check``): the vector-ISA check shortcut, which sets Inductor's config
inside graphshard's own config patch (thread-scoped) and replaces nothing. The one speedup that
replaces Inductor's methods, C++ kernels built together, is `graphshard.compiler.experimental`.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from graphshard import _compat

log = logging.getLogger(__name__)


_isa_checks: dict[str, Future] = {}  # ISA -> its build check, started by inductor_cpu_warmup
_isa_lock = threading.Lock()


def inductor_cpu_warmup() -> None:
    """Starts, on a thread of its own, the check Inductor makes before its first C++ kernel,
    that the compiler builds (and the machine loads) code for the vector ISA it will use.
    Started when the joint graph's partition begins, it runs beside the ranks' partitions;
    started earlier it slows the tracing ranks. ``inductor_cpu_settings`` reads its result.
    Only with ``CompileConfig.fast_isa_check``."""
    isa = _picked_isa()
    if isa is None:
        return
    with _isa_lock:
        if str(isa) not in _isa_checks:
            pool = ThreadPoolExecutor(1, thread_name_prefix="graphshard-inductor-warmup")
            _isa_checks[str(isa)] = pool.submit(bool, isa)
            pool.shutdown(wait=False)  # the thread ends once the check is done


def inductor_cpu_settings() -> dict[str, Any]:
    """Inductor settings for a compile of CPU code: ``cpp.vec_isa_ok`` once the ISA Inductor
    picks has passed its build check (``CompileConfig.fast_isa_check``, off by default).

    Inductor's ``valid_vec_isa_list`` builds a test library for every ISA the CPU reports,
    one after another (AVX-512 VNNI, AVX-512 and AVX2 here: ~7 s of gcc on the 2-core
    machine, ~3 s for the first), though it uses only the one it picks: the first of that
    list. Each ISA's flags include the next one's, so a compiler that builds the first, on a
    machine that loads it, builds the others too. graphshard checks only the ISA Inductor will
    pick, with Inductor's own check (``bool(isa)``, cached per process and on disk), and when
    it is the first and passes tells Inductor the check is done. Otherwise (another ISA asked
    for through ``ATEN_CPU_CAPABILITY``, ``cpp.simdlen`` or ``cpp.vec_isa_ok`` set by the
    user, a CPU other than x86, a failed check) it returns no setting and Inductor checks
    every ISA itself, as without graphshard.

    The setting lives only inside graphshard's config patch (thread-local in torch >= 2.12),
    but Inductor keeps the list of valid ISAs it builds under it for the whole process
    (``valid_vec_isa_list`` is cached): a compile that runs later in the process, on any
    thread, takes its list from graphshard's check instead of checking every ISA. That list
    is the one Inductor's own check gives whenever the first ISA builds and loads (each
    ISA's flags include the next one's), which is why this is an opt-in and not a default."""
    isa = _picked_isa()
    if isa is None:
        return {}
    inductor_cpu_warmup()
    with _isa_lock:
        check = _isa_checks[str(isa)]
    try:
        ok = check.result()
    except Exception as e:  # noqa: BLE001 - Inductor then runs its own check
        log.warning("graphshard: the %s build check failed (%r); Inductor checks every ISA itself", isa, e)
        ok = False
    return {"cpp.vec_isa_ok": True} if ok else {}


def _picked_isa():
    """The ISA Inductor will pick when it is the first one the CPU reports and nothing asks for
    another (read afresh on every call, no build); None when the shortcut does not apply."""
    config = _compat.inductor_config()
    isa_mod = _compat.inductor_cpu_vec_isa()

    names = ("x86_isa_checker", "supported_vec_isa_list", "get_isa_from_cpu_capability", "invalid_vec_isa")
    if (not all(hasattr(isa_mod, name) for name in names) or platform.machine() not in ("x86_64", "AMD64")
            or config.is_fbcode() or config.cpp.simdlen is not None or config.cpp.vec_isa_ok is not None):
        return None
    candidates = _reported_isas(isa_mod)
    if not candidates:
        return None
    picked = isa_mod.get_isa_from_cpu_capability(os.getenv("ATEN_CPU_CAPABILITY"), candidates,
                                                  isa_mod.invalid_vec_isa)
    return picked if picked is candidates[0] else None


def _reported_isas(isa_mod) -> list:
    """The vector ISAs of Inductor's list whose flags this x86 CPU reports, in Inductor's order
    (`valid_vec_isa_list`'s filter, before its build check)."""
    flags = isa_mod.x86_isa_checker()
    return [isa for isa in isa_mod.supported_vec_isa_list if all(f in flags for f in str(isa).split())]


# --- the vector-ISA build check, split between local ranks -----------------------------------
#
# Before its first C++ kernel a process runs Inductor's `valid_vec_isa_list`: a test library
# built and loaded for every vector ISA the CPU reports (four here, 1.6-3.0 s of gcc each). The
# build of an ISA is behind a file lock in the shared cache directory, so local ranks that reach
# it together build the ISAs one after another, each waiting on the lock of the ISA another rank
# is building: ~9 s on every rank of the 2-core machine, one core idle. Split, each rank builds the
# ISAs it claims while the others build theirs, and Inductor's own check then finds the other
# ranks' libraries built and only loads them. Nothing is set or replaced: the list is Inductor's.

def share_isa_checks(share, inputs) -> dict[str, float]:
    """Runs Inductor's build check (``bool(isa)``, cached per process and on disk) for each vector
    ISA of this CPU that this rank wins the claim of in ``share`` (`compile_share.SharedCompile`),
    before Inductor checks them all. Only for work with CPU ``inputs``, before this process's
    first check, on x86, with ``cpp.vec_isa_ok`` unset (otherwise Inductor checks nothing or has
    checked already). Returns the seconds of each ISA this rank checked (explain's note), nothing
    when it did not run."""
    if not any(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in inputs):
        return {}
    config = _compat.inductor_config()
    isa_mod = _compat.inductor_cpu_vec_isa()
    listed = getattr(isa_mod, "valid_vec_isa_list", None)
    if (listed is None or not hasattr(listed, "cache_info") or listed.cache_info().currsize
            or not all(hasattr(isa_mod, n) for n in ("x86_isa_checker", "supported_vec_isa_list"))
            or platform.machine() not in ("x86_64", "AMD64") or config.is_fbcode()
            or config.cpp.vec_isa_ok is not None):
        return {}
    seconds: dict[str, float] = {}
    for isa in _reported_isas(isa_mod):
        if not share.claim(f"inductor-vec-isa/{isa}"):
            continue
        start = time.perf_counter()
        try:
            bool(isa)
        except Exception as e:  # noqa: BLE001 - Inductor's own check runs it again and reports
            log.warning("graphshard: Inductor's build check of %s failed here (%r); Inductor checks it again", isa, e)
        seconds[str(isa)] = time.perf_counter() - start
    if seconds:
        log.info("graphshard: Inductor's vector-ISA build check, this rank's share: %s", describe_isa_checks(seconds))
    return seconds


class IsaShare:
    """`share_isa_checks` for one compile, on a thread of its own from the compile's first partition
    (`start`) to its first lowering (`seconds`), which needs Inductor's ISA list.

    Codegen waits for the check, and a rank that claimed none of the ISAs waits in Inductor's file
    lock for the rank building them: with one ISA (an AVX2 machine) one rank builds it while the
    other idles, 3.5 s of the 2-core machine's 4.4 s check. Started with the partition, the check
    runs beside the ranks' partitions instead. Started earlier (at the backend's entry) it slowed
    the tracing ranks more than it saved (``docs/design/compile-time.md``)."""

    def __init__(self, share) -> None:
        self.share = share
        self.future: Future | None = None
        self.taken = False

    def start(self, inputs) -> None:
        if self.future is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="graphshard-isa-check")
            self.future = pool.submit(share_isa_checks, self.share, list(inputs))
            pool.shutdown(wait=False)  # the thread ends once the check is done

    def seconds(self, inputs) -> dict[str, float]:
        """The seconds of each ISA this rank checked (started now if no partition started it), once:
        later calls return nothing."""
        self.start(inputs)
        if self.taken:
            return {}
        self.taken = True
        return self.future.result()


ISA_SPLIT_NOTE = "Inductor's vector-ISA build check split between the local ranks, this rank's share: "
"""explain's note for this process's share of the check: a program loaded from the cache does not
carry it (`program_cache.ReportDelta`), since the process that loads it checks nothing."""


def describe_isa_checks(seconds: dict[str, float]) -> str:
    return ", ".join(f"{isa} {s:.2f}s" for isa, s in seconds.items())
