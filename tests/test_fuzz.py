"""Property: for random models from the grammar in fuzz_grammar.py, fxmem.analyze predicts exactly
the saved activation bytes that fxmem.measure records in a real CPU run, at two or three batch
sizes, in total and per fx node.

Profiles (choose with the environment variable FXMEM_FUZZ_PROFILE):

- ``fuzz-ci`` (default): 200 examples, derandomized, so every CI run checks the same models;
- ``fuzz-dev``: 50 random examples, failures saved to the example database and replayed first;
- ``fuzz-nightly``: 2000 random examples.

``pytest tests/test_fuzz.py --fuzz-examples N`` overrides the profile's count. A failure prints
the shrunk model, step by step; turn it into a test in test_fuzz_regressions.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from fuzz_grammar import FuzzCase, check_case, fuzz_cases
from hypothesis import HealthCheck, given, settings

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
settings.register_profile("fuzz-ci", max_examples=200, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_QUIET, print_blob=True)  # fmt: skip
settings.register_profile("fuzz-dev", max_examples=50, deadline=None, suppress_health_check=_QUIET, print_blob=True)
settings.register_profile("fuzz-nightly", max_examples=2000, deadline=None, suppress_health_check=_QUIET, print_blob=True)


def fuzz_settings(examples: int | None) -> settings:
    """The selected profile, with ``--fuzz-examples`` as its example count when given."""
    profile = settings.get_profile(os.environ.get("FXMEM_FUZZ_PROFILE", "fuzz-ci"))
    return settings(profile, max_examples=examples) if examples else profile


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The models are tiny: OpenMP workers would only add start-up and barrier time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_analyze_matches_measure(pytestconfig: pytest.Config) -> None:
    tried = 0

    # Built here, not at import, so that --fuzz-examples (known only once pytest is configured) sets the count.
    @fuzz_settings(pytestconfig.getoption("--fuzz-examples"))
    @given(case=fuzz_cases())
    def analyze_matches_measure(case: FuzzCase) -> None:
        nonlocal tried
        tried += 1
        check_case(case)

    analyze_matches_measure()
    assert tried, "hypothesis generated no models"
