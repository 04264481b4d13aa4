"""Validation of public requests, and resolution of their sampling parameters. Raises RequestError (never asserts).

The resolved form is the public `SamplingParams` message with every default filled in: what the worker proto
carries and what each worker converts, once, into the engine's dataclass. The defaults are those documented in
generate.proto (tests/coordinator/test_validation.py holds them against the engine's dataclass).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import grpc

from pdserve_server.coordinator.errors import RequestError, invalid
from pdserve.v1 import generate_pb2

MAX_LOGPROBS = 20  # engine.request has the same bounds (tests/coordinator/test_validation.py holds them together)
MAX_SAMPLES = 64  # sampling.n
# Stop conditions a request may carry. Stop strings are matched against every chunk on the coordinator's event loop
# (shared by every stream): 10^6 of them froze other streams for ~10 s. OpenAI's API takes 4 stop strings; these
# bounds leave room for any real use and keep matching to microseconds a token.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
CHAT_ROLES = ("system", "user", "assistant", "tool")
# Structured outputs: the text compiles on every worker the request visits (llguidance, cached per text); these
# bounds keep a request's compile and the cache's memory small (the largest JSON schemas in real use are a few KiB).
MAX_STRUCTURED_CHARS = 64 << 10
MAX_CHOICES = 1024
# JSON a caller sends (schemas, KServe's sampling_parameters) nests at most this deep: real schemas nest a few
# levels, and deeper text made Python's parser (and the workers' schema walk) raise RecursionError.
MAX_JSON_DEPTH = 64


@dataclass(frozen=True)
class Limits:
    """What the cluster can take, from the workers' GetInfo.

    Attributes:
        context_length: most prompt + output tokens (model / max_model_len).
        kv_capacity_tokens: most tokens (prompt + output) one request may hold on every live worker: the smallest
            `WorkerInfo.max_request_tokens` (a KV pool's size, or the context length on a worker whose blocks go
            back behind a sliding window).
        vocab_size: valid token ids are [0, vocab_size).
    """

    context_length: int
    kv_capacity_tokens: int
    vocab_size: int


def resolve_sampling(p: generate_pb2.SamplingParams, num_prompt_tokens: int,
                     limits: Limits) -> generate_pb2.SamplingParams:
    """Check ranges and return a copy of `p` with every default filled in (seed and logprobs stay unset when
    not asked for: unset means unseeded / no logprobs).

    Raises:
        RequestError: INVALID_ARGUMENT naming the field and its allowed range, or RESOURCE_EXHAUSTED when the
            request could never fit a worker's KV pool.
    """
    temperature = p.temperature if p.HasField("temperature") else 1.0
    if not 0.0 <= temperature < math.inf:
        raise invalid(f"sampling.temperature must be >= 0 and finite (0 = greedy), got {temperature}")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise invalid(f"sampling.top_p must be in (0, 1], got {top_p}")
    top_k = p.top_k if p.HasField("top_k") else 0
    if top_k < 0:
        raise invalid(f"sampling.top_k must be >= 0 (0 = off), got {top_k}")
    min_p = p.min_p if p.HasField("min_p") else 0.0
    if not 0.0 <= min_p <= 1.0:
        raise invalid(f"sampling.min_p must be in [0, 1], got {min_p}")
    rep = p.repetition_penalty if p.HasField("repetition_penalty") else 1.0
    if not rep > 0.0:
        raise invalid(f"sampling.repetition_penalty must be > 0 (1 = off), got {rep}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)  # unset reads as 0.0, the default
        if not -2.0 <= v <= 2.0:
            raise invalid(f"sampling.{name} must be in [-2, 2], got {v}")
    room = limits.context_length - num_prompt_tokens
    # Default: the rest of the context window, as far as the KV cache can hold it.
    max_tokens = (p.max_tokens if p.HasField("max_tokens")
                  else min(room, limits.kv_capacity_tokens - num_prompt_tokens))
    if max_tokens <= 0:
        raise invalid(f"sampling.max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise invalid(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context "
                      f"window of {limits.context_length} tokens; lower max_tokens to at most {room}")
    if num_prompt_tokens + max_tokens > limits.kv_capacity_tokens:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"prompt + max_tokens = {num_prompt_tokens + max_tokens} tokens exceeds the KV cache "
                           f"capacity of {limits.kv_capacity_tokens} tokens per request; lower max_tokens")
    min_tokens = p.min_tokens if p.HasField("min_tokens") else 0
    if not 0 <= min_tokens <= max_tokens:
        raise invalid(f"sampling.min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise invalid(f"sampling.stop has {len(p.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(s == "" for s in p.stop):
        raise invalid("sampling.stop must not contain empty strings")
    if (longest := max(map(len, p.stop), default=0)) > MAX_STOP_STRING_CHARS:
        raise invalid(f"sampling.stop has a string of {longest} characters; at most {MAX_STOP_STRING_CHARS} each")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"sampling.stop_token_ids has {len(p.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are "
                      "allowed")
    bad = [t for t in p.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise invalid(f"sampling.stop_token_ids {bad} are outside the vocabulary [0, {limits.vocab_size})")
    logprobs = p.logprobs if p.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise invalid(f"sampling.logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if p.HasField("structured_output"):
        check_structured_output(p.structured_output)
    n = p.n if p.HasField("n") else 1
    if not 1 <= n <= MAX_SAMPLES:
        raise invalid(f"sampling.n must be in [1, {MAX_SAMPLES}], got {n}")
    resolved = generate_pb2.SamplingParams()
    resolved.CopyFrom(p)
    resolved.temperature, resolved.top_p, resolved.top_k, resolved.min_p = temperature, top_p, top_k, min_p
    resolved.repetition_penalty = rep
    resolved.presence_penalty, resolved.frequency_penalty = p.presence_penalty, p.frequency_penalty
    resolved.max_tokens, resolved.min_tokens = max_tokens, min_tokens
    resolved.n = n
    return resolved


def check_structured_output(c: generate_pb2.StructuredOutput) -> None:
    """What the coordinator can check without the tokenizer: one kind set, sizes, JSON that parses. Whether the
    text compiles (schema keywords, regex and grammar syntax) is the workers' check, also before any compute.

    Raises:
        RequestError: INVALID_ARGUMENT naming sampling.structured_output.<kind> and the problem.
    """
    kind = c.WhichOneof("kind")
    name = f"sampling.structured_output.{kind}"
    if kind is None:
        raise invalid("sampling.structured_output is set but empty: set one of json_schema, regex, grammar, "
                      "json_object, choice")
    if kind == "json_object":
        if not c.json_object:
            raise invalid(f"{name} must be true when set (leave structured_output unset for no constraint)")
        return
    if kind == "choice":
        choices = list(c.choice.choices)
        if not choices or len(choices) > MAX_CHOICES:
            raise invalid(f"{name} has {len(choices)} strings; give 1 to {MAX_CHOICES}")
        if sum(map(len, choices)) > MAX_STRUCTURED_CHARS:
            raise invalid(f"{name} has more than {MAX_STRUCTURED_CHARS} characters in all")
        return
    text = getattr(c, kind)
    if not text.strip():
        raise invalid(f"{name} is empty")
    if len(text) > MAX_STRUCTURED_CHARS:
        raise invalid(f"{name} has {len(text)} characters; at most {MAX_STRUCTURED_CHARS} are allowed")
    if kind == "json_schema":
        schema = parse_json(text, name)
        if not isinstance(schema, (dict, bool)):
            raise invalid(f"{name} must be a JSON object (or true / false), got {type(schema).__name__}")


def parse_json(text: str | bytes, name: str):
    """A caller's JSON text, parsed, nesting at most MAX_JSON_DEPTH arrays and objects deep. The caller bounds the
    text's size first (the parse runs on the event loop).

    Raises:
        RequestError: INVALID_ARGUMENT naming `name`, for text that is not UTF-8 or not JSON, or nests deeper.
    """
    try:
        value = json.loads(text)
    except RecursionError:  # Python's parser recurses per level: its limit is near 1000
        raise invalid(f"{name} nests deeper than {MAX_JSON_DEPTH} arrays or objects") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise invalid(f"{name} is not valid JSON ({e})") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise invalid(f"{name} nests deeper than {MAX_JSON_DEPTH} arrays or objects")
    return value


def json_depth(value) -> int:
    """How deeply a parsed JSON value nests arrays and objects (a scalar: 0), walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in v)
    return deepest


def check_prompt_length(num_tokens: int, limits: Limits) -> None:
    """Raises RequestError INVALID_ARGUMENT for a prompt of token ids too long for the context; called on the
    message's length before its ids are copied (a caller may send millions)."""
    if num_tokens >= limits.context_length:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"prompt has {num_tokens} tokens; the context window is {limits.context_length} tokens "
                           "(prompt must leave room for at least one output token)",
                           prompt_tokens=num_tokens)  # the access log says how big the refused prompt was


def check_prompt(token_ids: list[int], limits: Limits) -> None:
    """Raises RequestError INVALID_ARGUMENT for an empty, too long or out-of-vocabulary prompt."""
    if not token_ids:
        raise invalid("prompt is empty: give non-empty text, chat messages or token ids")
    check_prompt_length(len(token_ids), limits)
    bad = next((t for t in token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")


def check_chat(chat: generate_pb2.ChatMessages) -> None:
    """Raises RequestError INVALID_ARGUMENT for malformed chat messages."""
    if not chat.messages:
        raise invalid("chat.messages is empty")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"chat.messages[{i}].role is {shorten(m.role)}; expected one of {', '.join(CHAT_ROLES)}")


def check_text_length(num_chars: int, max_chars_per_token: int, limits: Limits) -> None:
    """Refuse text that cannot fit the context whatever it tokenizes to, before spending time tokenizing it: a
    token covers at most max_chars_per_token characters, so the prompt has at least num_chars / that many tokens.

    Raises:
        RequestError: INVALID_ARGUMENT when num_chars > context_length * max_chars_per_token.
    """
    if num_chars > limits.context_length * max_chars_per_token:
        raise invalid(f"prompt text has {num_chars} characters: more than the {limits.context_length}-token context "
                      f"window can hold (at most {max_chars_per_token} characters per token)")


# Room in a request message beside its prompt: sampling (a structured-output constraint of MAX_STRUCTURED_CHARS,
# escaped, stop strings), chat roles, ids and framing.
REQUEST_OVERHEAD_BYTES = 1 << 20


def request_bytes_limit(limits: Limits, max_chars_per_token: int) -> int:
    """The largest request message worth parsing, bytes: the longest prompt text `check_text_length` can accept
    (context_length * max_chars_per_token characters of up to 4 UTF-8 bytes each) plus REQUEST_OVERHEAD_BYTES.
    Token ids take at most 5 bytes each (a varint below 2^32), far less than their text."""
    return 4 * limits.context_length * max_chars_per_token + REQUEST_OVERHEAD_BYTES


def shorten(value: str, limit: int = 64) -> str:
    """repr() of a caller's string for an error message, cut to `limit` characters (errors travel in metadata)."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value)} characters)"
