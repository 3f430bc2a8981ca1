"""A machine's GPUs: read from NVML, or declared with `--gpus` on machines without one (tests, laptops).

The one module that imports `pynvml` (package nvidia-ml-py); NVML's errors become `GpusUnavailable` here.
"""

from __future__ import annotations

import logging
import re
from typing import Protocol

import pynvml

from workflows.domain.nodes import GpuInfo

log = logging.getLogger(__name__)

_GIB = 1024**3
_DECLARATION = re.compile(r"(?P<count>\d+)x(?P<model>[A-Za-z0-9][A-Za-z0-9_.]*)(?:-(?P<memory>\d+)GB)?")


class GpusUnavailable(Exception):
    """The machine's GPUs cannot be read (no NVML library, no driver, a GPU that fails to answer)."""


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
    return GpuInfo(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        model=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
    )


def _text(value: str | bytes) -> str:
    """NVML strings: bytes in older nvidia-ml-py releases, str in newer ones."""
    return value.decode() if isinstance(value, bytes) else value
