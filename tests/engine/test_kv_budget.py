"""The KV pool's default size (`engine.config.auto_kv_tokens`, resolved in `engine.builder.resolve_configs`): room
for max_num_seqs requests of max_model_len tokens within a share of the memory free at start; --kv-tokens and
--kv-bytes override it."""
import pytest

from pdserve_server.engine import builder
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.config import (AUTO_KV_MEMORY_FRACTION, AUTO_KV_MIN_TOKENS, auto_kv_tokens,
                                          kv_bytes_per_block)
from pdserve_server.engine.hardware import free_memory_bytes


def test_the_default_budget_is_bounded_by_memory_by_the_running_batch_and_never_under_the_old_fixed_one():
    per_token = 1000
    # memory-bound: 10% of 1 GB is 100,000 tokens, under the 64 x 8,192 a full batch could hold
    assert auto_kv_tokens(per_token, 10**9, 0.1, 64, 8192) == 100_000
    # batch-bound: more memory than max_num_seqs full-length requests can use
    assert auto_kv_tokens(per_token, 10**12, 0.1, 4, 1024) == 4 * 1024
    # scarce memory: not under the fixed default it replaced, nor above what the batch can use
    assert auto_kv_tokens(per_token, 10**6, 0.1, 64, 8192) == AUTO_KV_MIN_TOKENS
    assert auto_kv_tokens(per_token, 10**6, 0.1, 2, 512) == 1024
    # memory unknown: the floor
    assert auto_kv_tokens(per_token, None, 0.1, 64, 8192) == AUTO_KV_MIN_TOKENS


def test_this_machine_reports_its_free_memory_within_its_total():
    free = free_memory_bytes("cpu")
    if free is None:
        pytest.skip("no /proc/meminfo or /dev/shm here")
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < free <= total


@pytest.mark.parametrize("limit_file, usage_file", [("memory.max", "memory.current"),
                                                     ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")])
def test_a_containers_memory_limit_bounds_the_free_memory_the_host_reports(tmp_path, limit_file, usage_file):
    """A pod limited to 4 GiB on a large host: MemAvailable is the host's, the cgroup's headroom is what counts."""
    host = free_memory_bytes("cpu", cgroup=tmp_path / "none")
    if host is None or host < 2**30:
        pytest.skip("this machine reports no free memory, or under 1 GiB")
    (tmp_path / limit_file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / limit_file).write_text(f"{2**30}\n")
    (tmp_path / usage_file).write_text(f"{2**28}\n")
    assert free_memory_bytes("cpu", cgroup=tmp_path) == 2**30 - 2**28
    (tmp_path / limit_file).write_text("max\n" if limit_file == "memory.max" else f"{2**63 - 4096}\n")
    unlimited = free_memory_bytes("cpu", cgroup=tmp_path)  # no limit: the host's figures (which move a little)
    assert unlimited is not None and abs(unlimited - host) < host // 4


def test_resolve_configs_sizes_the_pool_from_free_memory_unless_a_budget_is_given(tiny_model_dir, monkeypatch):
    free = 3 * 10**8
    monkeypatch.setattr(builder, "free_memory_bytes", lambda device: free)
    args = EngineArgs(model_dir=str(tiny_model_dir), dtype="float32", max_num_seqs=256)
    model, cache, sched = builder.resolve_configs(args)
    per_token = kv_bytes_per_block(model, args.block_size) // args.block_size
    want = auto_kv_tokens(per_token, free, AUTO_KV_MEMORY_FRACTION["cpu"], 256, sched.max_model_len)
    assert AUTO_KV_MIN_TOKENS < want < 256 * sched.max_model_len  # this case is bound by memory
    assert cache.num_blocks == want // args.block_size
    # a bf16 cache takes half the bytes a token: twice the tokens in the same memory
    _, half, _ = builder.resolve_configs(EngineArgs(model_dir=str(tiny_model_dir), dtype="float32", max_num_seqs=256,
                                                    kv_cache_dtype="bfloat16"))
    assert half.num_blocks == 2 * cache.num_blocks
    # explicit budgets win
    _, given, _ = builder.resolve_configs(EngineArgs(model_dir=str(tiny_model_dir), dtype="float32", kv_tokens=4096))
    assert given.num_blocks == 4096 // args.block_size
    _, in_bytes, _ = builder.resolve_configs(EngineArgs(model_dir=str(tiny_model_dir), dtype="float32",
                                                        kv_bytes=10 * kv_bytes_per_block(model, args.block_size)))
    assert in_bytes.num_blocks == 10
