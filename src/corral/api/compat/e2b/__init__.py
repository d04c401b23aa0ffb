"""E2B compatibility: the stock `e2b` SDKs, unmodified, against Corral
(docs/e2b.md). control.py is E2B's control API, envd.py its in-sandbox API,
both over a SandboxService."""

from __future__ import annotations

from fastapi import FastAPI

from corral.api.compat.e2b import control
from corral.api.compat.e2b.envd import Envd, ForSandbox


def add_e2b(
    app: FastAPI, resolve: control.Resolve, for_sandbox: ForSandbox, templates: dict[str, str]
) -> Envd:
    """Serve E2B's routes on `app`: the control API for callers `resolve`
    lets in, envd for the sandbox `for_sandbox` finds (its token checked)."""
    envd = Envd(for_sandbox)
    app.include_router(control.router(resolve, templates, envd.forget))
    app.include_router(envd.router())
    return envd
