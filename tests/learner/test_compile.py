"""learner.compile: the step's module is compiled with torch.compile (inductor runs a C++ compiler,
so this is not a unit test)."""

from __future__ import annotations

import pytest

from tests.learner.test_learner_unit import check_trains_in_fp32
from tests.service.conftest import tiny_run  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def test_compiled_step_trains_and_keeps_fp32_parameters(tiny_run):  # noqa: F811
    learner = check_trains_in_fp32(tiny_run, compile=True)
    assert learner.net is not learner.model  # the compiled wrapper; parameters are the model's own
