"""Every route of the table is lived or says why not (issue 13, part 1).

A route is IMPLEMENTED, or SEED_ONLY / DEFERRED with a reason (``validation.py`` refuses
a route without a status, or a non-implemented one without a reason). The README states
the counts; this file keeps that sentence equal to the table.
"""

from __future__ import annotations

from services.contract.permissions_doc import REPO, counts_sentence


def test_the_readme_states_the_route_counts_of_the_table():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert counts_sentence() in readme
