"""What a sandbox's feature objects (commands, files, network, display)
use of the sandbox they belong to. AsyncSandbox is one; typing the features
against this instead of it keeps sdk.sandbox -> features a one-way import.
"""

from __future__ import annotations

from typing import Protocol

from corral.api.models import SandboxInfo
from corral.api.service import SandboxService


class SandboxHandle(Protocol):
    # The service that reaches the sandbox (an embedded node, HTTP, a test's).
    _service: SandboxService
    # Its latest info; a feature that learns a newer one (network.update)
    # stores it here, so every feature and the sandbox see the same.
    info: SandboxInfo

    @property
    def id(self) -> str: ...
