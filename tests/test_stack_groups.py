"""The modules that share a real stack (tests/conftest.py STACK_GROUPS): each group runs as one
unit of ``--dist loadfile`` (one test process, its files in the group's order), its modules take
their group's stack, and their fault injections never meet. No stack is started here."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tests import conftest
from tests.conftest import REPO, STACK_GROUPS
from tests.shared_stacks import GROUP_STACKS, group_env, group_injections

# Where each group's stack comes from: what its modules' tests ask for.
TAKES = {group: r"^def stack\(shared_stack\):" for group in GROUP_STACKS} | {
    "observability": r"^def test_\w+\([^)]*\bobs_stack\b"
}


def test_every_grouped_module_takes_its_groups_stack_and_every_module_that_takes_one_is_grouped():
    assert set(TAKES) == set(STACK_GROUPS)
    modules = {str(path.relative_to(REPO)): path.read_text() for path in (REPO / "tests").rglob("test_*.py")}
    for pattern in set(TAKES.values()):
        takers = {path for path, text in modules.items() if re.search(pattern, text, re.M)}
        assert takers == {path for group in TAKES if TAKES[group] == pattern for path in STACK_GROUPS[group]}, pattern


@pytest.mark.parametrize("group", sorted(GROUP_STACKS))
def test_a_groups_injections_are_each_modules_own_keyed_by_job_names_no_other_module_uses(group):
    joined = group_injections(group)  # (fails on a job name two modules inject into)
    for path in STACK_GROUPS[group]:
        module = __import__(path.removesuffix(".py").replace("/", "."), fromlist=["INJECT"])
        assert getattr(module, "INJECT", "") in joined


def test_a_group_runs_as_one_unit_of_the_scheduler_and_any_other_file_as_its_own():
    config = SimpleNamespace(getvalue={"dist": "loadfile", "tx": ["2*popen"]}.get)
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)
    for group, paths in STACK_GROUPS.items():
        assert {scheduler._split_scope(f"{path}::test_x") for path in paths} == {group}
    assert scheduler._split_scope("tests/faults/test_compound.py::test_x") == "tests/faults/test_compound.py"
    assert conftest.pytest_xdist_make_scheduler(SimpleNamespace(getvalue={"dist": "load"}.get), None) is None


def test_a_groups_files_are_collected_one_after_another_in_its_order_at_its_first_files_place():
    (group, paths), *_ = STACK_GROUPS.items()
    others = ["tests/test_jobspec.py", conftest.LONGEST_FIRST[1]]
    items = [SimpleNamespace(nodeid=f"{path}::test_{i}") for path in [*others, *reversed(paths)] for i in range(2)]
    conftest.pytest_collection_modifyitems(None, None, items)
    files = [item.nodeid.split("::", 1)[0] for item in items]
    first = min(paths, key=lambda p: conftest.LONGEST_FIRST.index(p) if p in conftest.LONGEST_FIRST else 1e9)
    before = conftest.LONGEST_FIRST.index(first) < conftest.LONGEST_FIRST.index(others[1])
    ran = [f for i, f in enumerate(files) if i % 2 == 0]
    assert ran == ([*paths, others[1]] if before else [others[1], *paths]) + [others[0]], ran
    assert [item.nodeid.split("::")[1] for item in items[:2]] == ["test_0", "test_1"]  # (a file's own order kept)


@pytest.mark.parametrize("group", sorted(GROUP_STACKS))
def test_a_groups_environment_is_each_modules_stack_env_and_two_modules_may_not_disagree(group, monkeypatch):
    joined = group_env(group)
    for path in STACK_GROUPS[group]:
        module = __import__(path.removesuffix(".py").replace("/", "."), fromlist=["STACK_ENV"])
        assert getattr(module, "STACK_ENV", {}).items() <= joined.items()
    # A second module setting one of the group's variables to another value fails the start.
    first, *others = STACK_GROUPS[group]
    if not joined or not others:
        return
    key = next(iter(joined))
    last = __import__(others[-1].removesuffix(".py").replace("/", "."), fromlist=["STACK_ENV"])
    monkeypatch.setattr(
        last, "STACK_ENV", {**getattr(last, "STACK_ENV", {}), key: joined[key] + "-other"}, raising=False
    )
    with pytest.raises(AssertionError, match=key):
        group_env(group)
