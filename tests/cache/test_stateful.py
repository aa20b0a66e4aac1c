"""Random sequences of insert / match / lock / evict / load-back / backup against a reference, on both emulated
alias modes: every page the cache serves holds exactly the bytes written for that prefix, the index invariants hold
after every step, locks balance and every page comes back at close."""

from __future__ import annotations

import pytest
from helpers.cache_machine import CacheMachine
from hypothesis import HealthCheck, settings

pytestmark = pytest.mark.slow   # whole-program or stateful runs: `-m 'not slow'` skips them

# a tiny vocabulary and short prompts: prompts share prefixes and diverge mid-node, so splits happen often


def machine(runtime_name: str, policy: str) -> type[CacheMachine]:
    return type(f"Cache_{runtime_name}_{policy}", (CacheMachine,), {"runtime_name": runtime_name, "policy": policy})


@pytest.mark.parametrize("runtime_name", ["emulated:split", "emulated:unified", "emulated:split:2:lazy"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_cache_against_the_reference(runtime_name, policy):
    test = machine(runtime_name, policy).TestCase
    test.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                             suppress_health_check=list(HealthCheck))
    test().runTest()
