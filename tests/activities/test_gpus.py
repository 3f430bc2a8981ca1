"""GPU discovery: `--gpus` declarations, NVML on a machine without it, and NVML on fake GPUs."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from activities.agent.gpus import DeclaredProbe, GpusUnavailable, NvmlProbe, read_inventory_gpus
from workflows.domain.inventory import GpuInfo

GIB = 1024**3


def nvml_loads() -> bool:
    """Whether the NVML library loads here, as pynvml loads it."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


HAS_NVML = nvml_loads()
REPO = Path(__file__).resolve().parents[2]

READ_GPUS = """
import json
from activities.agent.gpus import GpusUnavailable, NvmlProbe
try:
    print(json.dumps([gpu.model_dump() for gpu in NvmlProbe().read_gpus()]))
except GpusUnavailable as error:
    print(json.dumps(str(error)))
"""
# Watch the GPUs: look once, then append the Xid events given as arguments ("INDEX XID") while it watches, and
# look twice more; print the three looks.
WATCH_GPUS = """
import json, os, sys
from activities.agent.gpus import NvmlProbe, NvmlWatch
watch = NvmlWatch(NvmlProbe().read_gpus())
looks = [watch.poll()]
with open(os.environ["FAKE_NVML_XID_FILE"], "a") as events:
    events.writelines(f"{event}\\n" for event in sys.argv[1:])
looks += [watch.poll(), watch.poll()]
watch.close()
print(json.dumps([[gpu.model_dump() for gpu in look] for look in looks]))
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


def test_nvml_reads_this_machines_gpus_or_says_it_is_unavailable() -> None:
    """Never skipped (`make test` allows no skip): without a GPU, as in CI, NVML is unavailable and the inventory has
    none; on a GPU machine NVML reads its GPUs. The fake GPUs below cover NVML's reading on every machine."""
    if not HAS_NVML:
        with pytest.raises(GpusUnavailable, match=r"^NVML is not available on this machine: "):
            NvmlProbe().read_gpus()
        assert read_inventory_gpus(None, "n1") == ([], "none")
        return
    gpus = NvmlProbe().read_gpus()

    assert [g.index for g in gpus] == list(range(len(gpus)))
    assert all(g.uuid.startswith("GPU-") and g.model and g.memory_bytes > 0 for g in gpus)
    assert read_inventory_gpus(None, "n1") == (gpus, "nvml")


def in_process_with_fake_nvml(fake_nvml: Path, script: str, *args: str, **env: str) -> Any:
    """The JSON a script prints in a process that loads the fake NVML (the loader reads its path at start)."""
    environment = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml), "PYTHONPATH": str(REPO), **env}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=environment, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def read_gpus_with(fake_nvml: Path, **env: str) -> list[GpuInfo] | str:
    """NvmlProbe's answer on the fake GPUs."""
    answer = in_process_with_fake_nvml(fake_nvml, READ_GPUS, **env)
    return answer if isinstance(answer, str) else [GpuInfo(**gpu) for gpu in answer]


def health(gpus: list[dict[str, Any]]) -> list[tuple[str | None, str | None]]:
    return [(gpu["fault"], gpu["at_risk"]) for gpu in gpus]


def test_nvml_reads_each_gpus_index_uuid_model_and_memory(fake_nvml: Path) -> None:
    expected = [
        GpuInfo(index=i, uuid=f"GPU-fake-{i}", model="NVIDIA H100 80GB HBM3", memory_bytes=80 * GIB) for i in range(2)
    ]

    assert read_gpus_with(fake_nvml) == expected


def test_a_gpu_nvml_cannot_read_makes_the_gpus_unavailable(fake_nvml: Path) -> None:
    assert read_gpus_with(fake_nvml, FAKE_NVML_LOST="1") == "NVML could not read the GPUs: GPU is lost"


def test_nvml_reads_as_many_gpus_as_there_are_with_their_model_and_memory(fake_nvml: Path) -> None:
    gpus = read_gpus_with(
        fake_nvml, FAKE_NVML_COUNT="8", FAKE_NVML_NAME="NVIDIA A100-SXM4-40GB", FAKE_NVML_MEMORY=str(40 * GIB)
    )

    assert isinstance(gpus, list)
    assert [(g.index, g.uuid) for g in gpus] == [(i, f"GPU-fake-{i}") for i in range(8)]
    assert {(g.model, g.memory_bytes, g.healthy) for g in gpus} == {("NVIDIA A100-SXM4-40GB", 40 * GIB, True)}


def test_a_machine_with_no_gpu_reads_none(fake_nvml: Path) -> None:
    assert read_gpus_with(fake_nvml, FAKE_NVML_COUNT="0") == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({"FAKE_NVML_PAGES_PENDING": "1"}, (None, "retired pages pending"), id="retired pages pending"),
        pytest.param({"FAKE_NVML_ROWS_PENDING": "1"}, (None, "row remapping pending"), id="remapped rows pending"),
        pytest.param({"FAKE_NVML_ROWS_FAILED": "1"}, ("row remapping failed", None), id="row remapping failed"),
        pytest.param(
            {"FAKE_NVML_PAGES_PENDING": "1", "FAKE_NVML_NOT_SUPPORTED": "nvmlDeviceGetRetiredPagesPendingStatus"},
            (None, None),
            id="a GPU that does not support retired pages is taken as healthy",
        ),
        pytest.param(
            {"FAKE_NVML_NOT_SUPPORTED": "nvmlDeviceGetRetiredPagesPendingStatus,nvmlDeviceGetRemappedRows"},
            (None, None),
            id="a GPU that supports neither is taken as healthy",
        ),
    ],
)
def test_a_gpu_with_memory_pages_or_rows_pending_is_at_risk(
    fake_nvml: Path, env: dict[str, str], expected: tuple[str | None, str | None]
) -> None:
    gpus = read_gpus_with(fake_nvml, **env)

    assert isinstance(gpus, list)
    assert [(g.fault, g.at_risk) for g in gpus] == [(None, None), expected]


def test_a_critical_xid_faults_its_gpu_and_the_fault_stays(fake_nvml: Path, tmp_path: Path) -> None:
    events = tmp_path / "xid"
    events.write_text("")
    looks = in_process_with_fake_nvml(
        fake_nvml, WATCH_GPUS, "3 79", "0 13", "2 94", FAKE_NVML_COUNT="4", FAKE_NVML_XID_FILE=str(events)
    )

    healthy = [(None, None)] * 4
    struck = [
        (None, None),  # Xid 13 comes from the program, not the GPU
        (None, None),
        (None, "Xid 94 (contained ECC error)"),
        ("Xid 79 (GPU has fallen off the bus)", None),
    ]
    assert [health(look) for look in looks] == [healthy, struck, struck]


def test_a_gpu_that_cannot_report_xid_events_is_still_watched_for_the_rest(fake_nvml: Path, tmp_path: Path) -> None:
    events = tmp_path / "xid"
    events.write_text("")
    looks = in_process_with_fake_nvml(
        fake_nvml,
        WATCH_GPUS,
        "1 79",
        FAKE_NVML_XID_FILE=str(events),
        FAKE_NVML_NOT_SUPPORTED="nvmlDeviceRegisterEvents",
        FAKE_NVML_PAGES_PENDING="1",
    )

    assert [health(look) for look in looks] == [[(None, None), (None, "retired pages pending")]] * 3


def test_a_gpu_lost_while_watched_is_a_fault(fake_nvml: Path) -> None:
    script = """
import json, os
from activities.agent.gpus import NvmlProbe, NvmlWatch
watch = NvmlWatch(NvmlProbe().read_gpus())
os.environ["FAKE_NVML_LOST"] = "1"
print(json.dumps([gpu.model_dump() for gpu in watch.poll()]))
"""
    assert health(in_process_with_fake_nvml(fake_nvml, script)) == [(None, None), ("GPU is lost", None)]
