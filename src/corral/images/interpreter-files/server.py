"""Corral's code-interpreter server: E2B's code-interpreter HTTP protocol on
port 49999, in front of a Jupyter server on 127.0.0.1:8888.

Runs inside the sandbox, with the image's Python and the tornado that
Jupyter server brings (no other dependency). What a client sees:

  GET    /health                  200 "OK" once the default python context runs
  POST   /execute                 {code, context_id | language, env_vars}:
                                  one JSON object per line (stdout, stderr,
                                  result, error, number_of_executions,
                                  keepalive), then end_of_execution
  POST   /contexts                {language, cwd} -> {id, language, cwd}
  GET    /contexts                every context but the per-language defaults' alias
  DELETE /contexts/{id}
  POST   /contexts/{id}/restart

A context is one Jupyter kernel (its id is the kernel's). Invariants:
executions in one context run one at a time (its lock); per-call env_vars
are set before and restored after the call, so they never outlive it; a
client that goes away mid-execution gets its kernel interrupted (noticed at
the next keepalive write, every KEEPALIVE seconds), so the next call is not
stuck behind the abandoned one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

from tornado import httpclient, httpserver, iostream, web, websocket

JUPYTER = os.environ.get("CORRAL_JUPYTER", "127.0.0.1:8888")
PORT = int(os.environ.get("CORRAL_INTERPRETER_PORT", "49999"))
HOME = "/home/user"
KEEPALIVE = 1.0
DRAIN = 10.0  # seconds an interrupted execution may take to stop
LATE_OUTPUT = 0.05  # quiet that ends a Deno execution after its idle status
MAX_MESSAGE = 512 << 20
# Language as asked -> Jupyter kernel name. TypeScript runs in the same
# (Deno) kernel as JavaScript.
KERNELS = {"python": "python3", "javascript": "javascript", "typescript": "javascript",
           "bash": "bash", "r": "ir", "java": "java"}  # fmt: skip
ALIASES = {"js": "javascript", "ts": "typescript", "py": "python", "python3": "python",
           "sh": "bash"}  # fmt: skip
# Jupyter MIME types -> the client's Result fields; anything else goes under "extra".
MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown",
        "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
        "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
        "application/javascript": "javascript", "e2b/data": "data",
        "e2b/chart": "chart"}  # fmt: skip

log = logging.getLogger("corral.interpreter")
http = httpclient.AsyncHTTPClient()


class Failure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def normalize(language: Any) -> str:
    if language is None or language == "":
        return "python"
    if not isinstance(language, str):
        raise Failure(400, f"language must be a string, got {language!r}")
    name = language.strip().lower()
    name = ALIASES.get(name, name)
    if name not in KERNELS:
        raise Failure(400, f"language {language!r} is not one of {', '.join(sorted(KERNELS))}")
    return name


def _now() -> str:
    return datetime.now(UTC).isoformat()


async def jupyter(method: str, path: str, body: Any = None) -> Any:
    try:
        resp = await http.fetch(
            f"http://{JUPYTER}{path}", method=method, raise_error=False,
            body=None if body is None else json.dumps(body),
            allow_nonstandard_methods=True, request_timeout=120,
        )  # fmt: skip
    except OSError as exc:
        raise Failure(502, f"the Jupyter server does not answer: {exc}") from None
    if resp.code >= 400:
        raise Failure(500, f"Jupyter {method} {path}: {resp.code} {resp.body[:500]!r}")
    return json.loads(resp.body) if resp.body else None


def _env_code(language: str, env: dict[str, str], saved: str) -> tuple[str, str]:
    """Code that sets `env` in the kernel, and code that puts back what was there."""
    doc = json.dumps(env)
    if language == "python":
        return (
            f"import os as __o, json as __j\n{saved} = {{k: __o.environ.get(k) for k in "
            f"__j.loads({doc!r})}}\n__o.environ.update(__j.loads({doc!r}))\ndel __o, __j",
            f"import os as __o\nfor __k, __v in {saved}.items():\n"
            f"    if __v is None: __o.environ.pop(__k, None)\n"
            f"    else: __o.environ[__k] = __v\n"
            f"del __o, {saved}",
        )
    if language in ("javascript", "typescript"):
        keys = json.dumps(list(env))
        return (
            f"globalThis.{saved} = Object.fromEntries({keys}.map((k) => [k, process.env[k]]));"
            f" Object.assign(process.env, {doc});",
            f"for (const [k, v] of Object.entries(globalThis.{saved})) "
            f"{{ if (v === undefined) delete process.env[k]; else process.env[k] = v; }}"
            f" delete globalThis.{saved};",
        )
    if language == "bash":
        lines = [f"declare -A {saved}"]
        sets = []
        restores = []
        for k, v in env.items():
            q = "'" + v.replace("'", "'\\''") + "'"
            lines.append(f'[ -n "${{{k}+x}}" ] && {saved}[{k}]="${k}"')
            sets.append(f"export {k}={q}")
            restores.append(
                f'if [ -n "${{{saved}[{k}]+x}}" ]; then export {k}="${{{saved}[{k}]}}"; '
                f"else unset {k}; fi"
            )
        return "\n".join(lines + sets), "\n".join([*restores, f"unset {saved}"])
    if language == "r":
        # A JSON string is an R string literal too (the same escapes). The
        # saved values live under a dot-name, which ls() (and so
        # rm(list = ls())) leaves alone, and the restore runs in local() so
        # it touches none of the user's names; a saved object gone (the
        # kernel restarted) restores nothing.
        name = json.dumps("." + saved.lstrip("_"))
        keys = "c(" + ", ".join(json.dumps(k) for k in env) + ")"
        sets = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in env.items())
        return (
            f"assign({name}, Sys.getenv({keys}, unset = NA, names = TRUE), envir = globalenv()); "
            f"do.call(Sys.setenv, list({sets}))",
            f"if (exists({name}, envir = globalenv())) local({{ s <- get({name}, envir = "
            f"globalenv()); for (k in names(s)) if (is.na(s[[k]])) Sys.unsetenv(k) else "
            f"do.call(Sys.setenv, setNames(list(s[[k]]), k)); rm(list = {name}, envir = "
            f"globalenv()) }})",
        )
    if language == "java":
        # E2B's Java contexts take env vars as system properties. A JSON
        # string is a Java literal: json.dumps writes a line break as a
        # backslash and n, never as a unicode escape, which Java would turn
        # into a real line break before lexing. Blocks, so no JShell
        # variable is left behind; java.lang names in full, so a user's
        # class System changes nothing; the saved values are a property of
        # their own, so a restarted JVM restores nothing instead of failing.
        key = json.dumps("corral." + saved)
        keys = ", ".join(json.dumps(k) for k in env)
        sets = " ".join(
            f"java.lang.System.setProperty({json.dumps(k)}, {json.dumps(v)});"
            for k, v in env.items()
        )
        return (
            "{ java.util.Map<java.lang.String, java.lang.String> s = new java.util.HashMap<>();"
            f" for (java.lang.String k : new java.lang.String[] {{{keys}}})"
            " s.put(k, java.lang.System.getProperty(k));"
            f" java.lang.System.getProperties().put({key}, s); {sets} }}",
            f"{{ java.lang.Object m = java.lang.System.getProperties().remove({key});"
            " if (m instanceof java.util.Map) for (java.util.Map.Entry<?, ?> e :"
            " ((java.util.Map<?, ?>) m).entrySet()) { if (e.getValue() == null)"
            " java.lang.System.clearProperty((java.lang.String) e.getKey()); else"
            " java.lang.System.setProperty((java.lang.String) e.getKey(),"
            " (java.lang.String) e.getValue()); } }",
        )
    raise Failure(400, f"env_vars are not supported for {language}")


def _cd_code(language: str, cwd: str) -> str:
    if language == "python":
        return f"import os as __o; __o.chdir({cwd!r}); del __o"
    if language in ("javascript", "typescript"):
        return f"Deno.chdir({json.dumps(cwd)});"
    if language == "bash":
        return "cd '" + cwd.replace("'", "'\\''") + "'"
    if language == "r":
        return f"setwd({json.dumps(cwd)})"
    if language == "java":
        # A JVM cannot change its directory; E2B's sets user.dir, as here.
        return f'java.lang.System.setProperty("user.dir", {json.dumps(cwd)});'
    return ""


class Context:
    def __init__(self, kernel: str, session: str, language: str, cwd: str) -> None:
        self.id = kernel
        self.session = session
        self.language = language
        self.cwd = cwd
        self.lock = asyncio.Lock()
        self.waiting: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self.ws: websocket.WebSocketClientConnection | None = None
        self.reader: asyncio.Task[None] | None = None
        # Its kernel's channel closed under it (Jupyter died): it can run
        # nothing more, and /health says so until the supervisor has
        # restarted both servers.
        self.lost = False
        self.closing = False

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def connect(self) -> None:
        url = f"ws://{JUPYTER}/api/kernels/{self.id}/channels?session_id={self.session}"
        self.ws = await websocket.websocket_connect(url, max_message_size=MAX_MESSAGE)
        # Small frames both ways: Nagle would hold each for the peer's
        # delayed ACK (40 ms a call).
        self.ws.protocol.stream.set_nodelay(True)  # type: ignore[union-attr]
        self.lost = self.closing = False
        self.reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        self.closing = True  # a close asked for is no loss
        if self.ws is not None:
            self.ws.close()
        if self.reader is not None:
            self.reader.cancel()
            # Done before a reconnect resets the flags: a late finish of
            # this reader must not mark the new channel lost.
            await asyncio.gather(self.reader, return_exceptions=True)

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            while True:
                raw = await self.ws.read_message()
                if raw is None:
                    break
                if isinstance(raw, bytes):
                    continue
                msg = json.loads(raw)
                q = self.waiting.get((msg.get("parent_header") or {}).get("msg_id", ""))
                if q is not None:
                    q.put_nowait(msg)
        finally:
            self.lost = not self.closing
            for q in self.waiting.values():
                q.put_nowait(None)  # the kernel's channel closed under the call

    async def run(self, code: str, *, silent: bool = False) -> AsyncGenerator[dict[str, Any], None]:
        """The kernel's messages for one execution, until it is idle and has
        replied; and ours, {"corral": "keepalive" | "lost"}."""
        if self.ws is None or self.lost:
            raise Failure(502, f"the kernel of context {self.id} is gone")
        msg_id = uuid.uuid4().hex
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.waiting[msg_id] = queue
        try:
            await self._send(json.dumps({
                "header": {"msg_id": msg_id, "username": "corral", "session": self.session,
                           "msg_type": "execute_request", "version": "5.3", "date": _now()},
                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                "content": {"code": code, "silent": silent, "store_history": not silent,
                            "user_expressions": {}, "allow_stdin": False,
                            "stop_on_error": True},
            }))  # fmt: skip
            idle = replied = False
            while not (idle and replied):
                try:
                    msg = await asyncio.wait_for(queue.get(), KEEPALIVE)
                except TimeoutError:
                    yield {"corral": "keepalive"}
                    continue
                if msg is None:
                    yield {"corral": "lost"}
                    return
                kind = msg["header"]["msg_type"]
                if kind == "status" and msg["content"].get("execution_state") == "idle":
                    idle = True
                elif kind == "execute_reply":
                    replied = True
                yield msg
            if self.language in ("javascript", "typescript"):
                # Deno forwards console output from a pipe of its own: a
                # line can reach iopub after the idle status. Wait for the
                # stream to go quiet before the execution ends.
                while True:
                    try:
                        late = await asyncio.wait_for(queue.get(), LATE_OUTPUT)
                    except TimeoutError:
                        break
                    if late is None:
                        break
                    yield late
        finally:
            self.waiting.pop(msg_id, None)

    async def _send(self, text: str) -> None:
        assert self.ws is not None
        try:
            await self.ws.write_message(text)
        except websocket.WebSocketClosedError:
            self.lost = True
            raise Failure(502, f"the kernel of context {self.id} is gone") from None

    async def quietly(self, code: str) -> None:
        """Run platform code (cd, env): its errors are the server's."""
        async for msg in self.run(code, silent=True):
            kind = msg.get("corral") or msg["header"]["msg_type"]
            if kind == "error" or (
                kind == "execute_reply" and msg["content"].get("status") == "error"
            ):
                raise Failure(500, f"setting up context {self.id}: {msg['content']}")
            if kind == "lost":
                raise Failure(502, f"the kernel of context {self.id} went away")

    async def execute(self, code: str, env: dict[str, str]) -> AsyncGenerator[dict[str, Any], None]:
        """The client's lines for one execution."""
        saved = "__corral_env_" + uuid.uuid4().hex[:8]
        set_env, restore = _env_code(self.language, env, saved) if env else ("", "")
        async with self.lock:
            if set_env:
                await self.quietly(set_env)
            errored = False
            try:
                async for msg in self.run(code):
                    if "corral" in msg:  # ours: keepalive or lost
                        if msg["corral"] == "lost":
                            raise Failure(502, f"the kernel of context {self.id} went away")
                        yield {"type": "keepalive"}
                        continue
                    kind, content = msg["header"]["msg_type"], msg["content"]
                    if kind == "stream":
                        yield {"type": content["name"], "text": content["text"],
                               "timestamp": msg["header"].get("date", _now())}  # fmt: skip
                    elif kind in ("execute_result", "display_data"):
                        yield _result(content.get("data") or {}, kind == "execute_result")
                    elif kind == "error":
                        errored = True
                        yield _error(content)
                    elif kind == "execute_input":
                        yield {"type": "number_of_executions",
                               "execution_count": content.get("execution_count")}  # fmt: skip
                    elif kind == "execute_reply" and not errored and content["status"] == "error":
                        errored = True  # some kernels say it only here
                        yield _error(content)
            finally:
                if restore:
                    await asyncio.shield(self.quietly(restore))

    async def interrupt(self) -> None:
        try:
            await jupyter("POST", f"/api/kernels/{self.id}/interrupt", {})
        except Failure as exc:
            log.warning("interrupt of %s failed: %s", self.id, exc)


def _result(data: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        field = MIME.get(mime)
        if field is None:
            extra[mime] = value
            continue
        quoted = isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] in "'\""
        if field == "text" and quoted:
            value = value[1:-1]  # a string's repr shows as the string
        out[field] = value
    if extra:
        out["extra"] = extra
    return out


def _error(content: dict[str, Any]) -> dict[str, Any]:
    return {"type": "error", "name": content.get("ename", "Error"),
            "value": content.get("evalue", ""),
            "traceback": "\n".join(content.get("traceback") or [])}  # fmt: skip


class Contexts:
    def __init__(self) -> None:
        self.by_id: dict[str, Context] = {}
        self.default: dict[str, str] = {}  # language -> context id
        self.locks: dict[str, asyncio.Lock] = {}

    async def create(self, language: str, cwd: str) -> Context:
        session = await jupyter("POST", "/api/sessions", {
            "path": f"corral-{uuid.uuid4().hex}", "type": "notebook",
            "name": uuid.uuid4().hex, "kernel": {"name": KERNELS[language]},
        })  # fmt: skip
        ctx = Context(session["kernel"]["id"], session["id"], language, cwd)
        await ctx.connect()
        self.by_id[ctx.id] = ctx
        try:
            if cd := _cd_code(language, cwd):
                await ctx.quietly(cd)
        except Failure:
            await self.remove(ctx)
            raise
        return ctx

    async def for_language(self, language: str) -> Context:
        async with self.locks.setdefault(language, asyncio.Lock()):
            cid = self.default.get(language)
            if cid is None or cid not in self.by_id:
                ctx = await self.create(language, HOME)
                self.default[language] = cid = ctx.id
            return self.by_id[cid]

    def get(self, cid: str) -> Context:
        ctx = self.by_id.get(cid)
        if ctx is None:
            raise Failure(404, f"Context {cid} not found")
        return ctx

    async def remove(self, ctx: Context) -> None:
        await ctx.close()
        self.by_id.pop(ctx.id, None)
        self.default = {k: v for k, v in self.default.items() if v != ctx.id}
        await jupyter("DELETE", f"/api/kernels/{ctx.id}")

    async def restart(self, ctx: Context) -> None:
        async with ctx.lock:
            await ctx.close()
            await jupyter("POST", f"/api/kernels/{ctx.id}/restart", {})
            await ctx.connect()
            if cd := _cd_code(ctx.language, ctx.cwd):
                await ctx.quietly(cd)


CONTEXTS = Contexts()


class Handler(web.RequestHandler):
    def json_body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            doc = json.loads(self.request.body)
        except ValueError as exc:
            raise Failure(400, f"the request body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise Failure(400, "the request body must be a JSON object")
        return doc

    def fail(self, exc: Failure) -> None:
        self.set_status(exc.status)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(str(exc))


class Health(Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        lost = [c for c in CONTEXTS.by_id.values() if c.lost and c.id in CONTEXTS.default.values()]
        if lost:
            self.set_status(503)
            self.finish(json.dumps(f"the kernels of {len(lost)} default contexts are gone"))
            return
        self.finish('"OK"')


class Execute(Handler):
    gone = False

    def on_connection_close(self) -> None:
        self.gone = True

    async def post(self) -> None:
        try:
            doc = self.json_body()
            code = doc.get("code")
            if not isinstance(code, str):
                raise Failure(400, "code must be a string")
            env = doc.get("env_vars") or {}
            if not isinstance(env, dict) or not all(
                isinstance(k, str) and k.isidentifier() and isinstance(v, str)
                for k, v in env.items()
            ):
                raise Failure(400, "env_vars must map variable names to strings")
            if doc.get("context_id") and doc.get("language"):
                raise Failure(400, "Only one of context_id or language can be provided")
            if doc.get("context_id"):
                ctx = CONTEXTS.get(str(doc["context_id"]))
            else:
                ctx = await CONTEXTS.for_language(normalize(doc.get("language")))
        except Failure as exc:
            return self.fail(exc)
        self.set_header("Content-Type", "application/x-ndjson")
        self.request.connection.stream.set_nodelay(True)  # a line at a time, not held for an ACK
        lines = ctx.execute(code, env)
        try:
            async for line in lines:
                if self.gone:
                    raise iostream.StreamClosedError()
                self.write(json.dumps(line) + "\n")
                await self.flush()
            self.write('{"type": "end_of_execution"}\n')
            await self.flush()
            self.finish()
        except iostream.StreamClosedError:
            # The client went away: stop the code it asked for, and wait
            # (a while) until the kernel has stopped it, so that the next
            # call is neither stuck behind it nor aborted with it.
            await ctx.interrupt()
            try:
                await asyncio.wait_for(_drain(lines), DRAIN)
            except TimeoutError:
                log.warning("context %s still busy %.0f s after an interrupt", ctx.id, DRAIN)
            await lines.aclose()
        except Failure as exc:
            await lines.aclose()
            self.write(json.dumps(_error({"ename": "ContextLost", "evalue": str(exc)})) + "\n")
            self.finish()


async def _drain(lines: AsyncGenerator[dict[str, Any], None]) -> None:
    async for _ in lines:
        pass


class ContextList(Handler):
    async def post(self) -> None:
        try:
            doc = self.json_body()
            language = normalize(doc.get("language"))
            cwd = doc.get("cwd") or HOME
            if not isinstance(cwd, str) or not cwd.startswith("/"):
                raise Failure(400, f"cwd must be an absolute path, got {cwd!r}")
            ctx = await CONTEXTS.create(language, cwd)
        except Failure as exc:
            return self.fail(exc)
        self.finish(ctx.describe())

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps([c.describe() for c in CONTEXTS.by_id.values()]))


class ContextOne(Handler):
    async def delete(self, cid: str) -> None:
        try:
            await CONTEXTS.remove(CONTEXTS.get(cid))
        except Failure as exc:
            return self.fail(exc)
        self.set_status(204)
        self.finish()


class ContextRestart(Handler):
    async def post(self, cid: str) -> None:
        try:
            await CONTEXTS.restart(CONTEXTS.get(cid))
        except Failure as exc:
            return self.fail(exc)
        self.set_status(204)
        self.finish()


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    # /health answers once code can run in both default contexts (listed
    # from the start, as clients expect).
    await asyncio.gather(CONTEXTS.for_language("python"), CONTEXTS.for_language("javascript"))
    app = web.Application([
        (r"/health", Health), (r"/execute", Execute), (r"/contexts", ContextList),
        (r"/contexts/([^/]+)", ContextOne), (r"/contexts/([^/]+)/restart", ContextRestart),
    ])  # fmt: skip
    server = httpserver.HTTPServer(app, idle_connection_timeout=640, max_body_size=MAX_MESSAGE)
    server.listen(PORT, "0.0.0.0")
    log.info("serving on %d", PORT)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
