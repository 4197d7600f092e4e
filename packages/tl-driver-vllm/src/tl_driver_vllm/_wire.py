"""Tensors as plain data for vLLM's RPC: ``{"dtype", "shape", "data"}`` with raw bytes.

vLLM's multiprocess executor serialises RPC arguments and results with msgpack, where
tensors do not survive unless insecure serialisation is switched on; bytes always do. In
the in-process executor, tensors pass through unchanged (``pack(..., raw=True)``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["pack", "unpack"]

_DTYPES: dict[str, torch.dtype] = {
    str(dtype): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.bool,
    )
}


def pack(tensor: torch.Tensor, *, raw: bool = False) -> Any:
    """Turn a tensor into something every vLLM executor can send.

    Args:
        tensor: Any tensor, on any device.
        raw: Return the (CPU) tensor itself, for the in-process executor.

    Returns:
        The CPU tensor when ``raw``, else ``{"dtype": str, "shape": list, "data": bytes}``.
    """
    cpu = tensor.detach().to("cpu").contiguous()
    if raw:
        return cpu
    data = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return {"dtype": str(cpu.dtype), "shape": list(cpu.shape), "data": data}


def unpack(packed: Any) -> torch.Tensor:
    """Inverse of ``pack`` (a tensor passes through unchanged).

    Args:
        packed: A tensor or a mapping made by ``pack``.

    Returns:
        A CPU tensor that owns its memory.
    """
    if isinstance(packed, torch.Tensor):
        return packed
    dtype = _DTYPES[packed["dtype"]]
    shape = tuple(int(s) for s in packed["shape"])
    if not packed["data"]:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(packed["data"]), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
