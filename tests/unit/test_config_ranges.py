"""Generated checks over every config section: each numeric field declares a range (or why it has
none), an out-of-range value and a wrong type fail at load with one line naming the field, and no
validation code is unreachable (a check after a `return` never runs)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

from megarl.common import fields
from megarl.config import common, launch, load, model, rollout, root, train
from megarl.algo import config as algo_config_module
from megarl.config import Config, ConfigError, load_config
from megarl.common.fields import bounds, numeric_fields
from megarl.models.random_hf import tiny_config, write_random_hf

SECTIONS = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}
NUMERIC = [(s, f, kind) for s, cls in SECTIONS.items() for f, kind in numeric_fields(cls)]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return write_random_hf(str(tmp_path_factory.mktemp("hf")), tiny_config())


def load(hf, *overrides):
    return load_config(None, [f"model.hf_path={hf}", "data.train_path=x.jsonl", *overrides])


def out_of_range(f: dataclasses.Field, kind: type):
    """A value just outside the declared range (below the lower bound when there is one)."""
    b, step = bounds(f), 1 if kind is int else 0.5
    if "ge" in b:
        return b["ge"] - step
    if "gt" in b:
        return b["gt"]
    if "le" in b:
        return b["le"] + step
    return b["lt"]


def test_every_numeric_field_declares_a_range():
    assert len(NUMERIC) > 60
    missing = [f"{s}.{problem}" for s, f, _ in NUMERIC if (problem := fields.declared(f))]
    assert missing == []


def one_line_error(hf, override: str) -> str:
    with pytest.raises(ConfigError) as e:
        load(hf, override)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("section, f, kind", [x for x in NUMERIC if bounds(x[1])],
                         ids=[f"{s}.{f.name}" for s, f, _ in NUMERIC if bounds(f)])
def test_out_of_range_is_refused_naming_the_field(hf, section, f, kind):
    bad = out_of_range(f, kind)
    msg = one_line_error(hf, f"{section}.{f.name}={bad}")
    assert msg.startswith(f"{section}.{f.name}: must be {fields.range_text(f)}, got {bad}"), msg


@pytest.mark.parametrize("section, f, kind", NUMERIC, ids=[f"{s}.{f.name}" for s, f, _ in NUMERIC])
def test_wrong_type_is_refused_naming_the_field(hf, section, f, kind):
    expected = "expected an integer" if kind is int else "expected a number"
    for bad in ("abc", "[1]", "true") + (("1.5",) if kind is int else ()):
        msg = one_line_error(hf, f"{section}.{f.name}={bad}")
        assert msg.startswith(f"{section}.{f.name}: {expected}"), msg


@pytest.mark.parametrize("override, message", [
    ("rollout.temperature=0", "rollout.temperature: must be > 0, got 0.0 (temperature 0 samples every "
                              "completion of a group alike: the advantages are all 0 and nothing is learned)"),
    ("rollout.temperature=-1", "rollout.temperature: must be > 0, got -1.0"),
    ("rollout.top_p=5", "rollout.top_p: must be > 0 and <= 1, got 5.0"),
    ("rollout.workflow_args=3", "rollout.workflow_args: expected a mapping, got 3"),
    ("rollout.health_timeout_s=-1", "rollout.health_timeout_s: must be > 0 and <= 86400, got -1.0"),
    ("launch.server_port=70000", "launch.server_port: must be >= 1 and <= 65535, got 70000"),
])
def test_checks_once_dead_now_refuse(hf, override, message):
    assert one_line_error(hf, override).startswith(message)


# ----------------------------------------------------------------------------- unreachable code

def unreachable(tree: ast.AST) -> list[str]:
    """Statements that follow a return/raise/continue/break in the same block."""
    found = []
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if not isinstance(block, list):
                continue
            for stmt, nxt in zip(block, block[1:]):
                if isinstance(stmt, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                    found.append(f"line {nxt.lineno}: {ast.unparse(nxt).splitlines()[0]}")
    return found


def test_unreachable_code_is_detected():
    src = textwrap.dedent("""
        def validate(self):
            if self.a < 0:
                raise ValueError("a")
            return
            if self.temperature <= 0:
                raise ValueError("dead")
    """)
    assert unreachable(ast.parse(src)) == ["line 6: if self.temperature <= 0:"]


@pytest.mark.parametrize("cls", [Config, *SECTIONS.values()], ids=["Config", *SECTIONS])
def test_no_section_validate_has_unreachable_code(cls):
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.validate)))
    assert unreachable(tree) == []


@pytest.mark.parametrize("module", [common, launch, load, model, rollout, root, train, fields,
                                    algo_config_module])
def test_no_config_module_has_unreachable_code(module):
    assert unreachable(ast.parse(inspect.getsource(module))) == []
