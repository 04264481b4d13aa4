"""Speculative decoding with n-gram (prompt-lookup) drafts: no draft model.

The method is vLLM's `ngram` speculator (after Saxena's "prompt lookup decoding", 2023): find the request's
latest n tokens earlier in its own prompt + output and propose the tokens that followed them. The engine then
computes the last sampled token and the k drafts in one step, as a k+1-token chunk, and keeps the drafts that the
model's own greedy choices confirm (`accept_greedy`), plus one token of its own. Greedy output is therefore
unchanged; only the number of steps per token falls, which pays where a step costs about the same for 1 or k+1
tokens (small batches, weight-bound decode).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram speculation knobs (vLLM's `--speculative-config '{"method": "ngram", ...}'` fields).

    Attributes:
        num_tokens: draft tokens proposed per step (vLLM: num_speculative_tokens); 0 = off.
        lookup_max: longest n-gram matched (prompt_lookup_max), in tokens.
        lookup_min: shortest n-gram matched (prompt_lookup_min), in tokens.
        disable_batch_size: no drafts while more requests than this are running (vLLM's
            disable_by_batch_size): at large batches a step is compute-bound and verifying drafts costs real time.

    Raises:
        ValueError: a negative count or lookup_min > lookup_max.
    """

    num_tokens: int = 0
    lookup_max: int = 4
    lookup_min: int = 2
    disable_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.disable_batch_size < 1 or not 1 <= self.lookup_min <= self.lookup_max:
            raise ValueError(f"speculative decoding needs num_tokens >= 0, disable_batch_size >= 1 and "
                             f"1 <= lookup_min <= lookup_max, got {self}")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


def propose_ngram(token_ids: list[int], num_tokens: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Draft tokens for a sequence by prompt lookup.

    For n from lookup_max down to lookup_min, the last n tokens are searched for earlier in the sequence; at the
    latest earlier match (recent context predicts best), the tokens that followed it are the draft.

    Args:
        token_ids: the request's prompt + output so far.
        num_tokens: most draft tokens to return.
        lookup_min, lookup_max: n-gram lengths tried, longest first.

    Returns:
        Up to num_tokens token ids; empty when nothing matches.
    """
    length = len(token_ids)
    if num_tokens <= 0 or length < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        # Windows starting at 0..length-n-1: every n-gram but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start:start + num_tokens]
    return []


def accept_greedy(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """The tokens a verified step emits: target_ids[i] is the model's greedy token after the last sampled token
    and draft_ids[:i]; drafts are kept while they equal the model's choice, then the model's own token follows.

    Args:
        draft_ids: k proposed tokens.
        target_ids: k + 1 greedy tokens, one per verified position.

    Returns:
        1 to k + 1 tokens: the accepted drafts and then the model's next token (the "bonus" token).

    Raises:
        ValueError: target_ids is not one longer than draft_ids.
    """
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(draft_ids)} drafts need {len(draft_ids) + 1} targets, got {len(target_ids)}")
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == target_ids[accepted]:
        accepted += 1
    return target_ids[:accepted + 1]
