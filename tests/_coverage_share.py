"""The CI share of the multi-rank suites.

A module whose launch fixture runs many cases may name some ``FULL_ONLY``: cases that another CI
case already covers feature for feature, which only ``--coverage full`` runs. Its fixture launches
`ci_share` of its cases; conftest deselects the tests parametrized over the others (``case``),
which pytest reports as deselected, never as passes or skips.
"""

from __future__ import annotations


def full_coverage(config) -> bool:
    return config.getoption("coverage") == "full"


def ci_share(config, cases, full_only) -> list:
    """``cases`` without ``full_only`` (matched with any ``:{dir}`` placeholder removed), or all of
    them under ``--coverage full``."""
    if full_coverage(config):
        return list(cases)
    return [c for c in cases if c.replace(":{dir}", "") not in full_only]


LOWER_ENV = "GS_TEST_LOWER"
"""Set to ``eager`` in a launch's environment, its worker's graphshard programs run as FX
(``lower="eager"``) instead of through Inductor (`launch_groups`; the workers read it with
``workers/_runner.lowering``)."""


def launch_groups(config, cases, inductor_in_ci) -> list[tuple[list, dict]]:
    """``cases`` as (cases, extra environment) groups to launch. Under ``--coverage full`` every case
    lowers with Inductor; in CI only ``inductor_in_ci`` do and the rest run as FX. The first compile of
    each distinct Inductor kernel is a third of CI's time on its 2-core machine, and where a case's
    subject is a frontend's semantics, a plan or a sparse exchange rather than the lowering, the FX
    program runs the same collectives and ops: each suite keeps Inductor on the cases that put its
    features through it."""
    groups = [[c for c in cases if lowering(config, c, inductor_in_ci) == lower] for lower in ("inductor", "eager")]
    return [(g, launch_env(config, g[0], inductor_in_ci)) for g in groups if g]


def launch_env(config, case, inductor_in_ci) -> dict:
    """The environment a launch of ``case`` adds (`lowering`)."""
    return {} if lowering(config, case, inductor_in_ci) == "inductor" else {LOWER_ENV: "eager"}


def lowering(config, case, inductor_in_ci) -> str:
    """The lowering `launch_groups` gives ``case``: what its worker must report running."""
    return "inductor" if full_coverage(config) or case in inductor_in_ci else "eager"
