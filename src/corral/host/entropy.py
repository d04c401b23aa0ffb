"""Re-keying the host kernel's CRNG after a sandbox is copied.

A container's copy (a fork, a restore while its source lives) shares the
host's kernel, so getrandom() and /dev/urandom already differ between
copies. What does not: user-space generator state restored byte for byte,
including glibc >= 2.41's vDSO getrandom, whose per-thread key is kept
until the kernel's CRNG generation changes. RNDRESEEDCRNG changes it, so
every copy's next vDSO draw fetches a fresh key. Generators a program
seeds itself (Python's `random`, a NumPy Generator) are its own memory and
stay the same in every copy: only the program can re-seed those.
"""

from __future__ import annotations

import fcntl
import os

RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07), linux/random.h


def reseed() -> str | None:
    """Re-key the host CRNG now; None, or why it could not be done."""
    try:
        fd = os.open("/dev/urandom", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"/dev/urandom: {exc.strerror}"
    try:
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    except OSError as exc:  # EPERM without CAP_SYS_ADMIN, ENODATA before the CRNG is ready
        return f"RNDRESEEDCRNG: {exc.strerror}"
    finally:
        os.close(fd)
    return None
