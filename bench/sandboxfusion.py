"""SandboxFusion's languages: Corral's `/run_code` next to the same
toolchain run bare, and next to SandboxFusion itself, in one run.

    corral bench sandboxfusion [--quick]

Three runners get the same requests:
  - Corral: `POST /run_code` on a `corral serve` of this checkout (warm
    function-call workers; SandboxFusion's request and response);
  - bare: the same toolchain with no isolation at all. The function
    image's layers (fncall:bookworm and its three toolkits) are composed
    with overlayfs on the host (/work and /tmp on tmpfs, as in a worker),
    and each call is a chroot into it, as root, in a fresh directory,
    running the same compile and run commands from the same language table;
  - SandboxFusion: its own server, installed from its repository into a
    virtual environment (bench/sandboxfusion_peer.sh), with its "lite"
    isolation on (overlayfs, cgroups, network namespace, chroot). It runs
    the host's toolchains, so it serves the languages the host has.

Two programs per language: hello world, and a small judged problem (read
n integers on stdin, print their sum; the answer is checked). Latency is
one call at a time; compile time is reported apart for compiled
languages. Then a mixed-language batch at concurrency 4 for throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx

from _common import IMAGES, fresh_dir, median, pct, serve, table, wait_up, write_result
from corral.config import NodeConfig
from corral.images.mounter import LayerMounts
from corral.images.store import ImageStore
from corral.node.fncall import call as fncall_call
from corral.node.fncall import languages

DATA = Path("/var/lib/corral-sf-bench")
BARE = Path("/var/lib/corral-sf-bare")
PEER = Path(__file__).resolve().parent / "sandboxfusion_peer.sh"
PEER_URL = "http://127.0.0.1:7183"
NUMS = list(range(1, 101))
STDIN = f"{len(NUMS)}\n" + " ".join(map(str, NUMS)) + "\n"
ANSWER = str(sum(NUMS))

# language -> (hello world, judged: read n then n integers, print the sum)
PROGRAMS: dict[str, tuple[str, str]] = {
    "python": ("print(1)", "n = int(input()); print(sum(map(int, input().split()[:n])))"),
    "bash": ("echo 1", "read n; read -a xs; s=0;"
             ' for x in "${xs[@]:0:n}"; do s=$((s+x)); done; echo $s'),
    "cpp": (
        "#include <cstdio>\nint main(){ std::puts(\"1\"); }",
        "#include <iostream>\nint main(){ long n, x, s = 0; std::cin >> n;"
        " while (n-- && std::cin >> x) s += x; std::cout << s << std::endl; }",
    ),
    "nodejs": (
        "console.log(1)",
        "const [n, xs] = require('fs').readFileSync(0, 'utf8').split('\\n');"
        " console.log(xs.split(' ').slice(0, +n).reduce((a, b) => a + +b, 0));",
    ),
    "typescript": (
        "const one: number = 1; console.log(one);",
        "import * as fs from 'fs';\nconst [n, xs] = fs.readFileSync(0, 'utf8').split('\\n');\n"
        "console.log(xs.split(' ').slice(0, +n).reduce((a: number, b: string) => a + +b, 0));",
    ),
    "go": (
        'package main\nimport "fmt"\nfunc main() { fmt.Println(1) }',
        'package main\nimport "fmt"\nfunc main() { var n, x, s int; fmt.Scan(&n);'
        " for i := 0; i < n; i++ { fmt.Scan(&x); s += x }; fmt.Println(s) }",
    ),
    "java": (
        "public class Main { public static void main(String[] a) { System.out.println(1); } }",
        "import java.util.Scanner;\npublic class Main { public static void main(String[] a) {"
        " Scanner in = new Scanner(System.in); int n = in.nextInt(); long s = 0;"
        " for (int i = 0; i < n; i++) s += in.nextInt(); System.out.println(s); } }",
    ),
    "rust": (
        'fn main() { println!("1"); }',
        "use std::io::Read;\nfn main() { let mut t = String::new();"
        " std::io::stdin().read_to_string(&mut t).unwrap(); let mut it = t.split_whitespace()"
        ".map(|x| x.parse::<i64>().unwrap()); let n = it.next().unwrap() as usize;"
        ' println!("{}", it.take(n).sum::<i64>()); }',
    ),
    "php": ("<?php echo 1, PHP_EOL;", "<?php $n = intval(fgets(STDIN)); "
            "echo array_sum(array_slice(explode(' ', trim(fgets(STDIN))), 0, $n)), PHP_EOL;"),
    "ruby": ("puts 1", "n = gets.to_i; puts gets.split.first(n).map(&:to_i).sum"),
    "lua": ("print(1)", "local n = io.read('n'); local s = 0;"
            " for i = 1, n do s = s + io.read('n') end; print(math.floor(s))"),
    "perl": ("print \"1\\n\";", "my $n = <STDIN>; my @x = split ' ', <STDIN>; my $s = 0;"
             " $s += $_ for @x[0..$n-1]; print \"$s\\n\";"),
    "R": ("cat(1, '\\n')", "con <- file('stdin'); l <- readLines(con); close(con);"
          " n <- as.integer(l[1]); cat(sum(as.integer(strsplit(l[2], ' ')[[1]][1:n])), '\\n')"),
    "csharp": (
        "public class Program { public static void Main() { Console.WriteLine(1); } }",
        "public class Program { public static void Main() { int n = int.Parse(Console.ReadLine());"
        " Console.WriteLine(Console.ReadLine().Split(' ').Take(n).Select(long.Parse).Sum()); } }",
    ),
}  # fmt: skip
INTERPRETED = {"python", "bash", "nodejs", "typescript", "php", "ruby", "lua", "perl", "R"}
# What the host has, so what SandboxFusion (which runs the host's toolchains) can serve.
SF_LANGS = {"python", "bash", "cpp", "nodejs"}
LATENCY_HEADER = ["language", "program", "Corral p50 (ms)", "Corral p99 (ms)", "bare p50 (ms)",
                  "bare p99 (ms)", "Corral / bare"]  # fmt: skip
SF_HEADER = ["language", "program", "Corral p50 (ms)", "Corral p99 (ms)", "SandboxFusion p50 (ms)",
             "SandboxFusion p99 (ms)", "SandboxFusion / Corral"]  # fmt: skip
TITLE = "SandboxFusion's languages: Corral, bare, SandboxFusion"


class Bare:
    """The function image's toolchains with no isolation: chroot, as root."""

    def __init__(self, table: dict[str, languages.Language], cfg: NodeConfig) -> None:
        self.table = table
        store = ImageStore(IMAGES)
        self.mounts = LayerMounts(store, fresh_dir(BARE / "layers"))
        refs = [cfg.fncall_image, *cfg.fncall_toolkit]
        lower = [self.mounts.ensure(store.resolve(r)) for r in refs]
        self.root, upper, work = (fresh_dir(BARE / d) for d in ("root", "upper", "work"))
        opts = (
            f"lowerdir={':'.join(str(p) for p in reversed(lower))},upperdir={upper},workdir={work}"
        )
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(self.root)], check=True
        )
        for d in ("proc", "dev"):
            subprocess.run(["mount", "--rbind", f"/{d}", str(self.root / d)], check=True)
        # A call's files and caches in memory, as a worker's /work and /tmp are.
        for d in ("work", "tmp"):
            (self.root / d).mkdir(exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(self.root / d)], check=True)
        self.n = 0

    def _exec(
        self, lang: languages.Language, argv: tuple[str, ...], cwd: str, stdin: str
    ) -> tuple[float, str, int]:
        env = dict(e.partition("=")[::2] for e in (*fncall_call.ENV, *lang.env))
        env["HOME"] = env["TMPDIR"] = cwd
        if "GOCACHE" in env:
            env["GOCACHE"] = f"{cwd}/.gocache"
        t0 = time.perf_counter()
        p = subprocess.run(
            ["chroot", str(self.root), "sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv],
            input=stdin.encode(), capture_output=True, env=env,
        )  # fmt: skip
        return time.perf_counter() - t0, p.stdout.decode(), p.returncode

    def run(self, language: str, code: str, stdin: str) -> tuple[float, float, str]:
        """(compile seconds, total seconds, stdout)."""
        lang = self.table[language]
        self.n += 1
        cwd = f"/work/b{self.n}"
        d = self.root / cwd.lstrip("/")
        d.mkdir(parents=True)
        try:
            if language == "php" and not code.lstrip().startswith("<?php"):
                code = "<?php\n" + code
            (d / lang.source).write_text(code)
            t0 = time.perf_counter()
            compiled = 0.0
            if lang.compile:
                compiled, _, rc = self._exec(lang, lang.compile, cwd, "")
                if rc != 0:
                    raise RuntimeError(f"bare {language}: compile failed")
            _, out, rc = self._exec(lang, lang.run, cwd, stdin)
            return compiled, time.perf_counter() - t0, out
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        subprocess.run(["umount", "-R", str(self.root)], check=False)
        self.mounts.release_unused(list)


async def _post(
    http: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    r = (await http.post(f"{url}/run_code", json=body)).json()
    total = time.perf_counter() - t0
    if r.get("status") != "Success":
        raise RuntimeError(f"{url} {body['language']}: {r}")
    compiled = (r.get("compile_result") or {}).get("execution_time") or 0.0
    return compiled, total, r["run_result"]["stdout"]


async def _bare(bare: Bare, lang: str, code: str, stdin: str) -> tuple[float, float, str]:
    return await asyncio.to_thread(bare.run, lang, code, stdin)


def _peer(cmd: str) -> bool:
    if not PEER.exists():
        return False
    return subprocess.run(["bash", str(PEER), cmd], capture_output=True).returncode == 0


async def main(quick: bool) -> None:
    cfg = NodeConfig.from_env(images=IMAGES)
    table_ = languages.load(languages.SHIPPED)
    reps = 5 if quick else 20
    bare = Bare(table_, cfg)
    os.environ["CORRAL_FNCALL_WARM"] = "4"
    proc, url = serve(DATA)
    have_sf = _peer("start")
    rows: list[list[str]] = []
    compile_rows: list[list[str]] = []
    sf_rows: list[list[str]] = []
    try:
        await wait_up(url)
        async with httpx.AsyncClient(timeout=300) as http:
            for lang, (hello, judged) in PROGRAMS.items():
                for what, code, stdin, want in (
                    ("hello", hello, "", "1"),
                    ("judged", judged, STDIN, ANSWER),
                ):
                    body = {"language": lang, "code": code, "stdin": stdin,
                            "compile_timeout": 60, "run_timeout": 30}  # fmt: skip
                    n = reps if lang not in ("java", "csharp", "rust", "go") else max(3, reps // 2)
                    runners: list[tuple[str, Any]] = [
                        ("corral", lambda b=body: _post(http, url, b)),
                        (
                            "bare",
                            lambda c=code, s=stdin, la=lang: asyncio.to_thread(bare.run, la, c, s),
                        ),
                    ]
                    if have_sf and lang in SF_LANGS:
                        runners.append(("sf", lambda b=body: _post(http, PEER_URL, b)))
                    got: dict[str, tuple[list[float], list[float]]] = {}
                    for _ in range(2):  # warm caches, check the answers
                        for name, fn in runners:
                            _, _, out = await fn()
                            if out.strip() != want:
                                raise RuntimeError(f"{name} {lang} {what}: {out!r}")
                    for _ in range(n):  # alternated, so drift hits all alike
                        for name, fn in runners:
                            c, t, _ = await fn()
                            cs, ts = got.setdefault(name, ([], []))
                            cs.append(c)
                            ts.append(t)
                    co, ba = got["corral"][1], got["bare"][1]
                    rows.append([
                        lang, what, f"{median(co) * 1000:.1f}", f"{pct(co, 99) * 1000:.1f}",
                        f"{median(ba) * 1000:.1f}", f"{pct(ba, 99) * 1000:.1f}",
                        f"{median(co) / median(ba):.2f}",
                    ])  # fmt: skip
                    if table_[lang].compile:
                        compile_rows.append([
                            lang, what, f"{median(got['corral'][0]) * 1000:.0f}",
                            f"{median(got['bare'][0]) * 1000:.0f}",
                        ])  # fmt: skip
                    if "sf" in got:
                        sf = got["sf"][1]
                        sf_rows.append([
                            lang, what, f"{median(co) * 1000:.1f}", f"{pct(co, 99) * 1000:.1f}",
                            f"{median(sf) * 1000:.1f}", f"{pct(sf, 99) * 1000:.1f}",
                            f"{median(sf) / median(co):.1f}",
                        ])  # fmt: skip
                    print(rows[-1], sf_rows[-1] if "sf" in got else "", flush=True)
            tput = await _throughput(http, url, have_sf, 40 if quick else 120)
    finally:
        proc.terminate()
        proc.wait(30)
        if have_sf:
            _peer("stop")
        bare.close()
    sections = [
        "## Latency per language, one call at a time\n\n"
        f"{reps} calls per program and runner (half that for go, java, rust and csharp), "
        "alternated, after two warm-up calls whose answers are checked. Corral over HTTP "
        "(`/run_code`), bare in a chroot of the same layers. Target: within 1.3x of bare for "
        "interpreted languages.\n\n" + table(LATENCY_HEADER, rows),
        "## Compile step apart (p50, ms)\n\n"
        + table(["language", "program", "Corral compile", "bare compile"], compile_rows),
        "## Corral vs SandboxFusion (its own server, lite isolation)\n\n"
        + (
            table(SF_HEADER, sf_rows)
            if sf_rows
            else "SandboxFusion could not be started (bench/sandboxfusion_peer.sh): not measured."
        ),
        "## Throughput: a mixed-language batch\n\n" + tput,
    ]
    path = write_result("sandboxfusion", TITLE, sections)
    print(f"wrote {path}")


async def _throughput(http: httpx.AsyncClient, url: str, have_sf: bool, n: int) -> str:
    """n calls cycling through languages, 4 at a time: calls/s for each server."""

    async def batch(target: str, langs: list[str]) -> float:
        gate = asyncio.Semaphore(4)

        async def one(i: int) -> None:
            lang = langs[i % len(langs)]
            body = {"language": lang, "code": PROGRAMS[lang][1], "stdin": STDIN,
                    "compile_timeout": 60, "run_timeout": 30}  # fmt: skip
            async with gate:
                _, _, out = await _post(http, target, body)
            if out.strip() != ANSWER:
                raise RuntimeError(f"{lang}: {out!r}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t0)

    mixed = ["python", "cpp", "nodejs", "bash", "go", "java", "ruby", "php"]
    common = sorted(SF_LANGS)
    rows = [["Corral", ", ".join(mixed), str(n), f"{await batch(url, mixed):.1f}"]]
    corral_common = await batch(url, common)
    rows.append(["Corral", ", ".join(common), str(n), f"{corral_common:.1f}"])
    if have_sf:
        sf = await batch(PEER_URL, common)
        rows.append(["SandboxFusion", ", ".join(common), str(n), f"{sf:.1f}"])
    return "Concurrency 4 over HTTP, each call the judged program (checked); 2 cores.\n\n" + table(
        ["server", "languages (cycled)", "calls", "calls/s"], rows
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    asyncio.run(main(ap.parse_args().quick))
