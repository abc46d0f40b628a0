"""One line per test of a pytest junit XML: outcome, skip/failure reason, and the numbers the test
recorded with ``record_property`` (what install_and_test.sh writes into its result file).

    python tools/gpu/summarize_junit.py JUNIT.xml
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def summarize(path: str) -> list[str]:
    lines = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                why = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else ""
                break
        props = [f"{p.get('name')}={p.get('value')}" for p in case.iter("property")]
        name = f"{case.get('classname', '')}::{case.get('name')}"
        lines.append(" ".join(x for x in (outcome, name, why and f"({why})", " ".join(props)) if x))
    return lines


if __name__ == "__main__":
    print("\n".join(summarize(sys.argv[1])))
