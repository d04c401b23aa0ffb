"""The `corral` command line, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

from ..framework import IMAGE, Node


def test_run_create_exec_ls_rm(node: Node) -> None:
    out = node.cli("run", "--image", IMAGE, "--", "python3", "-c", "print('hi')")
    assert out.stdout == "hi\n"
    bad = node.cli("run", "--image", IMAGE, "--", "sh", "-c", "exit 4", check=False)
    assert bad.returncode == 4
    info = json.loads(node.cli("--json", "create", "--image", IMAGE, "--label", "cli=1").stdout)
    sid = info["id"]
    assert info["labels"] == {"cli": "1"}
    assert node.cli("exec", sid, "--", "echo $((6*7))").stdout == "42\n"
    listed = json.loads(node.cli("--json", "ls", "--label", "cli=1").stdout)
    assert [s["id"] for s in listed] == [sid]
    node.cli("rm", sid)
    assert json.loads(node.cli("--json", "ls", "--label", "cli=1").stdout) == []


def test_errors_are_clear_and_exit_2(node: Node) -> None:
    out = node.cli("run", "--image", IMAGE, "--memory", "lots", "--", "true", check=False)
    assert out.returncode == 2
    assert "invalid_argument" in out.stderr and "memory" in out.stderr and "lots" in out.stderr
    out = node.cli("--json", "exec", "t-0000000000000000", "--", "true", check=False)
    assert out.returncode == 2
    assert json.loads(out.stderr)["error"]["code"] == "sandbox_not_found"


def test_image_commands(node: Node, tmp_path: Path) -> None:
    (tmp_path / "src" / "opt").mkdir(parents=True)
    (tmp_path / "src" / "opt" / "hello.txt").write_text("layered\n")
    built = json.loads(
        node.cli(
            "--json",
            "image",
            "build",
            "cli-test:1",
            "--from-dir",
            str(tmp_path / "src"),
            "--kind",
            "toolkit",
        ).stdout
    )
    assert built["kind"] == "toolkit" and "cli-test:1" in built["names"]
    names = [
        n for layer in json.loads(node.cli("--json", "image", "ls").stdout) for n in layer["names"]
    ]
    assert "cli-test:1" in names and IMAGE in names
    out = node.cli(
        "run", "--image", IMAGE, "--toolkit", "cli-test:1", "--", "cat", "/opt/hello.txt"
    )
    assert out.stdout == "layered\n"
    node.cli("image", "rm", "cli-test:1")
    missing = node.cli("image", "inspect", "cli-test:1", check=False)
    assert missing.returncode == 2 and "image_not_found" in missing.stderr


def test_doctor(node: Node) -> None:
    checks = json.loads(node.cli("--json", "doctor").stdout)
    assert checks["root"] is True and checks["erofs"] is True and checks["crun"]


def test_image_import_of_a_rootfs_tarball(node: Node, tmp_path: Path) -> None:
    import subprocess as sp

    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    sp.run(["cp", "/bin/busybox", str(root / "bin" / "busybox")], check=True)
    (root / "bin" / "sh").symlink_to("busybox")
    (root / "bin" / "cat").symlink_to("busybox")
    (root / "etc" / "motd").write_text("from a tarball\n")
    tarball = tmp_path / "rootfs.tar"
    sp.run(["tar", "-C", str(root), "-cf", str(tarball), "."], check=True)
    node.cli("image", "import", str(tarball), "tiny-import:1")
    out = node.cli("run", "--image", "tiny-import:1", "--", "/bin/cat", "/etc/motd")
    assert out.stdout == "from a tarball\n"
    node.cli("image", "rm", "tiny-import:1")


def test_image_build_run_push_pull_gc(node: Node, tmp_path: Path) -> None:
    built = json.loads(
        node.cli(
            "--json",
            "image",
            "build",
            "run-built:1",
            "--run",
            IMAGE,
            "--kind",
            "toolkit",
            "--",
            "sh",
            "-c",
            "mkdir -p /opt/x && echo made-by-run > /opt/x/f && rm /etc/issue",
        ).stdout
    )
    assert built["kind"] == "toolkit" and built["names"] == ["run-built:1"]
    out = node.cli(
        "run",
        "--image",
        IMAGE,
        "--toolkit",
        "run-built:1",
        "--",
        "sh",
        "-c",
        "cat /opt/x/f; test -e /etc/issue || echo no-issue",
    )
    assert out.stdout.split() == ["made-by-run", "no-issue"]
    failed = node.cli("image", "build", "never:1", "--run", IMAGE, "--", "false", check=False)
    assert failed.returncode == 2 and "must succeed" in failed.stderr
    store = tmp_path / "shared"
    node.cli("image", "push", "run-built:1", str(store))
    assert (store / "tags" / "run-built" / "1").exists()
    node.cli("image", "rm", "run-built:1")
    pulled = json.loads(node.cli("--json", "image", "pull", "run-built:1", str(store)).stdout)
    assert pulled["digest"] == built["digest"]
    node.cli("image", "rm", "run-built:1")
    gc = json.loads(node.cli("--json", "image", "gc").stdout)
    assert gc["layers_removed"] >= 1


def test_call_runs_code_as_a_function_call(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "sum.c"
    src.write_text(
        '#include <stdio.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}\n'
    )
    feed = tmp_path / "in.txt"
    feed.write_text("20 22")
    out = node.cli("call", "c", str(src), "--stdin", str(feed))
    assert out.stdout == "42\n" and "[ok]" in out.stderr
    bad = node.cli("call", "python", "-", check=False, input="raise SystemExit(5)")
    assert bad.returncode == 5 and "[runtime_error]" in bad.stderr
    doc = json.loads(node.cli("--json", "call", "bash", "-", input="echo hi").stdout)
    assert doc["status"] == "ok" and doc["stdout"] == "hi\n"
    missing = node.cli("call", "python", str(tmp_path / "nope.py"), check=False)
    assert missing.returncode == 2 and "source" in missing.stderr
