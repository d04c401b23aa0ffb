"""The outside review's classes (issue 14, docs/guard.md): one test per
class, each with several variants, next to a neighbour that must not
notice, and each refusal counted in the audit by class."""

from __future__ import annotations

import corral

from . import review_attacks as r
from .attacks import Neighbour, during
from .test_attacks import check


async def test_32_bit_entry_is_refused_and_audited_as_its_64_bit_twin(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    before = await attacker.audit()
    outcome, ratio = await during(neighbour, r.int80_syscalls(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    for name in r.PRIVILEGED_32:
        assert audit.syscalls.get(name, 0) >= 1, (name, audit.syscalls)
    assert audit.syscalls_denied.get("privileged", 0) >= len(r.PRIVILEGED_32)
    assert audit.syscalls_denied.get("socket-family", 0) >= 1
    # Nothing of it was filed under "other".
    assert audit.syscalls_denied.get("other", 0) == before.syscalls_denied.get("other", 0)


async def test_only_the_socket_families_a_sandbox_needs_are_allowed(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await during(neighbour, r.socket_families(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.syscalls_denied.get("socket-family", 0) >= len(r.REFUSED_FAMILIES), audit
