"""The job spec's list of fault classes (services/jobspec/fault_policy.py KNOWN_FAULT_CLASSES) holds every
class control can report: a policy entry for a class missing there would be refused as a typo."""

from __future__ import annotations

import ast
import pathlib

import pytest

from services.control import fault_detector, orchestrator
from services.jobspec import DEFAULT_CLASS_ACTIONS, KNOWN_FAULT_CLASSES, STEP_FAULT_CLASSES

pytestmark = pytest.mark.timeout(60)


def _exception_classes() -> set[str]:
    """Every ``fault_class = "<name>"`` (or ``fault_class="<name>"``) literal in services/: the
    classes failures carry."""
    found: set[str] = set()
    for path in pathlib.Path(__file__).resolve().parents[1].joinpath("services").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.keyword) and node.arg == "fault_class":
                targets, value = [], node.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.add(value.value)
                continue
            else:
                continue
            names = {getattr(t, "id", None) or getattr(t, "attr", None) for t in targets}
            # a literal, or ``"a" if cond else "b"``
            leaves = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
            if "fault_class" in names:
                found.update(v.value for v in leaves if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return found


def test_every_class_control_can_report_is_known_to_the_job_spec():
    reported = (
        set(fault_detector.DEFAULT_RULES)
        | set(fault_detector.FAILURE_CLASSES.values())
        | set(fault_detector.ALIASES)
        | set(fault_detector.ALIASES.values())
        | {orchestrator.STORE_UNREACHABLE, orchestrator.NO_CAPACITY, orchestrator.RECOVERY_TIMEOUT}
        | set(DEFAULT_CLASS_ACTIONS)
        | set(STEP_FAULT_CLASSES)
        | _exception_classes()
    )
    assert reported - KNOWN_FAULT_CLASSES == set()
