"""Tensors between the driver and vLLM's workers: one transport, three carriers.

A run's results are one ``[batch, width, ...]`` tensor per hook (``RunState`` buffers,
logits included). How a worker hands them to the driver depends on where it runs:

- In-process executor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the tensors themselves
  pass through ``collective_rpc`` (``raw``); nothing is copied.
- Workers on this machine in other processes (vLLM's default engine-core process, tensor
  parallelism): a CPU worker captures straight into buffers backed by files in the
  driver's shared-memory folder (``/dev/shm``) and returns only each file's name, dtype
  and shape; the driver maps the files (``SharedFiles.receive``). No copy at all, where
  bytes through vLLM's RPC cost five (tensor to bytes, msgpack encoding, the socket both
  ways, decoding). A value computed elsewhere (a GPU buffer, a rebuilt pattern) is copied
  into a file once.
- Anywhere else (a worker on another host, no writable ``/dev/shm``, shared memory full):
  ``{"dtype", "shape", "data"}`` with raw bytes, which every vLLM executor carries (vLLM's
  msgpack RPC drops tensors unless insecure serialisation is on).

Workers decide per run: they use shared memory only when they can read the probe file the
driver left in its folder (same machine, same mount).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["RESIDENT_KEY", "TAG_KEY", "Outbox", "SharedFiles", "pack", "unpack"]

#: The SamplingParams.extra_args key that tags a request with its run-local id.
TAG_KEY = "tl_request"
#: The ``additional_config`` key that carries a compiled engine's residual-stream layout to
#: its workers (``_worker_side._resident``).
RESIDENT_KEY = "tl_resident_sites"

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
_SHM = "/dev/shm"
_PROBE = "probe"


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
    # bytes are immutable; the tensor handed on must be writable.
    flat = torch.frombuffer(bytearray(packed["data"]), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


# -- worker side --------------------------------------------------------------------------

_files = itertools.count()
#: Folder -> whether this process reads the driver's probe there (same machine).
_visible: dict[str, bool] = {}


def _sees(offer: Mapping[str, str] | None) -> bool:
    if offer is None:
        return False
    folder = offer["dir"]
    if folder not in _visible:
        try:
            with open(os.path.join(folder, _PROBE), encoding="ascii") as handle:
                _visible[folder] = handle.read() == offer["token"]
        except OSError:
            _visible[folder] = False
    return _visible[folder]


class Outbox:
    """Worker side of one run: where its result buffers live and how they are sent.

    Args:
        raw: The driver is in this process: tensors go as they are.
        offer: The driver's shared-memory folder (``SharedFiles.offer``), or ``None``.
    """

    def __init__(self, *, raw: bool, offer: Mapping[str, str] | None) -> None:
        self.raw = raw
        self._folder = offer["dir"] if not raw and offer is not None and _sees(offer) else None
        #: data pointer of each shared-memory buffer made here -> (tensor, file)
        self._made: dict[int, tuple[torch.Tensor, str]] = {}
        self._sent: set[str] = set()

    @property
    def shared(self) -> bool:
        """Whether results go through shared memory (``False`` after it ran out)."""
        return self._folder is not None

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for a result: in shared memory when it will be sent from there.

        Shared memory is used only for CPU buffers (a GPU worker's buffer stays on its
        device and is copied out once, when sent). Its pages are zero; a plain buffer's
        are not initialised.
        """
        if self._folder is not None and device.type == "cpu":
            try:
                return self._shared_tensor(shape, dtype)
            except OSError:
                self._folder = None  # full or gone: this run sends bytes
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def send(self, tensor: torch.Tensor) -> Any:
        """``tensor`` as the driver will receive it (see the module docstring)."""
        if self.raw:
            return pack(tensor, raw=True)
        if not tensor.numel():
            return pack(tensor)
        made = self._made.get(tensor.data_ptr())
        if made is not None and made[0].shape == tensor.shape and tensor.is_contiguous():
            return self._ref(made[1], tensor)
        if self._folder is not None:
            try:
                copy = self._shared_tensor(tensor.shape, tensor.dtype)
            except OSError:
                self._folder = None
            else:
                copy.copy_(tensor.detach())
                return self._ref(self._made[copy.data_ptr()][1], copy)
        return pack(tensor)

    def finish(self) -> None:
        """The run's references go out: the driver owns (and unlinks) their files now;
        the files of buffers that are not sent (internal captures) are removed."""
        self._drop(keep=self._sent)

    def discard(self) -> None:
        """Remove every file made here (the run failed; safe to repeat)."""
        self._drop(keep=set())

    def _drop(self, keep: set[str]) -> None:
        for _, path in self._made.values():
            if path not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._made.clear()
        self._sent.clear()

    def _shared_tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        assert self._folder is not None
        count = int(torch.Size(shape).numel())
        if not count:
            return torch.empty(tuple(shape), dtype=dtype)
        nbytes = dtype.itemsize * count
        path = os.path.join(self._folder, f"{os.getpid()}-{next(_files)}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Reserve (zeroed) pages first: writing past a full tmpfs through a mapping
                # is a SIGBUS, a failed reservation is a clean OSError.
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        tensor = flat.view(dtype).view(tuple(shape))
        self._made[tensor.data_ptr()] = (tensor, path)
        return tensor

    def _ref(self, path: str, tensor: torch.Tensor) -> dict[str, Any]:
        self._sent.add(path)
        return {"dtype": str(tensor.dtype), "shape": list(tensor.shape), "file": path}


# -- driver side --------------------------------------------------------------------------


class SharedFiles:
    """Driver side: a private folder in shared memory where workers leave their results.

    Workers that can read the folder's probe file run on this machine and write there;
    the others send bytes. Files are unlinked as soon as they are mapped, and the folder
    is removed by ``close`` (or when the driver is collected, or at exit).

    Args:
        enabled: ``False`` makes no folder (an in-process engine needs none).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.folder: str | None = None
        self._token = secrets.token_hex(16)
        if enabled and os.path.isdir(_SHM) and os.access(_SHM, os.W_OK):
            try:
                folder = tempfile.mkdtemp(prefix="tl-vllm-", dir=_SHM)
                with open(os.path.join(folder, _PROBE), "w", encoding="ascii") as handle:
                    handle.write(self._token)
                self.folder = folder
            except OSError:
                self.folder = None
        self._cleanup = (
            None
            if self.folder is None
            else weakref.finalize(self, shutil.rmtree, self.folder, True)
        )

    def offer(self) -> dict[str, str] | None:
        """What the workers need to find the folder (``None``: there is none)."""
        return None if self.folder is None else {"dir": self.folder, "token": self._token}

    def receive(self, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The workers' results with every shared-memory reference read as a tensor.

        Each file is mapped privately (copy-on-write: the caller may write into the
        tensor, which never reaches the file) and unlinked here, whatever happens.
        """
        refs = [p for result in results for p in result.get("batched", {}).values() if _is_ref(p)]
        try:
            return [
                {
                    **result,
                    "batched": {
                        n: _read(p) if _is_ref(p) else p
                        for n, p in result.get("batched", {}).items()
                    },
                }
                for result in results
            ]
        finally:
            for ref in refs:
                with contextlib.suppress(OSError):
                    os.unlink(ref["file"])

    def close(self) -> None:
        """Remove the folder and anything left in it (safe to call twice)."""
        self.folder = None
        if self._cleanup is not None:
            self._cleanup()


def _is_ref(packed: Any) -> bool:
    return isinstance(packed, dict) and "file" in packed


def _read(ref: Mapping[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[ref["dtype"]]
    shape = tuple(int(s) for s in ref["shape"])
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    flat = torch.from_file(ref["file"], shared=False, size=nbytes, dtype=torch.uint8)
    return flat.view(dtype).view(shape)
