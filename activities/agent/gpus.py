"""A machine's GPUs: read from NVML, or declared with `--gpus` on machines without one (tests, laptops).

The one module that imports `pynvml` (package nvidia-ml-py); NVML's errors become `GpusUnavailable` here, or a
GPU's health. Health: a GPU *faults* on a critical Xid error that means the hardware failed (the machine then takes
no GPU work), and is *at risk* while NVML reports retired pages or remapped rows pending, or after an Xid that
warns of failing memory. Faults and Xid warnings stay until the agent restarts (after the GPU was reset), as
NVIDIA's device plugin does; pending pages and rows are read again at each look.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from workflows.domain.inventory import GpuInfo

log = logging.getLogger(__name__)

_GIB = 1024**3
_DECLARATION = re.compile(r"(?P<count>\d+)x(?P<model>[A-Za-z0-9][A-Za-z0-9_.]*)(?:-(?P<memory>\d+)GB)?")


class GpusUnavailable(Exception):
    """The machine's GPUs cannot be read (no NVML library, no driver, a GPU that fails to answer)."""


# Xid errors that mean the GPU itself failed (NVIDIA's Xid catalog).
FAULT_XIDS = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
# Xid errors after which the GPU works but may fail soon. Others (13, 31, 43, 45, ...) come from the program.
AT_RISK_XIDS = {
    63: "ECC page retirement or row remapping event",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
}


class GpuProbe(Protocol):
    """Reads the GPUs of this machine."""

    def read_gpus(self) -> list[GpuInfo]:
        """Every GPU, by index."""
        ...


class NvmlProbe:
    """Reads the GPUs from the NVIDIA driver through NVML."""

    def read_gpus(self) -> list[GpuInfo]:
        """Every GPU NVML sees; raises GpusUnavailable when NVML cannot be loaded or answer."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise GpusUnavailable(f"NVML is not available on this machine: {err}") from err
        try:
            return [_read_device(index) for index in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as err:
            raise GpusUnavailable(f"NVML could not read the GPUs: {err}") from err
        finally:
            pynvml.nvmlShutdown()


class GpuWatch(Protocol):
    """Watches the GPUs' health."""

    def poll(self) -> list[GpuInfo]:
        """Every GPU with its health now; never blocks for long."""
        ...

    def close(self) -> None: ...


@dataclass
class _Watched:
    gpu: GpuInfo
    handle: Any
    xid_fault: str | None = None
    xid_risk: str | None = None


class NvmlWatch:
    """Keeps NVML open, registered for critical Xid events of every GPU; `poll` reads what came and the GPUs'
    pending pages and rows. A GPU that cannot report events is still watched for the rest."""

    def __init__(self, gpus: list[GpuInfo]) -> None:
        self._lock = threading.Lock()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise GpusUnavailable(f"NVML is not available on this machine: {err}") from err
        try:
            self._gpus = [_Watched(gpu, pynvml.nvmlDeviceGetHandleByIndex(gpu.index)) for gpu in gpus]
            self._events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            pynvml.nvmlShutdown()
            raise GpusUnavailable(f"NVML cannot watch the GPUs: {err}") from err
        for watched in self._gpus:
            try:
                pynvml.nvmlDeviceRegisterEvents(watched.handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
            except pynvml.NVMLError as err:
                log.warning("GPU %d cannot report Xid errors (%s): its faults go unseen", watched.gpu.index, err)

    def poll(self) -> list[GpuInfo]:
        with self._lock:
            self._read_events()
            return [self._health(watched) for watched in self._gpus]

    def close(self) -> None:
        with self._lock:
            try:
                pynvml.nvmlEventSetFree(self._events)
            finally:
                pynvml.nvmlShutdown()

    def _read_events(self) -> None:
        """Every Xid event waiting in the set; a fault or warning is kept by the GPU it came from."""
        by_index = {watched.gpu.index: watched for watched in self._gpus}
        while True:
            try:
                event = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as err:
                log.warning("reading Xid events failed: %s", err)
                return
            xid = int(event.eventData)
            try:
                watched = by_index[pynvml.nvmlDeviceGetIndex(event.device)]
            except (pynvml.NVMLError, KeyError):
                log.warning("Xid %d from a GPU that cannot be told apart", xid)
                continue
            if xid in FAULT_XIDS:
                watched.xid_fault = watched.xid_fault or f"Xid {xid} ({FAULT_XIDS[xid]})"
            elif xid in AT_RISK_XIDS:
                watched.xid_risk = watched.xid_risk or f"Xid {xid} ({AT_RISK_XIDS[xid]})"
            else:
                log.info("GPU %d: Xid %d, an error of the program that ran on it", watched.gpu.index, xid)

    def _health(self, watched: _Watched) -> GpuInfo:
        try:
            fault, at_risk = _device_health(watched.handle)
        except pynvml.NVMLError as err:  # a GPU that stops answering has failed
            fault, at_risk = str(err), None
        return watched.gpu.model_copy(
            update={"fault": watched.xid_fault or fault, "at_risk": watched.xid_risk or at_risk}
        )


class DeclaredProbe:
    """GPUs declared by hand, e.g. `4xH100-80GB,2xL4-24GB`; "0" or "" declares none."""

    def __init__(self, spec: str, node: str) -> None:
        self._gpus = parse_declaration(spec, node)

    def read_gpus(self) -> list[GpuInfo]:
        """The declared GPUs, numbered in the order declared."""
        return list(self._gpus)


def parse_declaration(spec: str, node: str) -> list[GpuInfo]:
    """Parse comma-separated `COUNTxMODEL[-MEMORYGB]` parts; a part it cannot read raises ValueError."""
    if spec.strip() in ("", "0"):
        return []
    gpus: list[GpuInfo] = []
    for part in spec.split(","):
        match = _DECLARATION.fullmatch(part.strip())
        if match is None:
            raise ValueError(f'--gpus: cannot read "{part.strip()}": expected COUNTxMODEL[-MEMORYGB]')
        memory_bytes = int(match["memory"] or 0) * _GIB
        for _ in range(int(match["count"])):
            index = len(gpus)
            uuid = f"GPU-declared-{node}-{index}"
            gpus.append(GpuInfo(index=index, uuid=uuid, model=match["model"], memory_bytes=memory_bytes))
    return gpus


def read_inventory_gpus(declared: str | None, node: str) -> tuple[list[GpuInfo], str]:
    """The machine's GPUs and where they came from: "declared", "nvml", or "none" when NVML is unavailable."""
    if declared is not None:
        return DeclaredProbe(declared, node).read_gpus(), "declared"
    try:
        return NvmlProbe().read_gpus(), "nvml"
    except GpusUnavailable as err:
        log.warning("%s", err)
        return [], "none"


def _read_device(index: int) -> GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    fault, at_risk = _device_health(handle)
    return GpuInfo(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        model=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        fault=fault,
        at_risk=at_risk,
    )


def _device_health(handle: Any) -> tuple[str | None, str | None]:
    """(fault, at risk) from the pages and rows NVML reports pending; a GPU that cannot tell is healthy.
    GPUs before Ampere retire pages; Ampere and later remap rows instead."""
    fault = at_risk = None
    pages = _unless_not_supported(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    if pages == pynvml.NVML_FEATURE_ENABLED:
        at_risk = "retired pages pending"
    rows = _unless_not_supported(pynvml.nvmlDeviceGetRemappedRows, handle)
    if rows is not None:
        _corrected, _uncorrected, pending, failed = rows
        if failed:
            fault = "row remapping failed"
        elif pending:
            at_risk = at_risk or "row remapping pending"
    return fault, at_risk


def _unless_not_supported(call: Any, handle: Any) -> Any:
    """The call's answer, or None for a GPU (or a driver) that does not support it."""
    try:
        return call(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None


def _text(value: str | bytes) -> str:
    """NVML strings: bytes in older nvidia-ml-py releases, str in newer ones."""
    return value.decode() if isinstance(value, bytes) else value
