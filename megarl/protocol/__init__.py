"""The shared floor: what two of megarl's three programs (trainer ranks, rollout manager,
inference servers) must agree on. Stands on the standard library, numpy and torch only and imports
nothing else of megarl (tests/unit/test_import_rules.py)."""
