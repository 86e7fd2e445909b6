"""Every test file's tier, in one place: what a test needs decides when it runs.

=========  ===========================================================================
unit       no Redis, no server, no forward pass of a model (a packaged tokenizer or
           config may be read); seconds
store      a real redis-server, synthetic data, no model
service    the app or a worker in this process, on a real Redis, on a few texts
e2e        real models over real corpora, or ``embgeom serve`` as a real process
ops        containers, the browser, soak-like runs, process lifetime, a fresh install
=========  ===========================================================================

``tests/conftest.py`` marks each collected test with its tier (``pytest -m unit``,
``-m "not ops"``), and with ``fast`` when ``make test-fast`` runs it: the unit tier and
the store and service files of ``FAST``. ``tests/test_tiers.py`` fails when a test file
has no tier.
"""

from __future__ import annotations

TIERS = ("unit", "store", "service", "e2e", "ops")

FILE_TIERS = {
    "test_diagnostics.py": "unit",
    "test_docs.py": "unit",
    "test_figures.py": "unit",
    "test_geometry.py": "unit",
    "test_geometry_alignment.py": "unit",
    "test_geometry_figures.py": "unit",
    "test_heap.py": "unit",
    "test_import_graph.py": "unit",
    "test_model_files.py": "unit",
    "test_paper_reference.py": "unit",
    "test_positions.py": "unit",
    "test_reduce.py": "unit",
    "test_render_pool.py": "unit",
    "test_renders.py": "unit",
    "test_sources_corpora.py": "unit",
    "test_stats.py": "unit",
    "test_tiers.py": "unit",

    "test_piece_writes.py": "store",
    "test_queue.py": "store",
    "test_reader.py": "store",
    "test_steady_state.py": "store",
    "test_store.py": "store",

    "test_api_errors.py": "service",
    "test_auth.py": "service",
    "test_fast_lane.py": "service",
    "test_checkpoint_deadletter.py": "service",
    "test_fuzz.py": "service",
    "test_jobs_api.py": "service",
    "test_limits.py": "service",
    "test_openapi.py": "service",
    "test_worker_lifecycle.py": "service",

    "test_benchmarks.py": "e2e",
    "test_checkpoint_faults.py": "e2e",
    "test_cli_report.py": "e2e",
    "test_client.py": "e2e",
    "test_client_notebook.py": "e2e",
    "test_cluster.py": "e2e",
    "test_e2e_isotropy.py": "e2e",
    "test_e2e_minilm.py": "e2e",
    "test_exports.py": "e2e",
    "test_figures_api.py": "e2e",
    "test_first_call.py": "e2e",
    "test_geometry_api.py": "e2e",
    "test_paper_preset.py": "e2e",
    "test_persistence.py": "e2e",
    "test_readme_notebook.py": "e2e",
    "test_scale_out.py": "e2e",
    "test_similarity_api.py": "e2e",
    "test_words.py": "e2e",

    "test_client_install.py": "ops",
    "test_docker.py": "ops",
    "test_lifetime.py": "ops",
    "test_load_faults.py": "ops",
    "test_report_browser.py": "ops",
    "test_soak.py": "ops",
}

# Tests that need more than the rest of their file, by "file::function".
TEST_TIERS = {
    "test_paper_reference.py::test_minilm_ids_without_specials_agree_with_tests_reference": "e2e",
    "test_paper_reference.py::test_minilm_cls_variance_float32_running_update_vs_two_pass": "e2e",
    "test_reduce.py::test_window_on_smollm2_hidden_states_matches_two_pass_float64": "e2e",
    # prepares every packaged model's folder: Gemma 3's conversion takes minutes on a cold cache
    "test_sources_corpora.py::test_prepared_folder_loads_with_autoconfig_and_autotokenizer": "e2e",
}

# Store and service files quick enough to join the unit tier in make test-fast.
FAST = {"test_openapi.py", "test_piece_writes.py", "test_reader.py"}


def tier_of(file_name: str, function: str) -> str | None:
    """The tier of one test (None for a file that has none: test_tiers.py says so)."""
    return TEST_TIERS.get(f"{file_name}::{function}", FILE_TIERS.get(file_name))


def marks_of(file_name: str, function: str) -> list[str]:
    """The markers conftest.py puts on one test: its tier, and ``fast`` where it has one."""
    tier = tier_of(file_name, function)
    if tier is None:
        return []
    in_fast_file = file_name in FAST and tier == FILE_TIERS[file_name]  # not a heavier one
    return [tier, "fast"] if tier == "unit" or in_fast_file else [tier]


def fast_files() -> list[str]:
    """The test files that hold a ``fast`` test, relative to the repository."""
    return sorted(f"tests/{name}" for name, tier in FILE_TIERS.items() if tier == "unit" or name in FAST)


if __name__ == "__main__":  # make test-fast: the files to collect
    print(*fast_files())
