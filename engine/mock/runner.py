"""A model runner that computes nothing: the mock engine's (`--mock-engine PROFILE`, Dynamo's `mocker` and
vLLM's dummy runner are the same idea). The scheduler, block pool, prefix cache, admission, preemption and the KV
transfer protocol around it are the real ones; only `execute` differs:

- each step lasts what the profile's performance model (`engine.mock.step_model`) says a real device takes for the
  step's shape, divided by the speed-up (2.0: twice as fast as the device), by sleeping out what the host work left;
- each token is derived from the context: `next_token` hashes the last three tokens and the context length
  (splitmix64), never an EOS id, so streams are deterministic (greedy requests run to max_tokens) and anyone can
  check one from its prompt. Requests that need logits (sampling, penalties, logprobs, structured outputs) get a
  row peaked at that token through the real sampler, so their parameters and grammars still hold;
- the KV cache is real memory of the model's geometry (what connectors move); nothing reads or writes it but the
  transfers, and layer-wise streaming is told each layer as the step's time passes.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from pdserve_server.engine.config import CacheConfig

from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.execution.kv_cache import KVCache
from pdserve_server.engine.mock.step_model import StepShape, StepTimeModel
from pdserve_server.engine.outputs import RunnerOutput, SampledToken, SchedulerOutput
from pdserve_server.engine.execution.sampler import Sampler
from pdserve_server.engine.speculative import accept_greedy

_MASK = (1 << 64) - 1
# The logit of the derived token in a row handed to the sampler (the rest are 0): at temperature 1 and a 49k
# vocabulary it is drawn ~77% of the time (e^12 / (e^12 + 49151)).
PEAK_LOGIT = 12.0


def _mix(x: int) -> int:
    """splitmix64's finaliser (Steele et al., "Fast splittable pseudorandom number generators", OOPSLA 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def next_token(tokens: Sequence[int], vocab_size: int, eos_token_ids: frozenset[int] = frozenset()) -> int:
    """The mock engine's token after `tokens` (the whole context: prompt and output so far): a hash of the context
    length and its last three tokens, in [0, vocab_size), never one of `eos_token_ids`."""
    return _next(len(tokens), tokens[-3:], vocab_size, eos_token_ids)


def continuation(prompt: Sequence[int], count: int, vocab_size: int,
                 eos_token_ids: frozenset[int] = frozenset()) -> list[int]:
    """The `count` tokens a greedy request streams after `prompt` (`next_token` in turn, each on the context so
    far): what a client checks a mock engine's stream against."""
    tail, length, out = list(prompt[-3:]), len(prompt), []
    for _ in range(count):
        out.append(_next(length, tail, vocab_size, eos_token_ids))
        tail, length = tail[-2:] + out[-1:], length + 1
    return out


def _next(length: int, tail: Sequence[int], vocab_size: int, eos_token_ids: frozenset[int]) -> int:
    """`next_token` from what it reads of a context: its length and its last (up to three) tokens."""
    h = _mix(length)
    for t in tail[-3:]:
        h = _mix(h ^ t)
    token = h % vocab_size
    while token in eos_token_ids:
        token = (token + 1) % vocab_size
    return token


class MockRunner:
    """`engine.execution.model_runner.ModelRunner`'s interface (execute, kv_cache, follow, close) over a performance
    model.

    Args:
        model_config, cache_config: the model's geometry (vocabulary, EOS ids, layers; the KV cache's shape).
        profile: the step-time model.
        speedup: simulated time runs this many times faster than the profile's device (> 0).
        device: where the KV cache lives.
        seed: the sampler's seed (requests that sample).
        clock, sleep: time sources (seconds), replaceable in tests.

    Attributes:
        steps: steps executed. simulated_ms: the profile's time of those steps, summed (before the speed-up).
        overrun_steps: steps whose host work alone outlasted their modelled time (the simulation fell behind).

    Raises:
        ValueError: speedup <= 0.
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, profile: StepTimeModel,
                 speedup: float = 1.0, device: str = "cpu", seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        if not speedup > 0:
            raise ValueError(f"the mock engine's speed-up must be > 0, got {speedup}")
        self.model_config, self.profile, self.speedup = model_config, profile, speedup
        self.device = torch.device(device)
        self.kv_cache = KVCache(model_config, cache_config, self.device)
        self.block_size = cache_config.block_size
        self.sampler = Sampler(model_config.vocab_size, seed)
        self.vocab_size = model_config.vocab_size
        self.eos = frozenset(model_config.eos_token_ids)
        self.clock, self.sleep = clock, sleep
        self.steps, self.simulated_ms, self.overrun_steps = 0, 0.0, 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """The step's tokens (module docstring), returned once the step's modelled time has passed."""
        start = self.clock()
        ms = self.profile.predict_ms(StepShape.of_output(out))
        end = start + ms / 1e3 / self.speedup
        self.steps += 1
        self.simulated_ms += ms
        self.kv_cache.copy_blocks(out.block_copies)  # a forked sample's partial block, as the real runner does
        result = RunnerOutput()
        needs_logits, targets = [], []
        for s in out.decodes + out.prefills:
            req = s.request
            if s.spec_token_ids:  # n-gram drafts: the model's greedy choice after each, accepted while they agree
                tail, length = list(req.all_token_ids[-3:]), req.num_tokens
                want = [_next(length, tail, self.vocab_size, self.eos)]
                for d in s.spec_token_ids:
                    tail, length = tail[-2:] + [d], length + 1
                    want.append(_next(length, tail, self.vocab_size, self.eos))
                emitted = accept_greedy(s.spec_token_ids, want)
                result.sampled[req.request_id] = SampledToken(emitted[0])
                result.spec_tokens[req.request_id] = emitted[1:]
            elif s.sample:
                token = next_token(req.all_token_ids, self.vocab_size, self.eos)
                if req.argmax_next and req.matcher is None:
                    result.sampled[req.request_id] = SampledToken(token)
                else:
                    needs_logits.append(req)
                    targets.append(token)
        if needs_logits:
            logits = torch.zeros(len(needs_logits), self.vocab_size)
            logits[torch.arange(len(targets)), torch.tensor(targets)] = PEAK_LOGIT
            sampled = self.sampler(logits, needs_logits)
            result.sampled.update(sampled.sampled)
            result.failed.update(sampled.failed)
        streaming = [s for s in out.decodes + out.prefills if s.sample and s.request.kv_layers is not None]
        for s in streaming:
            s.request.kv_layers.begin(s.block_ids, s.request.num_computed_tokens + s.num_new_tokens)
        layers = self.model_config.num_layers
        for layer in range(layers if streaming else 0):  # each layer written as its share of the step passes
            self._sleep_until(start + (end - start) * (layer + 1) / layers)
            for s in streaming:
                s.request.kv_layers.layer_written(layer, self.device)
        if self.clock() > end:
            self.overrun_steps += 1
        self._sleep_until(end)
        return result

    def _sleep_until(self, t: float) -> None:
        left = t - self.clock()
        if left > 0:
            self.sleep(left)

    def follow(self) -> None:
        """Tensor parallelism has no meaning here: a mock engine is one rank (`engine.builder` refuses more)."""
        raise RuntimeError("the mock engine runs one rank")

    def close(self) -> None:
        """Nothing to release (the KV cache is freed with the runner)."""

