"""Every config field is read by the code path it names, or it does not exist.

A field no code reads is a silent lie to the user (they set it, nothing changes). This test reads
the sources: each `section.field` of `megarl.config.Config` must be accessed as an attribute
(`.field`) somewhere in megarl/ outside the config module itself, which only declares and
validates - or through a property of its section that is read there (e.g.
`rollout.staleness` combines max_staleness and staleness_threshold). `algo.*` fields are consumed by `AlgoConfig.build()` into the typed spec the loss code
uses, so for them the build method must read each one.
"""
import dataclasses
import inspect
import re
from pathlib import Path

from megarl.algo.config import AlgoConfig
from megarl.config import Config

ROOT = Path(__file__).resolve().parents[2] / "megarl"
DECLARING = {ROOT / "config.py", ROOT / "algo" / "config.py"}


def sources() -> str:
    return "\n".join(p.read_text() for p in ROOT.rglob("*.py") if p not in DECLARING)


def read(name: str, text: str) -> bool:
    return re.search(rf"\.{name}\b", text) is not None


def test_every_config_field_is_read():
    text = sources()
    unread = []
    for section in dataclasses.fields(Config):
        if section.name == "algo":
            continue
        cls = type(getattr(Config(), section.name))
        properties = {n: inspect.getsource(p.fget) for n, p in vars(cls).items() if isinstance(p, property)}
        for f in dataclasses.fields(cls):
            via_property = any(f"self.{f.name}" in src and read(n, text) for n, src in properties.items())
            if not (read(f.name, text) or via_property):
                unread.append(f"{section.name}.{f.name}")
    assert not unread, f"config fields no code reads: {unread}"


def test_every_algo_field_reaches_the_spec():
    build = inspect.getsource(AlgoConfig.build)
    unread = [f.name for f in dataclasses.fields(AlgoConfig) if f"self.{f.name}" not in build]
    assert not unread, f"algo fields AlgoConfig.build() ignores: {unread}"
