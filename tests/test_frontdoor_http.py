"""The HTTP front door end to end on CPU, with the official `openai` and `anthropic` SDKs as clients: one
pool (a local Ray instance, 2 CPU cards, the embedded model) serving the OpenAI, Anthropic and Responses
APIs through the router's own gRPC API."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import ray
from onestream.cluster.client import PoolClient
from onestream.cluster.config import PoolConfig
from onestream.cluster.server import PoolThread
from onestream.worker.card import CPU_CARD_RESOURCE
from onestream.worker.loading import default_model_dir

pytestmark = pytest.mark.slow

CARDS = 2
MAX_CONTEXT = 1024
WAIT_S = 180.0
MODEL = "default_model"
WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a Python file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolThread]:
    ray.init(
        address="local",
        num_cpus=CARDS,
        resources={CPU_CARD_RESOURCE: CARDS},
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    config = PoolConfig(
        model_dir=str(default_model_dir()),
        grpc_address="127.0.0.1:0",
        metrics_address="127.0.0.1:0",
        http_address="127.0.0.1:0",
        cpu_cards=CARDS,
        card_torch_threads=1,
        engine_options={"max_context": MAX_CONTEXT},
        home_wait_s=0.5,
        health_interval_s=1.0,
    )
    pool = PoolThread(config)
    try:
        yield pool.start(wait_for_cards=CARDS, ready_timeout_s=WAIT_S)
    finally:
        pool.stop()
        ray.shutdown()


@pytest.fixture(scope="module")
def base_url(pool: PoolThread) -> str:
    return f"http://{pool.http_address}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(pool: PoolThread) -> Iterator[PoolClient]:
    with PoolClient(pool.grpc_address, timeout_s=60.0) as client:
        yield client


def post(
    base_url: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        base_url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


# ---- OpenAI Chat Completions --------------------------------------------------------------------------
def test_chat_completion_answers_with_usage(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]},
        ],
        max_tokens=8,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens <= 8
    assert completion.usage.prompt_tokens > 10
    assert (
        completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    )


def test_streamed_chat_matches_the_whole_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "import os\n"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
