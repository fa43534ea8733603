"""Client helpers for the pool's gRPC API: a small synchronous client and what the CLI clients share.

client = PoolClient("127.0.0.1:50051")
for event in client.generate(make_request("def add(a, b):", session_id="agent-1", max_tokens=64)):
    ...  # GenerateResponse: queued / assigned / chunk / finished
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.protos.onestream.v1 import onestream_pb2_grpc as pb_grpc
from onestream.worker.api import SAMPLING_FIELD_TYPES, SAMPLING_FIELDS, SamplingParams

from .wire import channel_options


def make_request(
    prompt: str | Sequence[int] | Sequence[dict[str, str]],
    *,
    session_id: str = "",
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    deadline_s: float | None = None,
    request_id: str = "",
    ignore_eos: bool = False,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest: `prompt` is text, token ids or chat messages ({"role", "content"} dicts);
    `deadline_s` is seconds from now; `sampling` takes SamplingParams' fields (None = server default)."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameters {sorted(unknown)}; known: {SAMPLING_FIELDS}")
    request = pb.GenerateRequest(
        session_id=session_id,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        request_id=request_id,
        ignore_eos=ignore_eos,
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.messages.messages.extend(pb.ChatMessage(**m) for m in prompt)  # type: ignore[arg-type]
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    if max_tokens is not None:
        request.max_tokens = max_tokens
    if deadline_s is not None:
        request.deadline.FromNanoseconds(int((time.time() + deadline_s) * 1e9))
    return request


API_KEY_ENV = "ONESTREAM_API_KEY"


class PoolClient:
    """A synchronous client of one router; `api_key` is sent with every call (a pool with --api-keys)."""

    def __init__(self, address: str, *, timeout_s: float = 30.0, api_key: str | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s  # for the unary calls
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self.stub = pb_grpc.OneStreamStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(self, request: pb.GenerateRequest, *, timeout_s: float | None = None) -> Any:
        """The response stream (iterate it; `.cancel()` it to stop the generation)."""
        return self.stub.Generate(request, timeout=timeout_s, metadata=self.metadata)

    def abort(self, *request_ids: str) -> list[str]:
        return list(
            self.stub.Abort(
                pb.AbortRequest(request_ids=request_ids), timeout=self.timeout_s, metadata=self.metadata
            ).aborted
        )

    def close_session(self, session_id: str) -> str:
        return self.stub.CloseSession(
            pb.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s, metadata=self.metadata
        ).card_id

    def cards(self) -> list[pb.Card]:
        return list(
            self.stub.ListCards(pb.ListCardsRequest(), timeout=self.timeout_s, metadata=self.metadata).cards
        )

    def sessions(self) -> list[pb.Session]:
        return list(
            self.stub.ListSessions(
                pb.ListSessionsRequest(), timeout=self.timeout_s, metadata=self.metadata
            ).sessions
        )

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self.timeout_s, metadata=self.metadata
        )

    def pool_status(self) -> pb.PoolStatus:
        return self.stub.GetPoolStatus(
            pb.GetPoolStatusRequest(), timeout=self.timeout_s, metadata=self.metadata
        )

    def health(self, service: str = "") -> str:
        response = self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def stream_text(
    events: Iterator[pb.GenerateResponse], out: TextIO, *, show_queue: bool = True, err: TextIO | None = None
) -> pb.Finished | None:
    """Write a Generate stream's text to `out` as it arrives (queue positions to `err`); the final
    message, or None if the stream ended without one."""
    err = err or sys.stderr
    finished = None
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "queued" and show_queue:
            print(
                f"[queued: position {event.queued.position} of {event.queued.queue_depth}]",
                file=err,
                flush=True,
            )
        elif kind == "chunk":
            out.write(event.chunk.text)
            out.flush()
        elif kind == "finished":
            finished = event.finished
    return finished


def describe_finished(finished: pb.Finished) -> str:
    u, t = finished.usage, finished.timings
    parts = [
        f"finish={finished.finish_reason}",
        f"card={finished.card.card_id}",
        f"prompt={u.prompt_tokens} (cached {u.cached_prompt_tokens})",
        f"generated={u.generated_tokens}",
        f"queue={t.queue_wait_s * 1e3:.0f}ms",
        f"ttft={t.time_to_first_token_s * 1e3:.0f}ms",
        f"decode={t.decode_tokens_per_s:.1f} tok/s",
    ]
    if u.draft_tokens:
        by_source = "".join(
            f" {s} {c.accepted_tokens}/{c.draft_tokens}" for s, c in sorted(u.by_source.items())
        )
        parts.append(f"accepted={u.accepted_draft_tokens}/{u.draft_tokens} drafts{by_source}")
    return "  ".join(parts)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="127.0.0.1:50051", help="the router's gRPC address (HOST:PORT)")
    add_api_key_argument(parser)


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"the pool's API key, when it runs with --api-keys (default: ${API_KEY_ENV})",
    )


def client_from_args(args: argparse.Namespace) -> PoolClient:
    return PoolClient(args.server, api_key=getattr(args, "api_key", None))


def add_sampling_flags(
    parser: argparse.ArgumentParser, *, help_overrides: dict[str, str] | None = None
) -> None:
    """One flag per scalar SamplingParams field (`--top-k` for `top_k`), each None unless given, so that
    the server's (or the model's) defaults fill what is left out."""
    for f in dataclasses.fields(SamplingParams):
        if f.name not in SAMPLING_FIELDS:
            continue
        help_text = (help_overrides or {}).get(f.name, f.metadata["help"])
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=SAMPLING_FIELD_TYPES[f.name],
            default=None,
            help=help_text,
        )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate at most")
    add_sampling_flags(parser)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name, None) for name in SAMPLING_FIELDS}


def run_generate(args: argparse.Namespace) -> int:
    """`onestream generate --server ADDR [--session ID] PROMPT`: one turn through the pool; the text to
    stdout as it streams and a line of usage to stderr (or, with --json, one JSON object). Reads the
    arguments of onestream/commands/generate.py. Returns the exit status."""
    from google.protobuf.json_format import MessageToDict

    prompt = getattr(args, "prompt", None)
    if isinstance(prompt, list):
        prompt = " ".join(prompt)
    if not prompt:
        prompt = sys.stdin.read()
    as_json = bool(getattr(args, "json", False))
    request = make_request(
        [{"role": "user", "content": prompt}] if getattr(args, "chat", False) else prompt,
        session_id=getattr(args, "session", None) or "",
        max_tokens=getattr(args, "max_tokens", None),
        stop=getattr(args, "stop", None) or (),
        request_id=uuid.uuid4().hex,
        ignore_eos=bool(getattr(args, "ignore_eos", False)),
        **sampling_from_args(args),
    )
    text: list[str] = []
    token_ids: list[int] = []
    finished = None
    with client_from_args(args) as client:
        try:
            for event in client.generate(request):
                kind = event.WhichOneof("event")
                if kind == "chunk":
                    token_ids.extend(event.chunk.token_ids)
                    text.append(event.chunk.text)
                    if not as_json:
                        sys.stdout.write(event.chunk.text)
                        sys.stdout.flush()
                elif kind == "queued" and not as_json:
                    print(f"[queued: position {event.queued.position}]", file=sys.stderr, flush=True)
                elif kind == "finished":
                    finished = event.finished
        except grpc.RpcError as e:
            print(f"\nonestream generate: {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if finished is None:
        print("onestream generate: the stream ended without a final message", file=sys.stderr)
        return 1
    if as_json:
        record = {
            "text": "".join(text),
            "token_ids": token_ids,
            "request_id": request.request_id,
            **MessageToDict(finished, preserving_proto_field_name=True),
        }
        print(json.dumps(record, indent=2))
    else:
        print()
        print(describe_finished(finished), file=sys.stderr)
    return 0
