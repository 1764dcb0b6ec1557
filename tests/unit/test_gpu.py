"""GpuProbe against a fake NVML: readings, the explicit "no GPU" state, failed reads counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.gpu import GpuProbe


@dataclass
class _Util:
    gpu: int


@dataclass
class _Mem:
    used: int
    total: int


class FakeNVML:
    """The few pynvml functions the probe uses; devices as (name, util %, used, total)."""

    def __init__(self, devices: list[tuple[Any, int, int, int]], init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.fail_reads: Exception | None = None
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        if self.fail_reads is not None:
            raise self.fail_reads
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> Any:  # noqa: N802
        return self.devices[handle][0]

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> _Util:  # noqa: N802
        return _Util(self.devices[handle][1])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Mem:  # noqa: N802
        _, _, used, total = self.devices[handle]
        return _Mem(used, total)


def test_two_devices_report_the_busiest_and_the_fullest() -> None:
    nvml = FakeNVML([("H200", 40, 30, 100), (b"A100", 90, 10, 100)])
    reading = GpuProbe(nvml).read()
    assert reading.available and reading.reason is None and reading.device_count == 2
    assert (reading.util_ratio, reading.mem_ratio) == (0.9, 0.3)
    assert [d.name for d in reading.devices] == ["H200", "A100"]  # bytes names decoded


def test_no_driver_is_an_explicit_state_and_init_is_not_retried() -> None:
    nvml = FakeNVML([], init_error=RuntimeError("NVML Shared Library Not Found"))
    probe = GpuProbe(nvml)
    for _ in range(3):
        reading = probe.read()
        assert not reading.available
        assert reading.reason == "no NVIDIA driver (RuntimeError: NVML Shared Library Not Found)"
        assert (reading.util_ratio, reading.mem_ratio, reading.devices) == (0.0, 0.0, ())
    assert nvml.init_calls == 1 and probe.read_errors == 0


def test_zero_devices_is_unavailable() -> None:
    assert GpuProbe(FakeNVML([])).read().reason == "no NVIDIA GPU found"


def test_failed_read_is_counted_and_reported_never_raised() -> None:
    nvml = FakeNVML([("H200", 50, 1, 2)])
    probe = GpuProbe(nvml)
    assert probe.read().available
    nvml.fail_reads = OSError("GPU is lost")
    reading = probe.read()
    assert not reading.available and reading.reason == "NVML read failed: OSError: GPU is lost"
    assert reading.failed  # a failed read, not a machine without a GPU: the signal goes stale
    assert probe.read_errors == 1
    nvml.fail_reads = None
    assert probe.read().available and probe.read_errors == 1


def test_utilisation_is_clamped_and_unknown_memory_total_is_zero() -> None:
    reading = GpuProbe(FakeNVML([("x", 130, 5, 0)])).read()
    assert reading.util_ratio == 1.0 and reading.mem_ratio == 0.0


def test_close_shuts_nvml_down_once_and_later_reads_say_so() -> None:
    nvml = FakeNVML([("H200", 10, 1, 2)])
    probe = GpuProbe(nvml)
    probe.read()
    probe.close()
    probe.close()
    assert nvml.shutdown_calls == 1
    assert probe.read().reason == "probe closed"


class _FunctionNotFound(Exception):
    """pynvml's ``NVMLError_FunctionNotFound``: the driver has no such function."""


class FakeNVMLv2(FakeNVML):
    """Also NVML's version-2 memory reading, as a recent driver gives it: version 1's ``used``
    counts the driver's reserved memory, version 2's does not (616 MiB on an H200, measured)."""

    nvmlMemory_v2 = 0x2000028  # noqa: N815 - pynvml's name
    NVMLError_FunctionNotFound = _FunctionNotFound  # noqa: N815

    def __init__(self, devices: list[tuple[Any, int, int, int]], reserved: int) -> None:
        super().__init__(devices)
        self.reserved = reserved
        self.v2_error: Exception | None = None
        self.v2_calls = 0

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> _Mem:  # noqa: N802
        _, _, used, total = self.devices[handle]
        if version is None:
            return _Mem(used + self.reserved, total)
        assert version == self.nvmlMemory_v2
        self.v2_calls += 1
        if self.v2_error is not None:
            raise self.v2_error
        return _Mem(used, total)


def test_memory_in_use_leaves_out_what_the_driver_reserves_where_nvml_can_tell() -> None:
    nvml = FakeNVMLv2([("H200", 10, 8 * 2**30, 140 * 2**30)], reserved=616 * 2**20)
    reading = GpuProbe(nvml).read()
    assert reading.devices[0].mem_used_bytes == 8 * 2**30  # as nvidia-smi shows it
    assert reading.mem_ratio == 8 / 140


def test_a_driver_without_the_second_memory_reading_is_read_with_the_first_and_asked_once() -> None:
    nvml = FakeNVMLv2([("T4", 10, 1000, 4000)], reserved=200)
    nvml.v2_error = _FunctionNotFound()
    probe = GpuProbe(nvml)
    for _ in range(3):
        reading = probe.read()
        assert reading.available and reading.devices[0].mem_used_bytes == 1200  # version 1's used
    assert nvml.v2_calls == 1 and probe.read_errors == 0


def test_any_other_error_of_the_memory_reading_is_a_failed_read_not_a_fallback() -> None:
    nvml = FakeNVMLv2([("H200", 10, 1000, 4000)], reserved=200)
    nvml.v2_error = OSError("GPU is lost")
    probe = GpuProbe(nvml)
    reading = probe.read()
    assert not reading.available and reading.failed and probe.read_errors == 1
    nvml.v2_error = None
    assert probe.read().devices[0].mem_used_bytes == 1000  # version 2 still asked for
