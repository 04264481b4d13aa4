"""Triton vLLM-backend request fields as pdserve's sampling and scheduling (`coordinator.doors.kserve`'s module
docstring describes the protocol): the `sampling_parameters` JSON object's vLLM SamplingParams fields (and
structured-output keys) as our public `SamplingParams`, and Triton's `priority` request parameter as our priority."""
from __future__ import annotations

import json
import math

from pdserve_server.coordinator.errors import RequestError, invalid
from pdserve_server.coordinator.validation import parse_json, shorten
from pdserve.v1 import generate_pb2

VLLM_DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, which the backend's callers rely on
# sampling_parameters fields taken, by their vLLM type; the others of vLLM's SamplingParams are refused by name.
SAMPLING_FIELDS = {
    "float": ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"),
    "int": ("max_tokens", "min_tokens", "top_k", "seed", "n", "best_of"),
    "bool": ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
             "use_beam_search"),
    "list": ("stop", "stop_token_ids")}
UNSUPPORTED = ("logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words", "lora_name",
               "truncate_prompt_tokens")
# Structured outputs, as vLLM takes them: an object of StructuredOutputsParams' fields (`structured_outputs`, or
# `guided_decoding` as older vLLM and Triton's vLLM backend call it), or vLLM's OpenAI-server `guided_*` keys.
STRUCTURED_OBJECTS = ("structured_outputs", "guided_decoding")
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
               "guided_choice": "choice", "guided_json_object": "json_object"}
INT32 = (-2**31, 2**31 - 1)  # our int fields' range: larger values are clamped, and validation names the limit


DEFAULT_PRIORITY_LEVEL = 10  # Triton priority level that maps to our default priority, 0 (module docstring)


def to_priority(parameters) -> int:
    """Our priority for a request's Triton `priority` parameter (see the module docstring); 0 without one.

    Raises:
        RequestError: INVALID_ARGUMENT for a negative, fractional, boolean or text priority.
    """
    if "priority" not in parameters:
        return 0
    p = parameters["priority"]
    kind = p.WhichOneof("parameter_choice")
    value = getattr(p, kind) if kind else 0
    if kind not in (None, "int64_param", "uint64_param") or value < 0:
        raise invalid(f"parameter priority must be an unsigned integer (1 = highest level, 0 = the default, "
                      f"{DEFAULT_PRIORITY_LEVEL}), got {shorten(str(value))}")
    if value == 0:
        return 0
    return max(INT32[0], min(INT32[1], value - DEFAULT_PRIORITY_LEVEL))


def _kinds() -> dict[str, str]:
    return {name: kind for kind, names in SAMPLING_FIELDS.items() for name in names}


def to_sampling(fields: dict) -> generate_pb2.SamplingParams:
    """sampling_parameters' fields (vLLM's names; values as the backend converts them: "0.5" is 0.5) as our public
    SamplingParams, unresolved. null means the default; max_tokens defaults to 16 (vLLM's); top_k -1 is off.

    Raises:
        RequestError: INVALID_ARGUMENT naming the field, for unknown or unsupported fields and values of the wrong
            type (n or best_of > 1, skip_special_tokens false: not supported).
    """
    kinds, out = _kinds(), generate_pb2.SamplingParams(max_tokens=VLLM_DEFAULT_MAX_TOKENS)
    for key, value in fields.items():
        if value is None:
            continue
        if key in UNSUPPORTED:
            raise invalid(f"sampling_parameters.{key} is not supported by this server")
        if key in STRUCTURED_OBJECTS or key in GUIDED_KEYS:
            _structured(key, value, out)
            continue
        kind = kinds.get(key)
        if kind is None:
            raise invalid(f"sampling_parameters has an unknown field {shorten(key)}; known: {', '.join(kinds)}")
        v = _convert(key, kind, value)
        if key in ("n", "best_of"):
            if v != 1:
                raise invalid(f"sampling_parameters.{key} = {v}: parallel sampling is not supported; send 1")
        elif key == "skip_special_tokens":
            if not v:
                raise invalid("sampling_parameters.skip_special_tokens = false is not supported: text never "
                              "includes special tokens")
        elif key == "use_beam_search":
            if v:
                raise invalid("sampling_parameters.use_beam_search = true is not supported")
        elif key == "spaces_between_special_tokens":
            pass  # only about special tokens, which text never includes
        elif key == "top_k":
            # vLLM's -1 (or 0) is off, as our 0; other negatives fail validation
            out.top_k = 0 if v == -1 else min(max(v, INT32[0]), INT32[1])
        elif key == "seed":
            out.seed = v % 2**64  # vLLM takes any int; ours is uint64
        elif kind == "int":
            setattr(out, key, min(max(v, INT32[0]), INT32[1]))
        elif key == "stop":
            out.stop.extend(v)
        elif key == "stop_token_ids":
            out.stop_token_ids.extend(v)
        else:
            setattr(out, key, v)
    return out


def _structured(key: str, value, out: generate_pb2.SamplingParams) -> None:
    """One structured-output field of sampling_parameters into out.structured_output (vLLM's names: json (an object
    or its JSON text), regex, grammar, choice (a list of strings), json_object (true)).

    Raises:
        RequestError: INVALID_ARGUMENT when a second constraint is given, or for a value of the wrong type.
    """
    if key in STRUCTURED_OBJECTS:
        if isinstance(value, str):
            try:
                value = parse_json(value, f"sampling_parameters.{key}")
            except RequestError:
                value = None  # refused below, saying what is expected
        if not isinstance(value, dict):
            raise invalid(f"sampling_parameters.{key} must be an object with one of json, regex, grammar, choice, "
                          "json_object")
        items = [(f"{key}.{k}", k, v) for k, v in value.items() if v is not None and v is not False]
    else:
        items = [(key, GUIDED_KEYS[key], value)]
    for name, field, v in items:
        if out.HasField("structured_output"):
            raise invalid(f"sampling_parameters.{name}: only one structured-output constraint may be given")
        target = out.structured_output
        if field == "json" and isinstance(v, (dict, bool)):
            target.json_schema = json.dumps(v)
        elif field == "json" and isinstance(v, str):
            target.json_schema = v
        elif field in ("regex", "grammar") and isinstance(v, str):
            setattr(target, field, v)
        elif field == "choice" and isinstance(v, list) and all(isinstance(c, str) for c in v):
            target.choice.choices.extend(v)
        elif field == "json_object" and v is True:
            target.json_object = True
        else:
            out.ClearField("structured_output")
            raise invalid(f"sampling_parameters.{name} is not a structured-output field of the expected type (json: "
                          f"object or string; regex, grammar: string; choice: list of strings; json_object: true), "
                          f"got {shorten(json.dumps(v))}")


def _convert(key: str, kind: str, value):
    """One field's value as its vLLM type. Raises RequestError INVALID_ARGUMENT naming the field and the type."""
    try:
        if kind == "float" and not isinstance(value, bool):
            v = float(value)
            if math.isfinite(v):
                return v
        elif kind == "int" and not isinstance(value, bool):
            v = float(value) if isinstance(value, float) else int(value)
            if v == int(v) and abs(v) < 2**63:
                return int(v)
        elif kind == "bool":
            if isinstance(value, bool) or value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
        elif key == "stop" and isinstance(value, str):
            return [value]
        elif key == "stop" and isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        elif key == "stop_token_ids" and isinstance(value, list):
            ids = [_convert(key, "int", t) for t in value]
            if all(0 <= t < 2**31 for t in ids):
                return ids
    except (TypeError, ValueError, OverflowError, RequestError):
        pass
    expected = {"float": "a finite number", "int": "an integer", "bool": "true or false"}.get(kind) or (
        "a string or a list of strings" if key == "stop" else "a list of token ids (integers >= 0)")
    raise invalid(f"sampling_parameters.{key} must be {expected}, got {shorten(json.dumps(value))}")
