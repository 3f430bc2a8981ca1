"""GPU discovery: `--gpus` declarations, NVML on a machine without it, and NVML on fake GPUs."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from activities.gpus import DeclaredProbe, GpusUnavailable, NvmlProbe, read_inventory_gpus
from workflows.domain.nodes import GpuInfo

GIB = 1024**3


def nvml_loads() -> bool:
    """Whether the NVML library loads here, as pynvml loads it."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


HAS_NVML = nvml_loads()
no_nvml_here = pytest.mark.skipif(HAS_NVML, reason="this machine has an NVML library")
REPO = Path(__file__).resolve().parents[2]

# Just enough of libnvidia-ml.so.1 for NvmlProbe: two H100s; with FAKE_NVML_LOST set, GPU 1 is lost.
FAKE_NVML = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef struct { unsigned long long total, free, used; } memory_t;
static unsigned index_of(void *handle) { return (unsigned)((uintptr_t)handle - 1); }
int nvmlInitWithFlags(unsigned flags) { return 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int result) { return "Unknown Error"; }
int nvmlDeviceGetCount_v2(unsigned *count) { *count = 2; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **handle) { *handle = (void *)(uintptr_t)(i + 1); return 0; }
int nvmlDeviceGetName(void *h, char *name, unsigned n) { snprintf(name, n, "NVIDIA H100 80GB HBM3"); return 0; }
int nvmlDeviceGetUUID(void *h, char *uuid, unsigned n) { snprintf(uuid, n, "GPU-fake-%u", index_of(h)); return 0; }
int nvmlDeviceGetMemoryInfo(void *h, memory_t *memory) {
    if (getenv("FAKE_NVML_LOST") && index_of(h) == 1) return 15; /* NVML_ERROR_GPU_IS_LOST */
    memory->total = 85899345920ULL; memory->free = memory->total; memory->used = 0;
    return 0;
}
"""
READ_GPUS = """
import json
from activities.gpus import GpusUnavailable, NvmlProbe
try:
    print(json.dumps([gpu.model_dump() for gpu in NvmlProbe().read_gpus()]))
except GpusUnavailable as error:
    print(json.dumps(str(error)))
"""


def gpu(index: int, model: str, memory_gb: int, node: str = "n1") -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-declared-{node}-{index}", model=model, memory_bytes=memory_gb * GIB)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param("8xH100-80GB", [gpu(i, "H100", 80) for i in range(8)], id="eight H100s of 80 GB"),
        pytest.param("2xA100-40GB", [gpu(0, "A100", 40), gpu(1, "A100", 40)], id="two A100s of 40 GB"),
        pytest.param("1xT4", [gpu(0, "T4", 0)], id="memory is optional"),
        pytest.param(
            "2xH100-80GB, 1xL4-24GB",
            [gpu(0, "H100", 80), gpu(1, "H100", 80), gpu(2, "L4", 24)],
            id="several kinds are numbered on in the order declared",
        ),
        pytest.param("0", [], id="zero declares no GPUs"),
        pytest.param("", [], id="nothing declares no GPUs"),
    ],
)
def test_declared_gpus_are_read(spec: str, expected: list[GpuInfo]) -> None:
    assert DeclaredProbe(spec, node="n1").read_gpus() == expected


@pytest.mark.parametrize(
    ("spec", "bad_part"),
    [
        pytest.param("8xH100-80XB", "8xH100-80XB", id="a memory that is not in GB"),
        pytest.param("H100", "H100", id="no count"),
        pytest.param("8x", "8x", id="no model"),
        pytest.param("-1xH100", "-1xH100", id="a negative count"),
        pytest.param("4xH100-80GB,,2xL4", "", id="an empty part"),
        pytest.param("4xH100-80GB,2*L4", "2*L4", id="the bad part among good ones"),
    ],
)
def test_a_bad_declaration_names_the_part_it_cannot_read(spec: str, bad_part: str) -> None:
    expected = f'--gpus: cannot read "{bad_part}": expected COUNTxMODEL[-MEMORYGB]'
    with pytest.raises(ValueError) as error:
        DeclaredProbe(spec, node="n1")

    assert str(error.value) == expected


def test_declared_uuids_name_the_machine() -> None:
    uuids = [g.uuid for g in DeclaredProbe("2xL4-24GB", node="gpu-7").read_gpus()]

    assert uuids == ["GPU-declared-gpu-7-0", "GPU-declared-gpu-7-1"]


def test_an_inventory_uses_the_declaration_when_there_is_one() -> None:
    assert read_inventory_gpus("1xT4", "n1") == ([gpu(0, "T4", 0)], "declared")


@no_nvml_here
def test_nvml_is_unavailable_without_its_library() -> None:
    with pytest.raises(GpusUnavailable, match=r"^NVML is not available on this machine: "):
        NvmlProbe().read_gpus()


@no_nvml_here
def test_an_inventory_without_nvml_or_a_declaration_has_no_gpus() -> None:
    assert read_inventory_gpus(None, "n1") == ([], "none")


@pytest.mark.skipif(not HAS_NVML, reason="this machine has no NVML library")
def test_nvml_reads_this_machines_gpus() -> None:
    gpus = NvmlProbe().read_gpus()

    assert [g.index for g in gpus] == list(range(len(gpus)))
    assert all(g.uuid.startswith("GPU-") and g.model and g.memory_bytes > 0 for g in gpus)
    assert read_inventory_gpus(None, "n1") == (gpus, "nvml")


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a fake libnvidia-ml.so.1, built with the C compiler."""
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler to build a fake NVML")
    directory = tmp_path_factory.mktemp("fake-nvml")
    (directory / "nvml.c").write_text(FAKE_NVML)
    library = directory / "libnvidia-ml.so.1"
    build = ["gcc", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(library), "nvml.c"]
    subprocess.run(build, cwd=directory, check=True)
    return directory


def read_gpus_with(fake_nvml: Path, **env: str) -> list[GpuInfo] | str:
    """NvmlProbe's answer in a process that loads the fake NVML (the loader reads its path at start)."""
    environment = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml), "PYTHONPATH": str(REPO), **env}
    done = subprocess.run(
        [sys.executable, "-c", READ_GPUS], env=environment, capture_output=True, text=True, check=True
    )
    answer = json.loads(done.stdout)
    return answer if isinstance(answer, str) else [GpuInfo(**gpu) for gpu in answer]


def test_nvml_reads_each_gpus_index_uuid_model_and_memory(fake_nvml: Path) -> None:
    expected = [
        GpuInfo(index=i, uuid=f"GPU-fake-{i}", model="NVIDIA H100 80GB HBM3", memory_bytes=80 * GIB) for i in range(2)
    ]

    assert read_gpus_with(fake_nvml) == expected


def test_a_gpu_nvml_cannot_read_makes_the_gpus_unavailable(fake_nvml: Path) -> None:
    assert read_gpus_with(fake_nvml, FAKE_NVML_LOST="1") == "NVML could not read the GPUs: GPU is lost"
