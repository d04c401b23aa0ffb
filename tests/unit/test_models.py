"""The bad-input table: every rule names its field, and the value."""

from __future__ import annotations

from typing import Any

import pytest

from corral.api.models import CommitRequest, CreateSandbox, ExecRequest, check_path, validated
from corral.errors import InvalidArgument

GOOD_SANDBOX = {"image": "debian-python:bookworm"}


@pytest.mark.parametrize(
    ("change", "field", "rule_part"),
    [
        ({"kind": "teleporter"}, "kind", "must be one of"),
        ({"image": "../etc"}, "image", "layer reference"),
        ({"image": ""}, "image", "layer reference"),
        ({"workspace": "UPPER:case!"}, "workspace", "layer reference"),
        ({"toolkit": ["ok:1", "bad ref"]}, "toolkit", "layer reference"),
        ({"toolkit": ["t:1"] * 17}, "toolkit", "at most 16"),
        ({"cpu": 0}, "cpu", "between 0.01 and 256"),
        ({"cpu": "lots"}, "cpu", "valid number"),
        ({"memory": "lots"}, "memory", "size like"),
        ({"memory": "1KiB"}, "memory", "between 16MiB and 4TiB"),
        ({"memory": -1}, "memory", "negative"),
        ({"disk": "99TiB"}, "disk", "between 16MiB and 4TiB"),
        ({"pids": 2}, "pids", "between 8 and"),
        ({"ttl": -5}, "ttl", "above 0"),
        ({"ttl": 10**9}, "ttl", "30 days"),
        ({"idle_timeout": 0}, "idle_timeout", "above 0"),
        ({"env": {"1BAD": "x"}}, "env", "must match"),
        ({"env": {"A": "b\x00c"}}, "env", "NUL"),
        ({"labels": {"bad key!": "x"}}, "labels", "must match"),
        ({"labels": {"k": "v" * 300}}, "labels", "256"),
        ({"nonsense": 1}, "nonsense", "not a known field"),
        ({"idempotency_key": "has space"}, "idempotency_key", "1-128 characters"),
        ({"labels": {"corral.pool": "fncall"}}, "labels", "node's own workers"),
        ({"idempotency_key": "k" * 129}, "idempotency_key", "1-128 characters"),
        ({"cpu_class": "realtime"}, "cpu_class", "'interactive'"),
        ({"cpu_class": ""}, "cpu_class", "'background'"),
        ({"cpu_class": None}, "cpu_class", "valid string"),
        ({"kind": "fullvm", "image": "disk:"}, "image", "1-64 letters"),
        ({"kind": "fullvm", "image": "disk:a/b"}, "image", "1-64 letters"),
        ({"kind": "fullvm", "image": "disk:.hidden"}, "image", "1-64 letters"),
        ({"kind": "container", "image": "disk:win11"}, "image", "only as kind 'fullvm'"),
        ({"kind": "microvm", "image": "disk:win11"}, "image", "only as kind 'fullvm'"),
        ({"kind": "fullvm", "image": "disk:w", "firmware": "coreboot"}, "firmware", "bios, uefi"),
        ({"kind": "fullvm", "firmware": "uefi"}, "firmware", "user's own disk"),
        ({"kind": "fullvm", "image": "disk:w", "workspace": "ws:1"}, "workspace", "own disk"),
        ({"kind": "fullvm", "image": "disk:w", "toolkit": ["t:1"]}, "toolkit", "own disk"),
    ],
)
def test_create_sandbox_rejects(change: dict[str, Any], field: str, rule_part: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        validated(CreateSandbox, {**GOOD_SANDBOX, **change})
    assert exc.value.field.startswith(field)
    assert rule_part in exc.value.rule
    assert exc.value.field in str(exc.value)


def test_an_own_disk_is_a_full_vm_with_bios_unless_asked() -> None:
    spec = validated(CreateSandbox, {"kind": "fullvm", "image": "disk:win11.qcow2"})
    assert spec.firmware is None and spec.display_size == (1024, 768)
    uefi = validated(CreateSandbox, {"kind": "fullvm", "image": "disk:w", "firmware": "uefi"})
    assert uefi.firmware == "uefi"


def test_create_sandbox_defaults_and_sizes() -> None:
    spec = validated(CreateSandbox, {**GOOD_SANDBOX, "memory": "512MiB", "toolkit": "pytest:8"})
    assert spec.memory == 512 * 2**20
    assert spec.disk == 2 * 2**30
    assert spec.toolkit == ["pytest:8"]
    assert spec.ttl == 3600 and spec.idle_timeout == 600


@pytest.mark.parametrize(
    ("change", "field", "rule_part"),
    [
        ({"cmd": ""}, "cmd", "non-empty"),
        ({"cmd": []}, "cmd", "non-empty"),
        ({"cmd": "echo \x00"}, "cmd", "NUL"),
        ({"cmd": "x" * (2 * 2**20)}, "cmd", "1 MiB"),
        ({"timeout": -1}, "timeout", "above 0"),
        ({"timeout": 0}, "timeout", "above 0"),
        ({"timeout": 10**6}, "timeout", "86400"),
        ({"cwd": "relative/dir"}, "cwd", "absolute path"),
        ({"cwd": "/a/../../etc"}, "cwd", "without '..'"),
        ({"user": "root; rm -rf /"}, "user", "user name"),
        ({"stdout_limit": -1}, "stdout_limit", "between 0"),
        ({"stdin": b"x" * (65 * 2**20)}, "stdin", "64 MiB"),
        ({"env": {"A=B": "1"}}, "env", "must match"),
        ({"cpu_class": "urgent"}, "cpu_class", "'interactive'"),
        ({"cpu_class": 3}, "cpu_class", "valid string"),
    ],
)
def test_exec_request_rejects(change: dict[str, Any], field: str, rule_part: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        validated(ExecRequest, {"cmd": "true", **change})
    assert exc.value.field == field
    assert rule_part in exc.value.rule


@pytest.mark.parametrize(
    "bad",
    ["../../etc/passwd", "etc/passwd", "", "/a/../../b", "/x\x00y", 7, None, "/" + "a" * 5000],
)
def test_paths_outside_the_sandbox_are_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_path(bad)
    assert exc.value.field == "path"
    assert "absolute path" in exc.value.rule


@pytest.mark.parametrize(
    ("path", "normal"), [("/a//b/./c", "/a/b/c"), ("/", "/"), ("/workspace/", "/workspace")]
)
def test_paths_are_normalised(path: str, normal: str) -> None:
    assert check_path(path) == normal


@pytest.mark.parametrize(
    ("labels", "rule_part"),
    [
        ({"corral.source": "pip:pytest"}, "must not start with 'corral.'"),  # the build cache's key
        ({"bad key!": "x"}, "must match"),
        ({"k": "x" * 4097}, "at most 4096"),
        ({f"k{i}": "x" for i in range(17)}, "at most 16"),
    ],
)
def test_commit_labels_are_checked(labels: dict[str, str], rule_part: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validated(CommitRequest, {"tag": "snap:1", "labels": labels})
    assert e.value.field.startswith("labels") and rule_part in e.value.message
