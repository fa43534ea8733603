"""Wire requests to engine requests: the model's sampling defaults fill only what a request leaves unset."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from google.protobuf.json_format import MessageToDict
from onestream.cluster.convert import finished_to_proto, request_from_proto
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.api import DraftUsage, Finished, SamplingParams, Timings, Usage
from onestream.worker.errors import InvalidRequestError

MODEL_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.25}


def test_unset_sampling_fields_take_the_models_defaults() -> None:
    request = request_from_proto(pb.GenerateRequest(text="import os"), "r1", MODEL_DEFAULTS)
    assert request.sampling == SamplingParams(temperature=0.0, repetition_penalty=1.25)


def test_fields_the_request_sets_win_over_the_defaults() -> None:
    message = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=0.5, top_p=0.75, seed=3))
    request = request_from_proto(message, "r2", MODEL_DEFAULTS)
    assert request.sampling == SamplingParams(temperature=0.5, top_p=0.75, seed=3, repetition_penalty=1.25)
    explicit = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(repetition_penalty=1.0))
    assert request_from_proto(explicit, "r3", MODEL_DEFAULTS).sampling.repetition_penalty == 1.0


def test_without_defaults_the_engine_defaults_apply_and_bad_input_is_named() -> None:
    assert request_from_proto(pb.GenerateRequest(text="x"), "r4").sampling == SamplingParams()
    ignored = request_from_proto(pb.GenerateRequest(text="x"), "r5", {"max_new_tokens": 5, "top_k": 4})
    assert ignored.sampling == SamplingParams(top_k=4)  # keys that are not sampling fields are not applied
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        request_from_proto(pb.GenerateRequest(), "r6", MODEL_DEFAULTS)


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "field", "value"),
    [("stop", "\n\n", "stop_string", "\n\n"), ("stop", 2, "stop_token_id", 2), ("length", None, None, None)],
)
def test_finished_names_what_stopped_it(
    finish_reason: str, stop_reason: str | int | None, field: str | None, value: object
) -> None:
    finished = Finished(finish_reason, Usage(prompt_tokens=3, generated_tokens=2), Timings(), stop_reason)
    message = finished_to_proto(finished, pb.Card(), queue_wait_s=0, time_to_first_token_s=0, total_s=0)
    assert message.WhichOneof("stopped_by") == field
    if field is not None:
        assert getattr(message, field) == value


def test_logit_bias_reaches_the_sampling_params() -> None:
    message = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logit_bias={7: -100.0, 3: 2.5}))
    assert request_from_proto(message, "r7").sampling.logit_bias == ((3, 2.5), (7, -100.0))


def test_the_wire_carries_every_sampling_and_usage_field() -> None:
    # convert.py copies these by name, so the proto and the dataclasses must name the same fields.
    assert {f.name for f in pb.SamplingParams.DESCRIPTOR.fields} == {
        f.name for f in dataclasses.fields(SamplingParams)
    }
    assert {f.name for f in pb.Usage.DESCRIPTOR.fields} == {f.name for f in dataclasses.fields(Usage)}
    usage = Usage(prompt_tokens=9, cached_prompt_tokens=4, generated_tokens=5, drafts=2, draft_tokens=4)
    usage.accepted_draft_tokens, usage.accepted_per_position = 3, [2, 1]
    usage.by_source = {"mtp": DraftUsage(1, 2, 1, [1]), "lookup": DraftUsage(1, 2, 2, [1, 1])}
    finished = finished_to_proto(
        Finished("stop", usage, Timings(decode_s=0.5)),
        pb.Card(card_id="c"),
        queue_wait_s=0.0,
        time_to_first_token_s=0.1,
        total_s=0.6,
    )
    assert MessageToDict(finished.usage, preserving_proto_field_name=True) == usage.as_dict()


def test_clients_import_the_request_types_without_torch() -> None:
    # The CLI client and the front doors parse flags and requests before any engine exists.
    probe = "import sys, onestream.cluster.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
