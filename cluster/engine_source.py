"""Where a card's engine comes from: a picklable spec that the card actor resolves into an `Engine`.

A card used to know one way to build its engine, from a checkpoint path. Benchmarks of the pool need others
(a random model of the 27B shapes drawn on the GPU, as `onestream bench decode` times the megakernel on), so
the card now asks its `CardSettings.engine_source` to build the engine, and each way is one class here:

- `CheckpointSource(model_dir)`: a checkpoint in any format (worker/checkpoints/), what `onestream serve` runs;
- `RandomModelSource(shape, layers, weights, seed, mtp)`: a random model drawn on the card's device
  (kernels/random_model.py, kernels/random_quant.py), lent the embedded checkpoint's tokenizer;
- `StampedSource(inner, stamps_dir)`: another source's engine whose every yielded item is stamped with the
  host clock and written to `stamps_dir` per request (tools/gpu/pool_overhead.py: where the pool's time goes).

Every source is a frozen dataclass: it travels to the actor inside `CardSettings` (pickled), and two routers'
settings compare equal when they build the same engine (a router adopts only cards running its settings).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from onestream.worker.api import Finished, GenerateRequest, TokenChunk
    from onestream.worker.config import ModelConfig
    from onestream.worker.engine import Engine

BACKEND_CHOICES = ("auto", "reference", "megakernel")
RANDOM_SHAPES = ("27b", "tiny")  # the 27B text shapes (kernels/random_model.config_27b); the test model's
RANDOM_WEIGHTS_DEFAULT = "bf16"
RANDOM_SEED_DEFAULT = 7  # the seed `onestream bench decode` draws its models with


@runtime_checkable
class EngineSource(Protocol):
    """Builds the engine of one card (or of a tool that measures the engine as a card runs it)."""

    @property
    def label(self) -> str:
        """The model's name in listings and metric labels."""
        ...

    def build(
        self,
        *,
        device: str,
        backend: str = "auto",
        dtype: str | None = None,
        options: dict[str, Any] | None = None,
        on_load_progress: Callable[[Any], None] | None = None,
    ) -> Engine:
        """The engine on `device` ("cuda" or "cpu") with `backend` (auto, reference, megakernel), the model
        in `dtype` where the source can choose it, and the Engine's keyword `options` (spec_k, ...)."""
        ...

    def model_info(self, engine: Any) -> dict[str, Any]:
        """What the card reports as its model (`Engine.model_info` with this source's names)."""
        ...


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint in any format: what a card loads when it is given a path."""

    model_dir: str

    @property
    def label(self) -> str:
        return Path(self.model_dir).name

    def build(
        self,
        *,
        device: str,
        backend: str = "auto",
        dtype: str | None = None,
        options: dict[str, Any] | None = None,
        on_load_progress: Callable[[Any], None] | None = None,
    ) -> Engine:
        from onestream.worker.engine import Engine

        options = dict(options or {})
        if dtype:
            options["dtype"] = dtype  # the engine parses "bf16", "fp32", ...
        return Engine(
            self.model_dir, backend=backend, device=device, on_load_progress=on_load_progress, **options
        )

    def model_info(self, engine: Any) -> dict[str, Any]:
        return _info_dict(engine.model_info())


@dataclass(frozen=True)
class RandomModelSource:
    """A random model drawn on the card's device: the 27B text shapes with `layers` layers (`shape="27b"`,
    what `onestream bench decode` measures) or the tests' tiny model (`shape="tiny"`), its GEMV weights in
    `weights` (bf16 as drawn, or random GGUF blocks typed by a quantization preset: q4_k_m, q8_0, ...), with an
    MTP head when `mtp`. The same fields and seed draw the same weights, in the pool and in process.

    The embedded checkpoint lends the tokenizer: prompts are token ids (ids past its vocabulary decode to no
    text), the throughput does not depend on what the tokens say."""

    shape: str = "27b"
    layers: int | None = None  # None: the shape's own depth (64 for 27b, 4 for tiny)
    weights: str = RANDOM_WEIGHTS_DEFAULT
    seed: int = RANDOM_SEED_DEFAULT
    mtp: bool = False

    def __post_init__(self) -> None:
        if self.shape not in RANDOM_SHAPES:
            raise ValueError(f"random model shape must be one of {RANDOM_SHAPES}, got {self.shape!r}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"a random model needs at least one layer, got {self.layers}")

    @property
    def label(self) -> str:
        return f"random-{self.shape}-{self.config().num_hidden_layers}L-{self.weights}{'-mtp' if self.mtp else ''}"

    def config(self) -> ModelConfig:
        if self.shape == "27b":
            from onestream.kernels.random_model import config_27b

            return config_27b(64 if self.layers is None else self.layers, mtp=self.mtp)
        from onestream.worker.testing import tiny_config

        # ModelConfig's default layer types: every 4th layer full attention, as the 27B shapes.
        layers = 4 if self.layers is None else self.layers
        return tiny_config(num_hidden_layers=layers, mtp_num_hidden_layers=1 if self.mtp else 0)

    def build(
        self,
        *,
        device: str,
        backend: str = "auto",
        dtype: str | None = None,
        options: dict[str, Any] | None = None,
        on_load_progress: Callable[[Any], None] | None = None,
    ) -> Engine:
        """`dtype`: the model is drawn in bf16 (the megakernel's weights); "fp32" casts it after (the CPU's
        reference runs fp32 faster). `on_load_progress` hears nothing: drawing takes seconds, not a load."""
        import torch
        from onestream.kernels.random_model import random_model
        from onestream.worker.engine import Engine, draft_source, parse_dtype

        if backend not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
        model = random_model(self.config(), seed=self.seed, device=device)
        if self.weights != RANDOM_WEIGHTS_DEFAULT:
            from onestream.kernels.random_quant import preset_types, quantize_randomly

            quantize_randomly(model, preset_types(model, self.weights), seed=self.seed + 1)
        wanted = parse_dtype(dtype)
        if wanted is not None and wanted != torch.bfloat16:
            model = model.to(wanted)
        options = dict(options or {})
        drafts = draft_source(**{k: options[k] for k in ("drafting", "spec_k", "lookup_k") if k in options})
        engine_backend = _random_backend(model, backend, torch.device(device), drafts)
        # Engine(None): the embedded checkpoint's tokenizer, EOS ids and generation defaults.
        return Engine(None, backend=engine_backend, **options)

    def model_info(self, engine: Any) -> dict[str, Any]:
        info = _info_dict(engine.model_info())
        # The engine names the checkpoint that lent the tokenizer; the weights are this source's.
        return info | {"model_name": self.label, "model_dir": "", "format": f"random {self.weights}"}


def _random_backend(model: Any, backend: str, device: Any, drafts: str | None) -> Any:
    """The back end of a random model: the megakernel on a GPU unless the reference is asked for, its build as a
    card's for an engine drafting from `drafts` (create_backend's). No quiet fall-back to the reference under
    `auto`: a benchmark must time what it names."""
    from onestream.worker.backend import ReferenceBackend, megakernel_tuning

    if backend == "reference" or device.type != "cuda":
        if backend == "megakernel":
            raise ValueError(f"backend 'megakernel' runs on a CUDA device, not {device}")
        return ReferenceBackend(model, prefill="reference" if backend == "reference" else "auto")
    from onestream.kernels.backend import MegakernelBackend

    return MegakernelBackend(model, tuning=megakernel_tuning(model, drafts))


@dataclass(frozen=True)
class StampedSource:
    """`inner`'s engine, with the host clock (`time.perf_counter`: CLOCK_MONOTONIC, one clock for every
    process of a machine) read as each item leaves `Engine.generate`: the first hop of a token's way to the
    client. At the request's end the stamps go to `stamps_dir/<request_id>.json` as {"request_id",
    "start", "items": [[seconds, kind, tokens], ...]} (kind: chunk or finished)."""

    inner: EngineSource
    stamps_dir: str

    @property
    def label(self) -> str:
        return self.inner.label

    def build(
        self,
        *,
        device: str,
        backend: str = "auto",
        dtype: str | None = None,
        options: dict[str, Any] | None = None,
        on_load_progress: Callable[[Any], None] | None = None,
    ) -> Engine:
        engine = self.inner.build(
            device=device, backend=backend, dtype=dtype, options=options, on_load_progress=on_load_progress
        )
        return StampedEngine(engine, Path(self.stamps_dir))  # type: ignore[return-value]

    def model_info(self, engine: Any) -> dict[str, Any]:
        return self.inner.model_info(engine.engine if isinstance(engine, StampedEngine) else engine)


class StampedEngine:
    """An engine whose `generate` stamps its items (StampedSource); everything else is the engine's."""

    def __init__(self, engine: Any, stamps_dir: Path) -> None:
        self.engine = engine
        self.stamps_dir = stamps_dir
        stamps_dir.mkdir(parents=True, exist_ok=True)

    def __getattr__(self, name: str) -> Any:  # only for what this class does not define
        return getattr(self.engine, name)

    def generate(self, request: GenerateRequest) -> Iterator[TokenChunk | Finished]:
        start = time.perf_counter()
        stream = self.engine.generate(request)  # validates now, as the engine's own generate does
        return self._stamped(request, start, stream)

    def _stamped(
        self, request: GenerateRequest, start: float, stream: Iterator[TokenChunk | Finished]
    ) -> Iterator[TokenChunk | Finished]:
        items: list[list[Any]] = []
        try:
            for item in stream:
                tokens = getattr(item, "token_ids", None)
                items.append(
                    [time.perf_counter(), "chunk" if tokens is not None else "finished", len(tokens or ())]
                )
                yield item
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            self._write(request, start, items)

    def _write(self, request: GenerateRequest, start: float, items: list[list[Any]]) -> None:
        name = request.request_id or f"anonymous-{os.getpid()}-{start:.6f}"
        path = self.stamps_dir / f"{name}.json"
        record = {"request_id": request.request_id, "start": start, "items": items}
        tmp = path.with_suffix(".tmp")  # whole files only: the reader polls for them
        tmp.write_text(json.dumps(record))
        tmp.replace(path)


def _info_dict(info: Any) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    if is_dataclass(info) and not isinstance(info, type):
        return asdict(info)
    return dict(info) if isinstance(info, dict) else {"info": info}


def source_for(model_dir: str, source: EngineSource | None) -> EngineSource:
    """The source a card builds from: `source` when given, else the checkpoint at `model_dir`."""
    return source if source is not None else CheckpointSource(model_dir)


__all__ = [
    "CheckpointSource",
    "EngineSource",
    "RandomModelSource",
    "StampedEngine",
    "StampedSource",
    "source_for",
]
