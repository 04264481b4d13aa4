"""The KServe door's reading of a request's tensors and sampling_parameters, without servers: every size is checked
against the tensor's datatype and shape before anything is decoded (one request's cost cannot grow with its size),
and every malformed input, however deep or large, is INVALID_ARGUMENT."""
import struct

import grpc
import pytest

from pdserve_server.coordinator.doors import kserve
from pdserve_server.coordinator.errors import RequestError
from pdserve_server.coordinator.doors.kserve_sampling import to_sampling
from pdserve_server.coordinator.validation import MAX_JSON_DEPTH, json_depth, parse_json

pb = kserve.pb


def request(*tensors, raw=None):
    """A ModelInferRequest of (name, datatype, shape, typed bytes or None) tensors and optional raw contents."""
    r = pb.ModelInferRequest(model_name="tiny")
    for name, datatype, shape, typed in tensors:
        t = r.inputs.add(name=name, datatype=datatype, shape=shape)
        if typed is not None:
            t.contents.bytes_contents.extend(typed)
    if raw is not None:
        r.raw_input_contents.extend(raw)
    return r


def invalid(r) -> str:
    with pytest.raises(RequestError) as e:
        kserve.read_inputs(r)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.message


def one(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def test_raw_and_typed_contents_give_the_same_inputs():
    raw = kserve.read_inputs(request(("text_input", "BYTES", [1], None), ("stream", "BOOL", [1], None),
                                     raw=[one(b"hi"), b"\x01"]))
    typed = request(("text_input", "BYTES", [1], [b"hi"]))
    typed.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    assert raw == kserve.read_inputs(typed) == {"text_input": b"hi", "stream": True}


def test_many_raw_elements_are_refused_by_size_alone():
    """15 million empty elements in one 60 MB raw content (which froze the event loop ~21 s, element by element):
    the size says it is not one element, and the message names that size, not an element count."""
    message = invalid(request(("text_input", "BYTES", [1], None), raw=[b"\0" * (4 * 15_000_000)]))
    assert "must be 4 + 0 bytes (one length-prefixed element), got 60000000" in message


@pytest.mark.parametrize("raw, needle", [
    (b"\1\0", "ends inside the element's 4-byte length"),
    (struct.pack("<I", 9) + b"abc", "must be 4 + 9 bytes"),
    (one(b"a") + one(b"b"), "must be 4 + 1 bytes"),
])
def test_raw_bytes_of_the_wrong_size(raw, needle):
    assert needle in invalid(request(("text_input", "BYTES", [1], None), raw=[raw]))


def test_shape_is_checked_before_contents():
    message = invalid(request(("text_input", "BYTES", [15_000_000], None), raw=[b"\0" * 64]))
    assert "must be one element of shape [1]; got shape [15000000]" in message
    message = invalid(request(("text_input", "BYTES", [1] * 1000, None), raw=[one(b"x")]))
    assert "got shape [1, 1, 1, 1, 1, 1, 1, 1, '...']" in message


def test_raw_bool_is_one_byte():
    assert "raw BOOL content of shape [1] must be 1 byte, got 2" in invalid(
        request(("text_input", "BYTES", [1], None), ("stream", "BOOL", [1], None), raw=[one(b"a"), b"\1\1"]))


def test_raw_and_typed_contents_together_are_refused():
    """Triton refuses both; typed contents were silently ignored before."""
    message = invalid(request(("text_input", "BYTES", [1], [b"typed"]), raw=[one(b"raw")]))
    assert "has both raw_input_contents and typed contents" in message


def test_typed_contents_must_be_one_element():
    assert "got 2 element(s)" in invalid(request(("text_input", "BYTES", [1], [b"a", b"b"])))


def test_more_inputs_than_the_model_has():
    tensors = [("text_input", "BYTES", [1], [b"a"])] * 5
    assert "5 inputs; this model takes at most 4" in invalid(request(*tensors))


def sampling_fields(text: bytes) -> dict:
    return kserve._Request(None, pb.ModelInferRequest())._sampling_fields(text)


@pytest.mark.parametrize("text, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper than"),  # RecursionError before: UNKNOWN, or a dead stream
    (b'{"s": [[[["x"]]]]}', None),
    (b'{"a": ' * 80 + b"1" + b"}" * 80, "nests deeper than"),
    (b" " * (kserve.MAX_SAMPLING_JSON_BYTES + 1), f"at most {kserve.MAX_SAMPLING_JSON_BYTES} are allowed"),
    (b"{not json", "sampling_parameters is not valid JSON"),
    (b"\xff", "sampling_parameters is not valid JSON"),
])
def test_sampling_parameters_are_bounded_before_use(text, needle):
    if needle is None:  # shallow nesting parses (and the field's own check names it later)
        assert sampling_fields(text)["s"] == [[[["x"]]]]
        return
    with pytest.raises(RequestError) as e:
        sampling_fields(text)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.message, e.value.message


def test_a_deep_structured_output_string_is_refused_by_its_field():
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(RequestError) as e:
        to_sampling({"structured_outputs": deep})
    assert "structured_outputs must be an object" in e.value.message


def test_json_depth_limit_is_inclusive():
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(parse_json(at_limit, "x")) == MAX_JSON_DEPTH
    assert json_depth({"a": [1, {"b": 2}], "c": 3}) == 3 and json_depth(7) == 0
    with pytest.raises(RequestError):
        parse_json("[" + at_limit + "]", "x")
