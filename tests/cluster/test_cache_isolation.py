"""Prefix-cache isolation between tenants (`--isolate-prefix-cache-by-tenant`), served: a tenant's cached prompt
never serves another tenant (no prompt tokens cached, so no TTFT to learn from), and each tenant still reuses its
own; without the flag the same prompt is shared by everyone."""
import random

import pytest

from conftest import hf_greedy
from helpers import assert_idle, greedy
from pdserve import Client

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("isolate", [True, False])
def test_a_tenants_cached_prompt_serves_only_that_tenant(tiny_model_dir, launch, isolate):
    rng = random.Random(11)
    prompt = [rng.randrange(3, 49152) for _ in range(100)]  # 6 full blocks of 16
    expected = hf_greedy(tiny_model_dir, prompt, 4)
    c = launch(tiny_model_dir, worker_args=["--dtype", "float32", "--connector", "tcp"],
               coordinator_args=["--isolate-prefix-cache-by-tenant"] if isolate else [])
    with Client(c.address) as client:
        done = [client.complete(prompt, greedy(4, ignore_eos=True), tenant=t) for t in ("acme", "globex", "acme")]
    assert [d.token_ids for d in done] == [expected] * 3
    cached = [d.cached_prompt_tokens for d in done]
    assert cached == ([0, 0, 96] if isolate else [0, 96, 96])
    assert_idle(c)
