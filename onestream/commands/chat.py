"""`onestream chat`: an interactive chat with the pool; one session, its turns stay on one card.

Type a message and press Enter. Commands: /reset (forget the conversation and close the session),
/stats (toggle per-turn usage lines), /exit. Ctrl-C during a reply stops it.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any, TextIO


def register(subparsers: Any) -> None:
    from onestream.cluster.client import add_connection_arguments, add_sampling_arguments

    p = subparsers.add_parser("chat", help="chat with the pool interactively", description=__doc__)
    add_connection_arguments(p)
    p.add_argument("--session", default=None, help="session id (default: a new random one)")
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--stats", action="store_true", help="print usage and timings after each reply")
    add_sampling_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from onestream.cluster.client import client_from_args

    with client_from_args(args) as client:
        return ChatLoop(client, args, sys.stdin, sys.stdout, sys.stderr).run()


class ChatLoop:
    def __init__(
        self, client: Any, args: argparse.Namespace, stdin: TextIO, out: TextIO, err: TextIO
    ) -> None:
        self.client = client
        self.args = args
        self.stdin, self.out, self.err = stdin, out, err
        self.session_id = args.session or f"chat-{uuid.uuid4().hex[:12]}"
        self.show_stats = bool(args.stats)
        self.messages: list[dict[str, str]] = []
        self._start_conversation()

    def _start_conversation(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def run(self) -> int:
        import grpc

        try:
            info = self.client.model_info()
        except grpc.RpcError as e:
            print(
                f"onestream chat: cannot reach {self.client.address}: {e.code().name}: {e.details()}",
                file=self.err,
            )
            return 1
        print(
            f"[{info.name or 'model'} at {self.client.address}; session {self.session_id}; /exit to quit]",
            file=self.err,
        )
        interactive = self.stdin.isatty()
        while True:
            if interactive:
                self.out.write("you> ")
                self.out.flush()
            line = self.stdin.readline()
            if not line:
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            if text.strip() in ("/exit", "/quit"):
                break
            if text.strip() == "/reset":
                self._reset()
                continue
            if text.strip() == "/stats":
                self.show_stats = not self.show_stats
                continue
            self._turn(text)
        return 0

    def _reset(self) -> None:
        import grpc

        try:
            self.client.close_session(self.session_id)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                print(f"[could not close the session: {e.details()}]", file=self.err)
        self.session_id = f"chat-{uuid.uuid4().hex[:12]}"
        self._start_conversation()
        print(f"[new conversation; session {self.session_id}]", file=self.err)

    def _turn(self, text: str) -> None:
        import grpc

        from onestream.cluster.client import describe_finished, make_request, sampling_from_args, stream_text

        self.messages.append({"role": "user", "content": text})
        request = make_request(
            self.messages,
            session_id=self.session_id,
            max_tokens=self.args.max_tokens,
            stop=self.args.stop,
            **sampling_from_args(self.args),
        )
        call = self.client.generate(request)
        reply = _Collect(self.out)
        try:
            finished = stream_text(call, reply, err=self.err)
        except KeyboardInterrupt:
            call.cancel()
            self.messages.pop()
            print("\n[stopped]", file=self.err)
            return
        except grpc.RpcError as e:
            self.messages.pop()
            print(f"\n[{e.code().name}: {e.details()}]", file=self.err)
            return
        self.out.write("\n")
        self.messages.append({"role": "assistant", "content": reply.text})
        if finished is not None and self.show_stats:
            print(f"[{describe_finished(finished)}]", file=self.err)


class _Collect:
    """Writes through to `out` and keeps what was written (the assistant's reply)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._parts: list[str] = []

    def write(self, text: str) -> int:
        self._parts.append(text)
        return self._out.write(text)

    def flush(self) -> None:
        self._out.flush()

    @property
    def text(self) -> str:
        return "".join(self._parts)
