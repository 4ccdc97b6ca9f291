"""The stack the grouped real-stack modules of tests/cli share (tests/shared_stacks.py): the
fixture and the hooks that end a group's stack act on the tests of this directory only."""

from tests.shared_stacks import pytest_runtest_teardown, pytest_sessionfinish, shared_stack  # noqa: F401
