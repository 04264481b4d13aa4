"""Structured outputs: a request's constraint (JSON schema, regex, grammar, JSON object, choice) compiled against
the model's tokenizer into a matcher, the batch's token bitmask, and its application to the logits.

The grammar engine is llguidance, picked over xgrammar on CPU (`bench/structured.py`, docs/history/benchmarks.md): its
batched mask fill cost 0.18 against 0.32 ms at batch 1 and 2.3 against 8.4 ms at batch 32, and a new schema
compiles lazily (1.4 ms to a first matcher, against 385 ms), so an unseen schema does not stall the engine loop. Each distinct (kind, text) is compiled once into a template
matcher, kept in an LRU cache; a request's matcher is a copy of it (microseconds). Everything here runs on the
engine thread.

Bitmask layout (llguidance's and xgrammar's): int32 [rows, ceil(vocab / 32)], bit j of word w set = token
32 * w + j allowed.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from pdserve_server.engine.errors import EngineError, ErrorKind
from pdserve_server.engine.request import StructuredOutput

KINDS = ("json_schema", "regex", "grammar", "json_object", "choice")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Matcher:
    """One request's position in its constraint's language.

    Attributes:
        raw: the llguidance `LLMatcher`.
        executor: its compiler's llguidance `LLExecutor` (fills a batch's masks in one call).
    """

    __slots__ = ("raw", "executor")

    def __init__(self, raw, executor) -> None:
        self.raw, self.executor = raw, executor

    def accept(self, token_id: int) -> bool:
        """Advance by one token. Returns False when the constraint does not allow it (the matcher is then in
        error and must not be used again)."""
        return bool(self.raw.consume_token(token_id)) and not self.raw.is_error()

    @property
    def stopped(self) -> bool:
        """No token can follow: the output is a complete string of the language that cannot be extended, the
        end-of-sequence token was accepted, or a token was refused (`accept` returned False)."""
        return bool(self.raw.is_stopped() or self.raw.is_error())

    @property
    def error(self) -> str:
        return self.raw.get_error()


class GrammarCompiler:
    """Compiles constraints into matchers for one tokenizer, with an LRU cache of compiled templates.

    Args:
        tokenizer_json: path of the model's tokenizer.json (HF fast tokenizer), loaded by `tokenizer()` (0.2-0.5 s
            for SmolLM2's 49152 tokens; `engine.builder` calls it at engine start).
        vocab_size: the logits' width (the model's vocabulary; may exceed the tokenizer's).
        eos_token_ids: the model's end-of-sequence ids (allowed where the language may end).
        cache_size: compiled constraints kept.
    """

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 256):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer = None
        self._executor = None  # llguidance's batched mask filler (one thread: the engine's loop computes on the rest)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # the tokenizer may be loaded from another thread than the engine's
        self.num_compiled = 0

    def tokenizer(self):
        """The llguidance tokenizer (loaded once). Raises EngineError(INVALID_REQUEST) when the model has no
        tokenizer.json."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance
                if not self.tokenizer_json.is_file():
                    raise EngineError(ErrorKind.INVALID_REQUEST, "structured outputs need the model's tokenizer.json, "
                                                                 f"which {self.tokenizer_json.parent} does not have")
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json.read_text(), n_vocab=self.vocab_size,
                                                         eos_token=list(self.eos_token_ids) or None)
            return self._tokenizer

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        """A fresh matcher at the start of `constraint`'s language.

        Raises:
            EngineError: INVALID_REQUEST naming the kind and what is wrong with its text (unparsable JSON, an
                unsupported schema keyword, a bad regex, an undefined grammar rule, ...).
        """
        import llguidance

        key = (constraint.kind, constraint.spec)
        template = self._cache.get(key)
        if template is None:
            grammar = _grammar(constraint)
            template = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
            if template.is_error():
                raise EngineError(ErrorKind.INVALID_REQUEST,
                                  f"structured_output.{constraint.kind} does not compile: {_first_line(template)}")
            self.num_compiled += 1
            self._cache[key] = template
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(1)
        return Matcher(template.deep_copy(), self._executor)


def fill_bitmask(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
    """The allowed tokens of each matcher (at least one, all from one `GrammarCompiler`), filled in one batched call
    by their compiler's executor.

    Returns:
        int32 [len(matchers), ceil(vocab_size / 32)] on the CPU (layout in the module docstring).
    """
    bitmask = torch.empty((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    matchers[0].executor.unsafe_compute_mask_ptr([(m.raw, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                      bitmask.shape[1] * 4, len(matchers))
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    Args:
        logits: [N, V] float (fp32 or 16-bit), any device.
        bitmask: int32 [N, ceil(V / 32)] on the CPU (`fill_bitmask`).

    Unpacked with numpy (no torch.compile at serve time, which llguidance's own apply uses); on a GPU the [N, V]
    bool mask crosses to the device (N x V bytes).
    """
    keep = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
    logits.masked_fill_(torch.from_numpy(keep.view(np.bool_)).to(logits.device).logical_not_(), float("-inf"))


def _grammar(c: StructuredOutput) -> str:
    """llguidance's grammar text for a constraint. Raises EngineError(INVALID_REQUEST) for what cannot be read."""
    import llguidance

    try:
        if c.kind == "json_schema":
            return llguidance.grammar_from("json_schema", json.dumps(_compact(json.loads(c.spec))))
        if c.kind == "json_object":
            return llguidance.grammar_from("json_schema", json.dumps(_compact({"type": "object"})))
        if c.kind == "regex":
            return llguidance.grammar_from("regex", c.spec)
        if c.kind == "grammar":
            return llguidance.grammar_from("grammar", c.spec)  # GBNF or Lark, told apart by llguidance
        if c.kind == "choice":
            choices = json.loads(c.spec)
            if not choices or not all(isinstance(s, str) for s in choices):
                raise ValueError("choices must be a non-empty list of strings")
            return llguidance.grammar_from("choice", c.spec)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise EngineError(ErrorKind.INVALID_REQUEST, f"structured_output.{c.kind} does not compile: {e}") from None
    raise EngineError(ErrorKind.INVALID_REQUEST, f"structured_output kind {c.kind!r} is not one of {KINDS}")


def _compact(schema):
    """The schema with llguidance's JSON layout fixed to `json.dumps`'s (", " and ": ", no other whitespace), unless
    it sets its own `x-guidance` options. Flexible whitespace let a weak model fill its whole output with spaces
    and newlines, all valid JSON (seen with the random test model: 300 tokens of whitespace after `{"name"`)."""
    if schema is True:
        schema = {}
    elif schema is False:
        schema = {"not": {}}
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": JSON_LAYOUT}
    return schema


def _first_line(m) -> str:
    """The matcher's error, without the state dump llguidance appends."""
    return m.get_error().split("\n<state>")[0].strip()[:500]
