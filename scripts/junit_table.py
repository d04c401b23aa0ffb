"""A pytest JUnit XML report as a markdown table: every test and its result.

python scripts/junit_table.py REPORT.xml "TITLE" > TABLE.md
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def main(path: str, title: str) -> None:
    rows: list[tuple[str, str, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        result, why = "pass", ""
        for tag, label in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "skip")):
            found = case.find(tag)
            if found is not None:
                result = label
                why = (
                    (found.get("message") or "").splitlines()[0][:160]
                    if found.get("message")
                    else ""
                )
        rows.append((name, result, why.replace("|", "\\|")))
    totals = Counter(r for _, r, _ in rows)
    print(f"# {title}\n")
    print(", ".join(f"{n} {r}" for r, n in sorted(totals.items())) + f" (of {len(rows)})\n")
    print("| test | result | message |\n|---|---|---|")
    for name, result, why in sorted(rows):
        print(f"| `{name}` | {result} | {why} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
