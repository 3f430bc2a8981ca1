"""Namespace quotas: which resource waits, in the spec's words, and the history entry that goes with it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.domain.builders import holding
from workflows.domain.scheduling.quotas import Quota, Usage, check_quota, usage_by_namespace

GIB = 2**30


@pytest.mark.parametrize(
    ("quota", "used", "asked", "reason", "reached"),
    [
        pytest.param(
            Quota(namespace="ml", gpus=8),
            Usage(gpus=6),
            Usage(gpus=4),
            "Waits for namespace quota: gpus 6 in use + 4 asked > 8",
            "Quota reached: gpus 6 in use + 4 asked > 8",
            id="gpus in use",
        ),
        pytest.param(
            Quota(namespace="ml", gpus=8),
            Usage(gpus=2),
            Usage(gpus=12),
            "Waits for more than the namespace's quota allows at all (gpus 12 asked > 8): "
            "raise the quota or ask for less",
            "Quota reached: gpus 12 asked > 8",
            id="never enough",
        ),
        pytest.param(
            Quota(namespace="ml", gpus=8, cpu=4),
            Usage(gpus=8, cpu=0.5),
            Usage(gpus=0, cpu=4),
            "Waits for namespace quota: cpu 0.5 in use + 4 asked > 4",
            "Quota reached: cpu 0.5 in use + 4 asked > 4",
            id="a resource not asked for does not wait",
        ),
        pytest.param(
            Quota(namespace="ml", gpus=2, memory_bytes=10),
            Usage(gpus=2),
            Usage(gpus=1, memory_bytes=11),
            "Waits for more than the namespace's quota allows at all (memory_bytes 11 asked > 10): raise the quota or "
            "ask for less",
            "Quota reached: memory_bytes 11 asked > 10",
            id="never enough is said before a wait",
        ),
        # Issue 14: exact integers, never in exponent form; CPU without float noise
        pytest.param(
            Quota(namespace="ml", memory_bytes=20 * GIB),
            Usage(memory_bytes=16 * GIB),
            Usage(memory_bytes=8 * GIB),
            "Waits for namespace quota: memory_bytes 17179869184 in use + 8589934592 asked > 21474836480",
            "Quota reached: memory_bytes 17179869184 in use + 8589934592 asked > 21474836480",
            id="memory in use prints its bytes",
        ),
        pytest.param(
            Quota(namespace="ml", memory_bytes=20 * GIB),
            Usage(),
            Usage(memory_bytes=24 * GIB),
            "Waits for more than the namespace's quota allows at all (memory_bytes 25769803776 asked > 21474836480): "
            "raise the quota or ask for less",
            "Quota reached: memory_bytes 25769803776 asked > 21474836480",
            id="memory never enough prints its bytes",
        ),
        pytest.param(
            Quota(namespace="ml", cpu=0.5),
            Usage(cpu=0.1 + 0.2),
            Usage(cpu=0.3),
            "Waits for namespace quota: cpu 0.3 in use + 0.3 asked > 0.5",
            "Quota reached: cpu 0.3 in use + 0.3 asked > 0.5",
            id="cpu in use has no float noise",
        ),
        pytest.param(
            Quota(namespace="ml", cpu=1000),
            Usage(),
            Usage(cpu=1234.5678),
            "Waits for more than the namespace's quota allows at all (cpu 1234.5678 asked > 1000): "
            "raise the quota or ask for less",
            "Quota reached: cpu 1234.5678 asked > 1000",
            id="cpu keeps its digits",
        ),
        pytest.param(
            Quota(namespace="ml", cpu=2_000_000),
            Usage(cpu=1_999_999.5),
            Usage(cpu=1),
            "Waits for namespace quota: cpu 1999999.5 in use + 1 asked > 2000000",
            "Quota reached: cpu 1999999.5 in use + 1 asked > 2000000",
            id="large cpu is never in exponent form",
        ),
    ],
)
def test_quota_waits(quota: Quota, used: Usage, asked: Usage, reason: str, reached: str) -> None:
    wait = check_quota(quota, used, asked)
    assert wait is not None
    assert (wait.reason.text, wait.reached.text) == (reason, reached)


@pytest.mark.parametrize(
    ("quota", "used", "asked"),
    [
        pytest.param(None, Usage(gpus=100), Usage(gpus=100), id="no quota"),
        pytest.param(Quota(namespace="ml", gpus=8), Usage(gpus=4), Usage(gpus=4), id="exactly the quota"),
        pytest.param(Quota(namespace="ml", gpus=8), Usage(gpus=9), Usage(gpus=0, cpu=1), id="no gpus asked"),
    ],
)
def test_within_quota(quota: Quota | None, used: Usage, asked: Usage) -> None:
    assert check_quota(quota, used, asked) is None


def test_a_gang_waits_for_its_quota_in_its_own_words() -> None:
    wait = check_quota(Quota(namespace="ml", gpus=8), Usage(gpus=6), Usage(gpus=4), gang=True)
    assert wait is not None
    assert wait.reason.text == "Gang waits for namespace quota: gpus 6 in use + 4 asked > 8"


def test_usage_sums_what_each_namespace_holds() -> None:
    held = [
        holding("n0", namespace="a", gpus=2, cpu=1),
        holding("n1", namespace="a", task="x-1", gpus=3),
        holding("n0", namespace="b", gpus=1),
    ]
    assert usage_by_namespace(held) == {"a": Usage(gpus=5, cpu=1), "b": Usage(gpus=1)}


def test_a_quota_refuses_negative_limits_and_bad_names() -> None:
    with pytest.raises(ValidationError):
        Quota(namespace="ml", gpus=-1)
    with pytest.raises(ValidationError):
        Quota(namespace="Not A Name")
