"""The tools E2B's base template has, as a toolkit over debian-python +
e2b-user: pip that installs (Debian's PEP 668 marker removed) and venv,
`python`, Node.js with npm, git, curl, jq, less and procps, from Debian bookworm's
packages. Agents written for E2B run `pip install`, `node`, `git status`
and `curl localhost:PORT` on its `base` template; Corral's `base` is
debian-python + e2b-user + this.

Built in a sandbox whose network reaches Debian's mirror and nothing else
(e2b-tools-files/build.sh, through build/scripted.py), found again by its
key. `python -m corral.cli.e2b_templates` builds it (the install script
does).
"""

from __future__ import annotations

from pathlib import Path

from corral.images.build import files_digest

TAG = "e2b-tools:bookworm"
FILES = Path(__file__).with_name("e2b-tools-files")
HOME = "/opt/corral/e2b-tools"
# Debian bookworm's packages (their versions are the suite's).
DEBIAN = [
    "ca-certificates",
    "curl",
    "git",
    "jq",
    "less",
    "procps",
    "python-is-python3",  # `python` (E2B's own tests run `python -m http.server`)
    "python3-pip",
    "python3-venv",
    "nodejs",
    "npm",
]


def key() -> str:
    return "e2b-tools:" + ",".join(DEBIAN) + ":" + files_digest(FILES)
