"""Synthetic benchmark prompts cut from real English text, with exact token counts.

The corpus is the prose of Python's standard-library documentation (module docstrings; PSF licence, present on
every machine, no download). Each request takes a window of the tokenized corpus at a random offset, so prompts
differ from their first token (no accidental prefix-cache hits between requests).
"""
from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass

_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
            "decimal", "difflib", "email", "functools", "heapq", "http.server", "inspect", "json", "logging",
            "multiprocessing", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3", "statistics",
            "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.request",
            "uuid", "zipfile")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a run: prompt token ids and the exact number of tokens to generate (ignore_eos)."""

    prompt_ids: list[int]
    output_len: int


def corpus_text() -> str:
    """Concatenated module docstrings (tens of thousands of words of real prose)."""
    parts = []
    for name in _MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc:
            parts.append(doc)
    return "\n\n".join(parts)


def corpus_ids(tokenizer) -> list[int]:
    """The corpus as token ids (no special tokens): what prompts are cut from."""
    return tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]


SEED_CHAT_PROMPT = "Explain how transformers work"  # seed 004's example prompt


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user message rendered with the model's chat template, ready for the assistant's reply."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def seed_requests(tokenizer, num: int, output_len: int = 75) -> list[BenchRequest]:
    """Seed 004's sweep load: every request the same chat prompt, `output_len` output tokens (the seed's ~75)."""
    ids = chat_prompt_ids(tokenizer, SEED_CHAT_PROMPT)
    return [BenchRequest(list(ids), output_len) for _ in range(num)]


def make_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  seed: int = 0) -> list[BenchRequest]:
    """`num` requests; lengths are fixed, or uniform in [len * (1 - r), len * (1 + r)] with r = range_ratio
    (vLLM's random-dataset convention).

    Raises:
        ValueError: range_ratio outside [0, 1), or lengths < 1.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    ids = corpus_ids(tokenizer)
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    out = []
    for _ in range(num):
        n = length(input_len)
        if n >= len(ids):
            raise ValueError(f"input_len {n} exceeds the corpus ({len(ids)} tokens)")
        start = rng.randrange(0, len(ids) - n)
        out.append(BenchRequest(ids[start:start + n], length(output_len)))
    return out
