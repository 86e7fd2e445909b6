"""The test tiers of tests/tiers.py: every test file has one, every name in it exists,
and conftest.py puts them on the tests as registered markers (make test-fast is -m fast)."""

from __future__ import annotations

import ast

from tests import tiers
from embgeom.testing.serve import REPO

TESTS = REPO / "tests"


def _test_functions(file_name: str) -> set[str]:
    tree = ast.parse((TESTS / file_name).read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")}


def test_every_test_file_has_a_tier_and_every_tiered_file_exists():
    files = {path.name for path in TESTS.glob("test_*.py")}
    assert sorted(files - tiers.FILE_TIERS.keys()) == [], "add these files to tests/tiers.py"
    assert sorted(tiers.FILE_TIERS.keys() - files) == [], "these files are gone: drop them from tests/tiers.py"
    assert set(tiers.FILE_TIERS.values()) <= set(tiers.TIERS)


def test_every_test_given_its_own_tier_exists_and_differs_from_its_files():
    for key, tier in tiers.TEST_TIERS.items():
        file_name, _, function = key.partition("::")
        assert function in _test_functions(file_name), f"{key}: no such test"
        assert tier in tiers.TIERS and tier != tiers.FILE_TIERS[file_name], key


def test_the_fast_files_are_store_or_service_ones():
    assert {tiers.FILE_TIERS[name] for name in tiers.FAST} <= {"store", "service"}


def test_the_tiers_are_registered_markers(pytestconfig):
    registered = {line.partition(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert {*tiers.TIERS, "fast"} <= registered


def test_conftest_marks_each_test_with_its_tier(request):
    assert request.node.get_closest_marker("unit") and request.node.get_closest_marker("fast")
    assert tiers.marks_of("test_reduce.py", "test_window_on_smollm2_hidden_states_matches_two_pass_float64") == ["e2e"]
    assert tiers.marks_of("test_openapi.py", "test_anything") == ["service", "fast"]
    assert tiers.marks_of("test_store.py", "test_anything") == ["store"]
    assert tiers.marks_of("test_not_there.py", "test_anything") == []
