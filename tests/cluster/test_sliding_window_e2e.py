"""A sliding-window model through a disaggregated cluster: blocks behind the window leave both workers' tables
(the decode worker's as it reserves, so they are not sent; the prefill worker's after its last step) and greedy
output is still HF's."""
import grpc
import pytest

from conftest import hf_greedy, save_with_tokenizer
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from helpers import assert_idle, complete_all, greedy, worker_stats

WINDOW = 8  # one 8-token block: prompts of 38+ tokens leave several blocks behind it before the transfer


@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory, real_model_dir):
    """A 2-layer random-weight Mistral, sliding window 8 on both layers, SmolLM2's tokenizer."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    out = tmp_path_factory.mktemp("tiny-mistral-window")
    cfg = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=WINDOW, eos_token_id=2,
                        bos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    return save_with_tokenizer(MistralForCausalLM(cfg), out, real_model_dir)


@pytest.mark.e2e
def test_disaggregated_sliding_window_matches_hf_and_frees_old_blocks(mistral_window_dir, tokenizer, launch):
    """Three prompts of 38+ tokens, the first sent twice more (a prefix-cache hit on the prefill worker, whose
    given-back blocks stay cached with their real contents) and once cut in half (a hit on part of a prompt whose
    window reaches into blocks the first request gave back): 40 greedy tokens each, every one equal to HF's."""
    base = ["The history of the printing press begins in the fifteenth century, when movable type changed how "
            "books were made, sold and read across Europe, and within fifty years presses ran in most large cities.",
            "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
            "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n"
            "    return merge(left, right)\n",
            "Rivers carry water from high ground to the sea; along the way they cut valleys, move sand and stones, "
            "feed lakes and wetlands, and give towns their water, their trade routes and sometimes their floods."]
    ids = [tokenizer(p)["input_ids"] for p in base]
    assert min(map(len, ids)) >= 3 * WINDOW
    half = tokenizer.decode(ids[0][:len(ids[0]) // 2])
    prompts = base + [base[0], half]
    cluster = launch(mistral_window_dir, "tiny-mistral", worker_args=["--dtype", "float32", "--kv-tokens", "4096",
                                                                      "--max-model-len", "512", "--block-size", "8"],
                     coordinator_args=["--no-local-prefill-queue"])  # every prompt through the transfer

    def send(batch):
        return complete_all(cluster.address, [(p, greedy(40, ignore_eos=True)) for p in batch])

    outs = send(prompts[:3]) + send(prompts[3:])
    for prompt, out in zip(prompts, outs):
        assert out.timings["transfer_ms"] > 0  # the KV crossed between the workers
        assert out.token_ids == hf_greedy(mistral_window_dir, tokenizer(prompt)["input_ids"], 40), prompt
    assert outs[3].cached_prompt_tokens > 0  # the repeat hit the prefill worker's prefix cache
    assert_idle(cluster)
    assert all(worker_stats(cluster, name).num_total_blocks == 4096 // 8 - 1  # the null block held back
               for name in cluster.worker_addresses)
    for address in cluster.worker_addresses.values():  # the capacity the coordinator is told: what requests hold
        with grpc.insecure_channel(address) as ch:
            info = worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=10,
                                                          metadata=cluster.worker_metadata)
        assert info.num_blocks == 4096 // 8 - 1 and info.kv_sliding_window == WINDOW


@pytest.mark.e2e
def test_requests_longer_than_the_kv_pool_pass_through_a_disaggregated_cluster(mistral_window_dir, tokenizer, launch):
    """Pools of 7 usable 8-token blocks (56 tokens) on both workers and prompts of about 60 and 150 tokens with 40
    outputs each: the workers advertise their whole context (512 tokens) to the coordinator, the prefill worker
    computes each prompt in chunks that fit beside the window, the decode worker reserves only the window's blocks,
    and both streams equal HF's greedy output; every block is back after."""
    text = ("Rivers carry water from high ground to the sea; along the way they cut valleys, move sand and stones, "
            "feed lakes and wetlands, and give towns their water, their trade routes and sometimes their floods. ")
    long_ids = tokenizer(text * 5)["input_ids"][:150]
    prompts = [tokenizer.decode(tokenizer(text)["input_ids"][:60]), tokenizer.decode(long_ids)]
    cluster = launch(mistral_window_dir, "tiny-mistral", worker_args=["--dtype", "float32", "--kv-tokens", "64",
                                                                      "--max-model-len", "512", "--block-size", "8"],
                     coordinator_args=["--no-local-prefill-queue"])  # every prompt through the transfer
    for address in cluster.worker_addresses.values():
        with grpc.insecure_channel(address) as ch:
            info = worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.WorkerInfoRequest(), timeout=10,
                                                          metadata=cluster.worker_metadata)
        # a request holds at most its window (8) and a chunk capped to 42 tokens: 7 blocks of 8
        assert info.num_blocks == 7 and info.max_request_tokens == 512 and info.max_request_blocks == 7

    outs = complete_all(cluster.address, [(p, greedy(40, ignore_eos=True)) for p in prompts])
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt)["input_ids"]
        assert len(ids) + 40 > 56 and out.timings["transfer_ms"] > 0
        assert out.token_ids == hf_greedy(mistral_window_dir, ids, 40), prompt
    assert_idle(cluster)
