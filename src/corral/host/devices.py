"""The host's device nodes a container is given (bound in, since a user
namespace may not make them): they must stay the host root's.

crun 1.8 fchowns a container's stdio to the container's root before it
reopens stdin inside; given the host's /dev/null as stdin (as corral-nsexec
once gave it), it made the host's /dev/null the first sandbox id block's,
after which every sandbox of that block, root of the bound node, could
chmod it (0640 from inside broke it for the host's users). corral-nsexec
no longer hands a runtime the host's /dev/null, and corral-run never
chowns; a node starting undoes what an older Corral left.
"""

from __future__ import annotations

import os

from corral.log import get_logger

log = get_logger("corral.devices")

# What runtimes bind into every container (runplan.DEVICES, crun's defaults).
BOUND = ("null", "zero", "full", "tty", "random", "urandom")


def repair(id_base: int) -> list[str]:
    """Give back to root any bound device node a sandbox id owns (uid or
    gid at or above id_base, where sandbox id blocks start), with the
    mode every one of them has on a Linux host (0666: its owner, the
    sandbox, may have changed it); returns the ones repaired."""
    fixed = []
    for name in BOUND:
        path = f"/dev/{name}"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_uid >= id_base or st.st_gid >= id_base:
            os.chown(path, 0, 0)
            os.chmod(path, 0o666)
            fixed.append(name)
            log.warning("host.device_owner_repaired", device=path, uid=st.st_uid, gid=st.st_gid,
                        mode=oct(st.st_mode & 0o7777))  # fmt: skip
    return fixed
