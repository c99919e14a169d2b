"""Session fixtures: the rank-process pools and the hypothesis profiles.

HYPOTHESIS_PROFILE=ci (default): a few fixed examples per property, so CI is fast and repeatable.
HYPOTHESIS_PROFILE=thorough (`make test-thorough`): many random examples.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.harness import Pools

settings.register_profile("ci", max_examples=6, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("thorough", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pools():
    pools = Pools()
    yield pools
    pools.close()
