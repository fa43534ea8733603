"""A training micro-step (forward, loss, backward) with its heavy regions under torch.compile, falling back
to eager if compiling fails.

Regional compilation: each decoder layer's `forward` and the loss head (logits + cross-entropy) are compiled,
not the whole step. The layers share one code object, so the compiled code is reused across layers (one
compile per layer kind), which keeps compile time to tens of seconds; the loss head is where eager mode
spends the most memory traffic (fp32 logits of every position, four times per step).

Compilation happens on the first forward and backward, so the first micro-step is the one that can fail:
its error is recorded, the gradients it may have left are cleared, the regions are restored to eager and
the step is redone. Later errors propagate; so do out-of-memory errors (the caller shrinks the micro-batch).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

Losses = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]
HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LossFunction = Callable[..., Losses]  # loss_fn(model, *args, head_loss=...)


class CompiledStep:
    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFunction,
        head_loss: HeadLoss,
        *,
        compile: bool,
        autocast: AbstractContextManager | None = None,
        backend: str | Callable = "inductor",
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.eager_head_loss = head_loss
        self.head_loss = head_loss
        self.autocast = autocast or nullcontext()
        self.compiled = compile
        self.proven = False  # a compiled step has run forward and backward
        self.fallback_reason: str | None = None
        self.first_step_seconds: float | None = None
        if compile:
            self.head_loss = torch.compile(head_loss, backend=backend, dynamic=False)
            for layer in self._layers():
                layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False)

    @property
    def mode(self) -> str:
        return "compiled" if self.compiled else "eager"

    def _layers(self) -> list[torch.nn.Module]:
        return list(self.model.model.layers)  # type: ignore[union-attr, arg-type]

    def restore_eager(self) -> None:
        """Back to the eager regions (after training: evaluation runs other shapes and dtypes)."""
        self.head_loss = self.eager_head_loss
        for layer in self._layers():
            if "forward" in vars(layer):
                del layer.forward
        self.compiled = False

    def __call__(self, scale: float, *args: Any) -> Losses:
        """Detached loss terms of `loss_fn(model, *args, head_loss=...)` after `(total * scale).backward()`."""
        if not self.compiled or self.proven:
            return self._run(scale, *args)
        started = time.time()
        try:
            result = self._run(scale, *args)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:  # any compiler failure means "run eagerly"
            self.fallback_reason = " ".join(f"{type(error).__name__}: {error}".split())[:500]
            print(f"torch.compile failed, training eagerly: {self.fallback_reason}", flush=True)
            traceback.print_exc()
            self.model.zero_grad(set_to_none=True)
            self.restore_eager()
            return self._run(scale, *args)
        self.proven = True
        self.first_step_seconds = time.time() - started
        print(f"compiled step 1 in {self.first_step_seconds:.0f}s", flush=True)
        return result

    def _run(self, scale: float, *args: Any) -> Losses:
        with self.autocast:
            total, main, per_depth = self.loss_fn(self.model, *args, head_loss=self.head_loss)
        (total * scale).backward()
        return total.detach(), main.detach(), [c.detach() for c in per_depth]
