"""`surgectl events --type/--tail` and `status --watch` (issue 31 item 7): the event types the
filter knows are every type control records; a bad type is one line; a relative
``init_from.hf`` is submitted absolute (no scratch path hard-coded in the examples)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.cli.errors import CliError
from services.cli.event_types import EVENT_TYPES, event_types, last
from services.cli.spec_tools import load_spec

REPO = Path(__file__).resolve().parents[2]


def _recorded_types() -> dict[str, str]:
    """Every literal event type control's orchestrator records (``_record(job, source,
    TYPE, ...)``, both arms of a conditional one), with where."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "services" / "control").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "_record" or len(node.args) < 3:
                continue
            arg = node.args[2]
            for value in (arg.body, arg.orelse) if isinstance(arg, ast.IfExp) else (arg,):
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.setdefault(value.value, f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_event_type_control_records_can_be_asked_for():
    recorded = _recorded_types()
    assert {"state", "fault", "decision", "checkpoint"} <= set(recorded)  # (the scan finds them)
    unlisted = {t: where for t, where in recorded.items() if t not in EVENT_TYPES}
    assert unlisted == {}, f"add these to services/cli/event_types.py EVENT_TYPES: {unlisted}"


def test_the_readme_lists_every_event_type_the_filter_knows():
    (row,) = [
        line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `surgectl events JOB")
    ]
    listed = row.split("keeps those types (", 1)[1].split(";", 1)[0]
    assert [t.strip().strip("`") for t in listed.split(",")] == list(EVENT_TYPES)


@pytest.mark.parametrize(
    ("values", "wanted"),
    [([], set()), (["fault"], {"fault"}), (["fault,decision", " state "], {"fault", "decision", "state"})],
)
def test_types_are_repeated_or_comma_separated(values, wanted):
    assert event_types(values) == wanted


def test_an_unknown_type_is_one_line_naming_the_known_ones():
    with pytest.raises(CliError) as e:
        event_types(["faults"])
    assert e.value.code == 2 and str(e.value).startswith("--type: unknown event type faults (one of: state, ")


SPEC = """\
name: ft
steps: 3
init_from: {hf: HF}
model: {n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 16, micro_batch_size: 1}
"""


@pytest.mark.parametrize("overridden", [False, True])
def test_a_relative_init_from_hf_is_submitted_absolute_against_the_current_directory(tmp_path, monkeypatch, overridden):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ft.yaml"
    path.write_text(SPEC.replace("HF", "/abs/model" if overridden else "exports/m"))
    overrides = ["init_from.hf=exports/m"] if overridden else []
    spec, text, _ = load_spec(path, overrides)  # (the directory's config.json is read at submit)
    assert spec.init_from.hf == str(tmp_path / "exports" / "m") and str(tmp_path) in text


def test_an_absolute_init_from_hf_keeps_the_files_own_text(tmp_path):
    path = tmp_path / "ft.yaml"
    path.write_text("# mine\n" + SPEC.replace("HF", "/abs/model"))
    spec, text, _ = load_spec(path)
    assert spec.init_from.hf == "/abs/model" and text.startswith("# mine\n")


@pytest.mark.parametrize(
    ("tail", "kept"),
    [(None, [1, 2, 3, 4, 5]), (0, []), (2, [4, 5]), (5, [1, 2, 3, 4, 5]), (7, [1, 2, 3, 4, 5])],
)
def test_tail_keeps_the_last_n_and_zero_keeps_none(tail, kept):
    # (`--tail 0 --follow`: only what comes next; it had printed the whole history)
    assert last([1, 2, 3, 4, 5], tail) == kept


@pytest.mark.parametrize("values", [[""], [" , "], ["fault", ""]])
def test_an_empty_type_is_refused_not_read_as_every_type(values):
    with pytest.raises(CliError) as e:
        event_types(values)
    assert e.value.code == 2 and str(e.value).startswith("--type: empty")
