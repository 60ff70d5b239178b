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
