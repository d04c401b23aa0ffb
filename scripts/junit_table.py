"""A pytest JUnit XML report as a markdown table: every test and its result.

python scripts/junit_table.py REPORT.xml "TITLE" [--notes NOTES.md] > TABLE.md

NOTES.md, if given, is printed between the totals and the table.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def main(path: str, title: str, notes: str | None = None) -> None:
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
    if notes:
        with open(notes) as f:
            print(f.read().rstrip() + "\n\n## Every test\n")
    print("| test | result | message |\n|---|---|---|")
    for name, result, why in sorted(rows):
        print(f"| `{name}` | {result} | {why} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    notes = None
    if "--notes" in args:
        i = args.index("--notes")
        notes = args[i + 1]
        del args[i : i + 2]
    main(args[0], args[1], notes)
