"""KV offload tiers on a served worker (`--kv-offload-disk-dir`): a returning conversation's evicted prefix comes back
from disk with HF's greedy tokens and the worker's Prometheus counters say so; the tier outlives the worker (a new
cluster on the same directory serves the prefix from disk on its first request); a Redis tier shared by two
clusters serves one's prompt to the other."""
import random

import pytest

from conftest import hf_greedy
from helpers import assert_idle, greedy, scrape, total
from pdserve import Client

pytestmark = pytest.mark.e2e


def test_a_served_worker_reloads_an_evicted_prefix_from_disk_and_after_a_restart(tiny_model_dir, launch, tmp_path):
    # 8 blocks of 16 tokens: the 100-token conversation (6 full blocks) and a 120-token other request do not fit
    # together, so the other one evicts the conversation's blocks to the disk tier.
    worker = ["--dtype", "float32", "--kv-tokens", "128", "--max-model-len", "128", "--connector", "tcp",
              "--kv-offload-disk-dir", str(tmp_path), "--kv-offload-load", "always", "--metrics-port", "0"]
    rng = random.Random(3)
    conversation = [rng.randrange(3, 49152) for _ in range(100)]
    other = [rng.randrange(3, 49152) for _ in range(120)]
    expected = hf_greedy(tiny_model_dir, conversation, 5)

    c = launch(tiny_model_dir, colocated=True, worker_args=worker)
    with Client(c.address) as client:
        assert client.complete(conversation, greedy(5, ignore_eos=True)).token_ids == expected
        client.complete(other, greedy(1, ignore_eos=True))
        returning = client.complete(conversation, greedy(5, ignore_eos=True))
    assert returning.token_ids == expected and returning.cached_prompt_tokens == 96
    samples = scrape(c.metrics_urls["colocated-0"])
    assert total(samples, "pdserve:kv_offload_hit_blocks_total", tier="disk") == 6
    assert total(samples, "pdserve:kv_offload_loaded_bytes_total", tier="disk") > 0
    assert total(samples, "pdserve:kv_offload_corrupt_blocks_total", tier="disk") == 0
    assert_idle(c)
    c.stop()  # the engine writes what its tier still queues as it stops

    restarted = launch(tiny_model_dir, colocated=True, worker_args=worker)
    with Client(restarted.address) as client:
        first = client.complete(conversation, greedy(5, ignore_eos=True))
    assert first.token_ids == expected and first.cached_prompt_tokens == 96
    assert total(scrape(restarted.metrics_urls["colocated-0"]), "pdserve:kv_offload_hit_blocks_total", tier="disk") == 6


def test_a_prefix_one_cluster_computed_is_served_to_another_from_a_shared_redis(tiny_model_dir, launch, redis_url):
    """Two workers that share nothing but a Redis server (two clusters here; two hosts in a deployment), storing
    blocks as computed: the second serves the first's prompt from Redis, with HF's tokens."""
    worker = ["--dtype", "float32", "--kv-tokens", "128", "--max-model-len", "128", "--connector", "tcp",
              "--kv-offload-redis-url", redis_url, "--kv-offload-store", "computed", "--kv-offload-load", "always",
              "--metrics-port", "0"]
    rng = random.Random(4)
    prompt = [rng.randrange(3, 49152) for _ in range(100)]
    expected = hf_greedy(tiny_model_dir, prompt, 5)
    first_cluster = launch(tiny_model_dir, colocated=True, worker_args=worker)
    with Client(first_cluster.address) as client:
        first = client.complete(prompt, greedy(5, ignore_eos=True))
    first_cluster.stop()  # its engine stores what its tier still queues as it stops
    second_cluster = launch(tiny_model_dir, colocated=True, worker_args=worker)
    with Client(second_cluster.address) as client:
        second = client.complete(prompt, greedy(5, ignore_eos=True))
    assert first.token_ids == second.token_ids == expected
    assert first.cached_prompt_tokens == 0 and second.cached_prompt_tokens == 96
    samples = scrape(second_cluster.metrics_urls["colocated-0"])
    assert total(samples, "pdserve:kv_offload_hit_blocks_total", tier="redis") == 6
    assert_idle(second_cluster)
