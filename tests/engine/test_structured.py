"""Structured outputs: a random-weight model's samples, which are garbage unconstrained, must belong
to the constraint's language: every sample of a JSON schema with nested objects, enums and arrays validates
(jsonschema), a regex matches, a GBNF grammar parses; a constraint that does not compile is refused before any
compute; the constraint survives migration (replayed outputs) and the prefill -> decode split; speculative drafts
stay off. Engine-level tests run the offline engine; the e2e test runs a real cluster through the SDK."""
import json
import re

import grpc
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from pdserve_server.engine.args import EngineArgs  # noqa: E402
from pdserve_server.engine.builder import build_engine  # noqa: E402
from pdserve_server.engine.errors import ErrorKind  # noqa: E402
from pdserve_server.engine.offline import run_until_idle  # noqa: E402
from pdserve_server.engine.request import FinishReason, Request, SamplingParams, StructuredOutput  # noqa: E402
from pdserve_server.engine.structured import GrammarCompiler, apply_bitmask, fill_bitmask  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
REGEX = r"(ab|cd)[0-9]{2,4}-[a-z]{3}"
# GBNF (llama.cpp): a small arithmetic language.
GRAMMAR = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
'''
GRAMMAR_RE = re.compile(r"^[0-9+\-()]+$")  # what any prefix of GRAMMAR's sentences is made of


def is_sentence(text: str) -> bool:
    """Whether text is a whole sentence of GRAMMAR (a recursive-descent parser of the same rules)."""
    pos = 0

    def num():
        nonlocal pos
        m = re.compile(r"[1-9][0-9]{0,2}").match(text, pos)
        if not m:
            raise ValueError(pos)
        pos = m.end()

    def term():
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            expr()
            if not text.startswith(")", pos):
                raise ValueError(pos)
            pos += 1
        else:
            num()

    def expr():
        nonlocal pos
        term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            term()

    try:
        expr()
    except ValueError:
        return False
    return pos == len(text)


@pytest.fixture(scope="module")
def engine_args(tiny_model_dir):
    return EngineArgs(dtype="float32", model_dir=str(tiny_model_dir), block_size=8, kv_tokens=4096, max_model_len=512)


@pytest.fixture(scope="module")
def parts(engine_args):
    return build_engine(engine_args)


@pytest.fixture(scope="module")
def tok(tokenizer):
    return tokenizer


def run(parts, reqs):
    events = run_until_idle(parts, reqs, max_steps=5000)
    assert parts.scheduler.kv.pool.integrity_errors() == []
    return events


def constrained(rid, kind, spec, seed, max_tokens=200, **kw):
    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                        structured_output=StructuredOutput(kind, spec), **kw)
    return Request(rid, [1, 504, 3158, 28], sp, eos_token_ids=(2,))


def text_of(tok, req):
    """The output's text, EOS left out."""
    return tok.decode([t for t in req.output_token_ids if t != 2])


def test_every_sample_of_a_nested_schema_validates(parts, tok):
    """Temperature 1, eight seeds, one batch: each output parses as JSON and validates against the schema (nested
    object, enums, an array of enums, a pattern), and each ended because the constraint did (STOP)."""
    reqs = [constrained(f"j{s}", "json_schema", json.dumps(SCHEMA), seed=s, max_tokens=300) for s in range(8)]
    run(parts, reqs)
    for r in reqs:
        text = text_of(tok, r)
        assert r.finish_reason == FinishReason.STOP, (r.request_id, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_unconstrained_output_of_the_same_model_is_not_json(parts, tok):
    """The control: without the constraint the random model's output is no JSON, so the test above tests the mask."""
    r = Request("u", [1, 504, 3158, 28], SamplingParams(max_tokens=40, temperature=1.0, seed=0, ignore_eos=True))
    run(parts, [r])
    with pytest.raises(ValueError):
        json.loads(text_of(tok, r))


def test_regex_and_grammar_and_choice(parts, tok):
    reqs = ([constrained(f"re{s}", "regex", REGEX, seed=s) for s in range(4)]
            + [constrained(f"g{s}", "grammar", GRAMMAR, seed=s, max_tokens=60) for s in range(4)]
            + [constrained(f"c{s}", "choice", json.dumps(["yes", "no", "maybe not"]), seed=s) for s in range(4)]
            + [constrained(f"o{s}", "json_object", "", seed=s, max_tokens=300) for s in range(2)])
    run(parts, reqs)
    for r in reqs:
        text = text_of(tok, r)
        kind = r.sampling.structured_output.kind
        if kind == "regex":
            assert r.finish_reason == FinishReason.STOP and re.fullmatch(REGEX, text), text
        elif kind == "grammar":  # may hit max_tokens inside a long expression: then a prefix of a sentence
            assert GRAMMAR_RE.match(text), text
            if r.finish_reason == FinishReason.STOP:
                assert is_sentence(text), text
        elif kind == "choice":
            assert r.finish_reason == FinishReason.STOP and text in ("yes", "no", "maybe not"), text
        else:
            if r.finish_reason == FinishReason.STOP:
                assert isinstance(json.loads(text), dict), text
    assert any(r.finish_reason == FinishReason.STOP for r in reqs if r.request_id.startswith("g"))  # parsed whole


def test_greedy_constrained_requests_take_no_drafts(engine_args, tok):
    """n-gram drafts would skip the mask: a greedy constrained request on an engine with drafts on gets none, and
    its output is the same as with drafts off."""
    import dataclasses
    outs = []
    for k in (0, 4):
        p = build_engine(dataclasses.replace(engine_args, speculative_ngram_tokens=k))
        r = Request("g", [1, 504, 3158, 28], SamplingParams(
            max_tokens=40, temperature=0.0, structured_output=StructuredOutput("regex", "(abc ){3,9}")),
            eos_token_ids=(2,))
        run(p, [r])
        assert r.num_draft_tokens == 0
        outs.append(r.output_token_ids)
    assert outs[0] == outs[1]
    assert re.fullmatch("(abc ){3,9}", tok.decode([t for t in outs[0] if t != 2]))


@pytest.mark.parametrize("kind,spec,needle", [
    ("json_schema", '{"type": "objekt"}', "objekt"),
    ("json_schema", '{"type": "object", "properties": ', "json_schema"),
    ("regex", "a(b", "unclosed group"),
    ("grammar", "root ::= foo", "foo"),
    ("choice", "[]", "choice"),
])
def test_a_constraint_that_does_not_compile_is_refused_before_compute(parts, kind, spec, needle):
    r = constrained("bad", kind, spec, seed=0)
    failure = parts.scheduler.add_request(r)
    assert failure is not None and failure.kind == ErrorKind.INVALID_REQUEST, failure
    assert needle in failure.message and "structured_output" in failure.message, failure.message
    assert "bad" not in parts.scheduler.requests and not parts.scheduler.has_work()


def test_a_migrated_request_replays_its_outputs_into_the_matcher(engine_args, parts, tok):
    """A request resumed elsewhere with the tokens already sent continues the same seeded stream, inside the
    language; outputs outside the language are refused at admission."""
    spec = json.dumps(SCHEMA)
    whole = constrained("w", "json_schema", spec, seed=3, max_tokens=300)
    run(parts, [whole])
    resumed = constrained("r", "json_schema", spec, seed=3, max_tokens=300)
    resumed.output_token_ids[:] = whole.output_token_ids[:6]
    resumed.__post_init__()
    run(build_engine(engine_args), [resumed])
    assert resumed.output_token_ids == whole.output_token_ids
    jsonschema.validate(json.loads(text_of(tok, resumed)), SCHEMA)
    bad = constrained("b", "json_schema", spec, seed=3)
    bad.output_token_ids[:] = tok.encode("hello")
    bad.__post_init__()
    failure = parts.scheduler.add_request(bad)
    assert failure is not None and failure.kind == ErrorKind.INVALID_REQUEST and "output_token_ids" in failure.message


def test_prefill_then_decode_keeps_the_constraint(parts, tok):
    """The prefill worker samples the first token under the constraint; the decode worker's matcher takes it on
    arrival (kv_arrived) and the rest follows the language; a first token outside it is refused."""
    spec = json.dumps(SCHEMA)
    pre = constrained("p", "json_schema", spec, seed=5, max_tokens=300)
    pre.prefill_only = True
    run(parts, [pre])
    assert pre.finish_reason == FinishReason.PREFILL_DONE
    first = pre.output_token_ids[0]
    parts.scheduler.abort("p")  # the held blocks (the KV send would free them)
    dec = constrained("d", "json_schema", spec, seed=5, max_tokens=300)
    dec.remote_kv = True
    assert parts.scheduler.add_request(dec) is None
    parts.scheduler.reserve()
    assert parts.scheduler.kv_arrived("d", first) is None
    run(parts, [])
    assert dec.output_token_ids[0] == first
    jsonschema.validate(json.loads(text_of(tok, dec)), SCHEMA)
    other = constrained("o", "json_schema", spec, seed=5)
    other.remote_kv = True
    parts.scheduler.add_request(other)
    parts.scheduler.reserve()
    failure = parts.scheduler.kv_arrived("o", tok.encode("x")[0])
    assert failure is not None and failure.kind == ErrorKind.INVALID_REQUEST
    assert "o" not in parts.scheduler.requests


def test_compiled_once_per_text_and_masks_batched(tiny_model_dir):
    g = GrammarCompiler(tiny_model_dir / "tokenizer.json", 49152, (2,))
    ms = [g.matcher(StructuredOutput("regex", "[0-9]+")) for _ in range(3)] + [g.matcher(StructuredOutput("choice",
                                                                                                          '["a"]'))]
    assert g.num_compiled == 2
    bitmask = fill_bitmask(ms, 49152)
    assert bitmask.shape == (4, 49152 // 32) and str(bitmask.dtype) == "torch.int32"
    import torch
    logits = torch.zeros(4, 49152)
    apply_bitmask(logits, bitmask)
    allowed = [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]
    assert allowed[0] == allowed[1] == allowed[2] and 2 not in allowed[0]  # no EOS before a digit
    assert all(any(c.isdigit() for c in g.tokenizer().decode_str([t])) for t in list(allowed[0])[:50])
    assert ms[0].accept(allowed[0].pop()) and not ms[1].stopped


# ---- a real cluster: prefill and decode workers (engine processes), through our SDK and KServe -----------------


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, launch_module):
    return launch_module(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "4096",
                                                      "--max-model-len", "512", "--connector", "tcp"])


@pytest.mark.e2e
def test_cluster_samples_validate_and_bad_schemas_are_invalid_argument(cluster):
    """Through the SDK: JSON-schema samples (temperature 1, several seeds, prefill on one worker and decode on the
    other) parse and validate; a regex and a grammar hold; a schema that does not compile and one that is no JSON
    are INVALID_ARGUMENT naming the problem, and leave every worker idle."""
    from pdserve import Client, SamplingParams as Public, StructuredOutput as Constraint
    from helpers import assert_idle

    prompt = "Describe a user as JSON:"
    with Client(cluster.address) as c:
        for seed in range(4):
            out = c.complete(prompt, Public(max_tokens=300, temperature=1.0, seed=seed,
                                            structured_output=Constraint(json_schema=json.dumps(SCHEMA))))
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)
        out = c.complete(prompt, Public(max_tokens=60, temperature=1.0, seed=1,
                                        structured_output=Constraint(regex=REGEX)))
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
        out = c.complete(prompt, Public(max_tokens=60, temperature=1.0, seed=2,
                                        structured_output=Constraint(grammar=GRAMMAR)))
        assert GRAMMAR_RE.match(out.text) and (out.finish_reason == "length" or is_sentence(out.text)), out.text
        for bad, needle in ((Constraint(json_schema='{"type": "objekt"}'), "objekt"),
                            (Constraint(json_schema='{"type": '), "not valid JSON"),
                            (Constraint(regex="a(b"), "unclosed group")):
            with pytest.raises(grpc.RpcError) as e:
                c.complete(prompt, Public(max_tokens=20, structured_output=bad))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details(), e.value
    assert_idle(cluster)


@pytest.mark.e2e
def test_kserve_guided_json_validates(cluster):
    """Triton's vLLM-backend tensors with `guided_json` in sampling_parameters (tritonclient)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name, value, datatype):
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        return t

    client = grpcclient.InferenceServerClient(url=cluster.address)
    try:
        sampling = {"max_tokens": 300, "temperature": 1.0, "seed": 7, "guided_json": SCHEMA}
        result = client.infer("tiny", [tensor("text_input", b"A user as JSON:", "BYTES"),
                                       tensor("sampling_parameters", json.dumps(sampling).encode(), "BYTES"),
                                       tensor("exclude_input_in_output", True, "BOOL")], client_timeout=120)
        jsonschema.validate(json.loads(result.as_numpy("text_output")[0].decode()), SCHEMA)
    finally:
        client.close()
