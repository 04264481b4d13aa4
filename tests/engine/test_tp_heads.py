"""Tensor parallelism's head placement (`engine.parallel.tensor_parallel.head_split`): heads that split evenly, kv heads
padded with zero heads when the ranks do not divide them (SmolLM2-135M's 3 kv heads on 2 ranks), kv heads replicated
when the ranks outnumber them; and every rank's share of a model (Llama-shaped, Gemma 3) computing, together, the logits
of the whole model. The ranks run as threads of this process whose collectives meet in memory (`ThreadRank`), so the
sharded models and the KV layout are the engine's own, without processes or gloo."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from pdserve_server.engine.config import CacheConfig

from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.execution.model_runner import ModelRunner, StepInputs
from pdserve_server.engine.parallel.tensor_parallel import HeadSplit, TensorParallel, head_split, kv_heads_per_rank


@pytest.mark.parametrize("heads,kv,size,expected", [
    # even: rank 1 takes kv head 1 and its two query heads
    (4, 2, 2, [HeadSplit((0, 1), (0,)), HeadSplit((2, 3), (1,))]),
    # 3 kv heads on 2 ranks: rank 1's second group is padding
    (9, 3, 2, [HeadSplit((0, 1, 2, 3, 4, 5), (0, 1)), HeadSplit((6, 7, 8, None, None, None), (2, None))]),
    # 2 kv heads on 4 ranks: each kv head on two ranks, which split its query heads
    (8, 2, 4, [HeadSplit((0, 1), (0,)), HeadSplit((2, 3), (0,)), HeadSplit((4, 5), (1,)), HeadSplit((6, 7), (1,))]),
    # multi-head attention, 5 heads on 2 ranks: 3 + 3, one padding
    (5, 5, 2, [HeadSplit((0, 1, 2), (0, 1, 2)), HeadSplit((3, 4, None), (3, 4, None))]),
])
def test_head_split(heads, kv, size, expected):
    splits = [head_split(heads, kv, size, r) for r in range(size)]
    assert splits == expected
    assert all(len(s.kv_heads) == kv_heads_per_rank(kv, size) for s in splits)
    real = sorted(h for s in splits for h in s.q_heads if h is not None)
    assert real == list(range(heads))  # every query head computed exactly once
    group = heads // kv
    for s in splits:  # a rank's query heads read kv heads it holds
        assert all(h is None or h // group in s.kv_heads for h in s.q_heads)


@pytest.mark.parametrize("heads,kv,size,message", [
    (4, 2, 3, r"--tensor-parallel-size 3 is larger than num_key_value_heads \(2\)"),
    (4, 2, 8, r"divides the 2 query heads of each kv head"),
    (4, 3, 1, r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"),
])
def test_head_split_refusals(heads, kv, size, message):
    with pytest.raises(ValueError, match=message):
        head_split(heads, kv, size, 0)


class ThreadGroup:
    """Where the threads of one simulated tensor-parallel group meet: one slot per rank and a barrier. A test double
    for torch.distributed's collectives only."""

    def __init__(self, size: int):
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x`, in rank order, once all have arrived."""
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return parts


@dataclass(frozen=True)
class ThreadRank(TensorParallel):
    """A `TensorParallel` rank whose all-reduce and all-gather go through a `ThreadGroup` (`group`)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(torch.stack(self.group.exchange(self.rank, x)).sum(0))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.rank, x), dim=-1)


BLOCK = 8


def greedy_steps(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill `prompts` in one step, then `steps` greedy decode steps of all of them; every step's logits
    ([len(prompts), vocab] float32). Sequence i owns blocks i * 8 .. i * 8 + 7."""
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    slot = lambda i, p: tables[i][p // BLOCK] * BLOCK + p % BLOCK  # noqa: E731
    step = StepInputs(input_ids=[t for p in prompts for t in p],
                      positions=[p for prompt in prompts for p in range(len(prompt))],
                      slots=[slot(i, p) for i, prompt in enumerate(prompts) for p in range(len(prompt))],
                      prefill_query_lens=[len(p) for p in prompts], prefill_context_lens=[len(p) for p in prompts],
                      prefill_block_tables=tables, logit_rows=[sum(map(len, prompts[:i + 1])) - 1
                                                               for i in range(len(prompts))])
    out = [runner._forward(step, None).float()]
    lens = [len(p) for p in prompts]
    for _ in range(steps):
        step = StepInputs(input_ids=out[-1].argmax(-1).tolist(), positions=list(lens),
                          slots=[slot(i, n) for i, n in enumerate(lens)], decode_block_tables=tables,
                          decode_context_lens=[n + 1 for n in lens])
        out.append(runner._forward(step, None).float())
        lens = [n + 1 for n in lens]
    return out


def sharded_steps(cfg: ModelConfig, state: dict, size: int, prompts, steps: int) -> list[torch.Tensor]:
    """`greedy_steps` with `size` ranks (threads), each computing in its own KV shard as an engine's ranks do;
    rank 0's logits (every rank's are the same gathered logits)."""
    cache = CacheConfig(block_size=BLOCK, num_blocks=8 * len(prompts), tensor_parallel_size=size)
    group = ThreadGroup(size)

    def rank(r: int) -> list[torch.Tensor]:
        runner = ModelRunner(cfg, cache, state, attention_backend="torch", packed_weights=False,
                             tp=ThreadRank(r, size, group))
        return greedy_steps(runner, prompts, steps)

    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(rank, range(size)))
    assert all(all(torch.equal(a, b) for a, b in zip(res, results[0])) for res in results)
    return results[0]


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=8,
                max_position_embeddings=128, tie_word_embeddings=False, attention_bias=True)
    return LlamaForCausalLM(LlamaConfig(**{**base, **kw}))


def _gemma():
    from test_gemma import GEMMA, randomize_norms  # the parity tests' model
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA))
    randomize_norms(model)
    return model


@pytest.mark.parametrize("build,size", [
    # SmolLM2-135M's shape: 9 query / 3 kv heads; on 2 ranks one kv group of padding (and q/k/v biases padded)
    (lambda: _llama(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), 2),
    # 2 kv heads replicated over 4 ranks; the 250-row vocabulary padded to 4 x 63
    (lambda: _llama(num_attention_heads=8, num_key_value_heads=2), 4),
    # Gemma 3: its own MLP's all-reduce, scaled vocab-parallel embedding, soft-capped gathered logits, q/k norm
    (_gemma, 2),
    (_gemma, 4),
], ids=["llama-9q3kv-tp2-padded", "llama-8q2kv-tp4-replicated", "gemma3-tp2", "gemma3-tp4-replicated"])
def test_ranks_together_compute_the_whole_models_logits(build, size):
    """Prefill of two prompts (lengths 11 and 19, across block boundaries) then 12 greedy decode steps: the ranks'
    gathered logits equal one rank's to float32 rounding (sums in another order), and so do the greedy tokens."""
    model = build()
    cfg = ModelConfig.from_hf(model.config, name="m", path="")
    state = model.state_dict()
    prompts = [list(range(3, 14)), [int(t) for t in torch.randint(0, cfg.vocab_size, (19,))]]
    whole = greedy_steps(ModelRunner(cfg, CacheConfig(block_size=BLOCK, num_blocks=16), state,
                                     attention_backend="torch", packed_weights=False), prompts, 12)
    shared = sharded_steps(cfg, state, size, prompts, 12)
    for one, many in zip(whole, shared):
        torch.testing.assert_close(many, one, rtol=1e-4, atol=1e-4)
        assert torch.equal(many.argmax(-1), one.argmax(-1))
