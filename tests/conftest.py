"""Shared pytest setup: tier directories on sys.path so their helper modules import."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for tier in ("dist", "e2e"):
    path = os.path.join(HERE, tier)
    if path not in sys.path:
        sys.path.insert(0, path)
