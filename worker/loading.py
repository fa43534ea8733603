"""Building the model of a checkpoint and filling its weights, tensor by tensor, whatever the format.

The model is built with its parameters on the `meta` device (no memory). Each tensor the checkpoint yields
is then given its final storage on the device: a plain tensor is cast into a new parameter, a block-quantized
one replaces its layer with a quantized layer (the bytes stay quantized). No full-precision copy of the whole
model is ever made: peak host memory is the loaded weights plus the largest single stored tensor.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .checkpoints.hf import default_model_dir
from .config import ModelConfig
from .errors import CheckpointError
from .layout import expected_tensor_shapes, listing, parameter_dtype

__all__ = ["default_model_dir", "dequantizes_once", "expected_tensor_shapes", "load_model", "parameter_dtype"]

if TYPE_CHECKING:
    from .checkpoints import Checkpoint, WeightValue
    from .model import Qwen35ForCausalLM
    from .progress import LoadProgress

# A quantized model whose full-precision weights take at most this much dequantizes them once at load.
DEQUANTIZE_ONCE_BYTES = 1 << 30


# ---- building and filling a model --------------------------------------------------------------


def load_model(
    model: str | Path | Checkpoint | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    quantize: str | None = None,
    progress: LoadProgress | None = None,
    dequantize_once: bool | None = None,
) -> Qwen35ForCausalLM:
    """Build the model of a checkpoint (a path in any format, or an opened `Checkpoint`) and load its
    weights: plain tensors cast to `dtype`, quantized ones kept quantized. `quantize` names a preset
    (`q4_k_m`, ...) that quantizes a full-precision checkpoint as it loads, on `device`.

    A Hugging Face checkpoint without any `mtp.*` tensor (as transformers' save_pretrained writes) loads as
    a model without the MTP head; a partial MTP head is an error.

    Quantized layers dequantize their weight at every call (only one layer is ever in full precision), or once
    at load (`dequantize_once`; default: when the whole model in `dtype` takes at most
    DEQUANTIZE_ONCE_BYTES, as the embedded model does: a step then costs what the plain model's does).
    """
    from .checkpoints import Checkpoint, open_checkpoint
    from .model import Qwen35ForCausalLM

    checkpoint = model if isinstance(model, Checkpoint) else open_checkpoint(model, quantize=quantize)
    device = torch.device(device)
    with parameters_on_meta():
        built = Qwen35ForCausalLM(checkpoint.config)
    move_buffers(built, device)
    weights = checkpoint.tensors(device)
    if dequantize_once is None:
        dequantize_once = dequantizes_once(checkpoint.config, dtype)
    fill_parameters(
        built,
        progress.track(weights) if progress is not None else weights,
        dtype=dtype,
        device=device,
        dequantize_once=dequantize_once,
    )
    built.eval()
    return built


def dequantizes_once(config: ModelConfig, dtype: torch.dtype) -> bool:
    """Whether `load_model` keeps a dequantized copy of each quantized weight by default: when the whole model
    in `dtype` takes at most DEQUANTIZE_ONCE_BYTES."""
    numel = sum(math.prod(shape) for shape in expected_tensor_shapes(config).values())
    return numel * torch.empty((), dtype=dtype).element_size() <= DEQUANTIZE_ONCE_BYTES


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on `meta` (no memory, no init); buffers stay real.

    Unlike `with torch.device("meta")`, computed buffers and tensors (rotary frequencies) keep
    their values. Not thread-safe: it patches `nn.Module.register_parameter` while active.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def fill_parameters(
    model: Qwen35ForCausalLM,
    weights: Iterable[tuple[str, WeightValue]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    dequantize_once: bool = False,
) -> None:
    """Give each parameter of a model built on `meta` its value: a new parameter of its load dtype on
    `device`, or, for a quantized weight, a quantized layer in place of the layer that owns it."""
    expected = expected_tensor_shapes(model.config)
    pending = {name for name, param in model.named_parameters() if param.device.type == "meta"}
    if pending != set(expected):
        raise CheckpointError(
            f"the model's parameters do not match the checkpoint layout: "
            f"model only {listing(sorted(pending - set(expected)))}; "
            f"checkpoint only {listing(sorted(set(expected) - pending))}"
        )
    with torch.no_grad():
        for name, value in weights:
            if not isinstance(value, torch.Tensor):  # a QuantizedWeight
                install_quantized(
                    model,
                    name,
                    value,
                    dtype=parameter_dtype(name, dtype),
                    device=device,
                    dequantize_once=dequantize_once,
                )
            else:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                data = torch.empty(value.shape, dtype=parameter_dtype(name, dtype), device=device)
                # a copy even when dtype and device match: `value` may be a view of the file
                data.copy_(value)
                module._parameters[attr] = nn.Parameter(data, requires_grad=False)
            pending.discard(name)
    if pending:
        raise CheckpointError(f"the checkpoint gave no value for {listing(sorted(pending))}")


def install_quantized(
    model: nn.Module,
    name: str,
    weight: WeightValue,
    *,
    dtype: torch.dtype,
    device: torch.device,
    dequantize_once: bool = False,
) -> None:
    """A linear layer's or the embedding's weight stays quantized (`quant.install_quantized_weights` swaps its
    module); any other parameter stored quantized (a norm) is dequantized into a plain parameter."""
    from .layers.quantized import PermutedInputLinear, PermutedInputWeight
    from .quant import install_quantized_weights

    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(weight, PermutedInputWeight):
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PermutedInputLinear(weight, dtype, dequantize_once))
    elif isinstance(module, (nn.Linear, nn.Embedding)) and attr == "weight":
        install_quantized_weights(
            model, {name: weight.to(device)}, dtype=dtype, dequantize_once=dequantize_once
        )
    else:
        param = module._parameters[attr]
        data = weight.dequantize(dtype, device).reshape(param.shape)
        module._parameters[attr] = nn.Parameter(data, requires_grad=False)


def load_weights_into(model: nn.Module, model_dir: str | Path, *, config: ModelConfig | None = None) -> None:
    """Copy a checkpoint's plain tensors into an existing model's parameters (same names), casting each.

    Parameters keep their dtype and device; the model's parameter names must be exactly
    `expected_tensor_shapes(config)`.
    """
    from .checkpoints import open_checkpoint

    checkpoint = open_checkpoint(model_dir)
    config = config or getattr(model, "config", None) or checkpoint.config
    params = dict(model.named_parameters())
    expected = expected_tensor_shapes(config)
    if set(params) != set(expected):
        raise CheckpointError(
            f"the model's parameters do not match the checkpoint layout: "
            f"model only {listing(sorted(set(params) - set(expected)))}; "
            f"checkpoint only {listing(sorted(set(expected) - set(params)))}"
        )
    with torch.no_grad():
        for name, view in checkpoint.tensors():
            params[name].copy_(view)  # type: ignore[arg-type]
