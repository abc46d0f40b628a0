"""docs/configuration.md is generated from the config dataclasses and must be current."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_configuration_reference_is_current():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gen_config_docs.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_field_is_documented():
    text = open(os.path.join(REPO, "docs", "configuration.md")).read()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 80
    undocumented = [r.split("|")[1].strip() for r in rows if r.rstrip().endswith("|  |")]
    assert undocumented == []
