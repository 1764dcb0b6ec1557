"""GPU utilisation and memory read through NVML, as a signal source that never raises.

``GpuProbe.read()`` returns a ``GpuReading``. On a machine without an NVIDIA GPU (or without
the driver, or without ``pynvml``) every reading says ``available=False`` and why; a read that
fails on a machine that has a GPU is counted in ``read_errors`` and reported the same way, so a
caller on the request path only ever sees a value, never an exception.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceReading", "GpuProbe", "GpuReading"]


@dataclass(frozen=True)
class DeviceReading:
    """One GPU at one instant. ``util_ratio`` is NVML's busy-time percentage over its last
    sample period (about 1/6 s to 1 s depending on the device), divided by 100.
    ``mem_used_bytes`` is what processes hold, as ``nvidia-smi`` shows it: NVML's version-2 memory
    reading, which leaves out what the driver reserves for itself (616 MiB on an H200 with driver
    580, `bench/results/gpu_probe_2026-12-04_h200.json`); version 1's ``used`` counts that too, and
    is read only where the driver or pynvml has no version 2."""

    index: int
    name: str
    util_ratio: float
    mem_used_bytes: int
    mem_total_bytes: int

    @property
    def mem_ratio(self) -> float:
        """Used over total memory, 0-1 (0 when the total is unknown)."""
        return self.mem_used_bytes / self.mem_total_bytes if self.mem_total_bytes else 0.0


@dataclass(frozen=True)
class GpuReading:
    """All GPUs at one instant.

    ``util_ratio`` and ``mem_ratio`` are the maximum over devices (the busiest device is the one
    that saturates first). When ``available`` is false, ``reason`` says why and the numbers are
    zero with no devices.
    """

    available: bool
    reason: str | None
    device_count: int
    util_ratio: float
    mem_ratio: float
    devices: tuple[DeviceReading, ...]

    failed: bool = False  # a read failed where NVML works: the GPU signals are stale, not absent

    @classmethod
    def unavailable(cls, reason: str, failed: bool = False) -> GpuReading:
        """A reading that carries only why no GPU could be read (``failed``: a read error on a
        machine whose NVML initialised, as opposed to a machine without a GPU)."""
        return cls(False, reason, 0, 0.0, 0.0, (), failed)


class GpuProbe:
    """Reads every visible GPU through NVML.

    ``nvml`` is the ``pynvml`` module or anything with the same functions (tests pass a fake);
    by default ``pynvml`` is imported on the first ``read``. NVML is initialised once, on the
    first ``read``; if that fails (no library, no driver) the probe stays unavailable for its
    whole life with that reason and does not retry, since neither appears at runtime. Device
    handles are re-fetched on every read, so a device that disappears mid-run produces a failed
    read, not a stale value. Safe to call from several threads.

    Attributes:
        read_errors: reads that failed after NVML initialised fine.
    """

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self._init_done = False
        self._init_failure: str | None = None
        self._memory_v1_only = False  # the driver said it has no version-2 memory reading
        self._v2_absent: tuple[type[BaseException], ...] = ()  # the errors that say so (`_memory_info`)
        self.read_errors = 0

    def read(self) -> GpuReading:
        """The current reading; never raises."""
        with self._lock:
            nvml = self._initialised_nvml()
            if nvml is None:
                return GpuReading.unavailable(self._init_failure or "NVML not initialised")
            try:
                devices = tuple(self._read_device(nvml, i) for i in range(nvml.nvmlDeviceGetCount()))
            except Exception as err:  # noqa: BLE001 - NVMLError or anything else: degrade
                self.read_errors += 1
                return GpuReading.unavailable(f"NVML read failed: {_describe(err)}", failed=True)
        if not devices:
            return GpuReading.unavailable("no NVIDIA GPU found")
        return GpuReading(
            available=True,
            reason=None,
            device_count=len(devices),
            util_ratio=max(d.util_ratio for d in devices),
            mem_ratio=max(d.mem_ratio for d in devices),
            devices=devices,
        )

    def close(self) -> None:
        """Shut NVML down if this probe initialised it; later reads say it is unavailable."""
        with self._lock:
            if self._init_done and self._init_failure is None and self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:  # noqa: BLE001 - shutting down: nothing left to protect
                    pass
            self._init_done = True
            self._init_failure = "probe closed"

    def _initialised_nvml(self) -> Any | None:
        if not self._init_done:
            self._init_done = True
            if self._nvml is None:
                try:
                    import pynvml
                except ImportError:
                    self._init_failure = "pynvml not installed"
                    return None
                self._nvml = pynvml
            try:
                self._nvml.nvmlInit()
            except Exception as err:  # noqa: BLE001
                self._init_failure = f"no NVIDIA driver ({_describe(err)})"
            self._v2_absent = tuple(
                err for err in (getattr(self._nvml, name, None) for name in (
                    "NVMLError_FunctionNotFound", "NVMLError_NotSupported", "NVMLError_ArgumentVersionMismatch"))
                if isinstance(err, type) and issubclass(err, BaseException)
            )  # fmt: skip
        return None if self._init_failure is not None else self._nvml

    def _read_device(self, nvml: Any, index: int) -> DeviceReading:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):  # older pynvml returns bytes
            name = name.decode(errors="replace")
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        mem = self._memory_info(nvml, handle)
        return DeviceReading(
            index=index,
            name=str(name),
            util_ratio=min(max(float(util.gpu) / 100.0, 0.0), 1.0),
            mem_used_bytes=int(mem.used),
            mem_total_bytes=int(mem.total),
        )

    def _memory_info(self, nvml: Any, handle: Any) -> Any:
        """NVML's version-2 memory reading where it exists, else version 1 (`DeviceReading`).
        A driver without version 2 says so once (function not found, not supported, version
        mismatch); the probe then reads version 1 for the rest of its life. Any other error
        is a failed read, as before."""
        version = getattr(nvml, "nvmlMemory_v2", None)
        if not self._memory_v1_only and version is not None:
            try:
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except self._v2_absent:
                self._memory_v1_only = True
        return nvml.nvmlDeviceGetMemoryInfo(handle)


def _describe(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
