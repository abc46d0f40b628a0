"""tools/gpu: the carry kit's manifest logic (what is carried, for which Python, pinned how), its
download fallback and the junit summary, without downloading anything."""
import os
import sys

import pytest
from packaging.requirements import Requirement

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "gpu"))

import build_kit  # noqa: E402
import summarize_junit  # noqa: E402

TORCH_DEPS = {"filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec", "setuptools"}


def names(entries) -> set[str]:
    return {build_kit.canonical(Requirement(pref).name) for pref, _ in entries}


def test_manifest_covers_install_requires_minus_torch():
    required = {build_kit.canonical(Requirement(r).name) for r in build_kit.install_requires()}
    assert "torch" in required and "megatron-core" in required  # the setup.py this reads
    plan = build_kit.manifest(["3.10", "3.11", "3.12"], numpy_for=["3.11"])
    for py, entries in plan.items():
        carried = names(entries)
        expected = required - {"torch"} - ({"numpy"} if py != "3.11" else set())
        assert expected <= carried, (py, expected - carried)
        assert "pytest" in carried and "pluggy" in carried  # the tier's runner and its deps
        assert "aiohappyeyeballs" in carried and "yarl" in carried  # aiohttp's, transitively
        assert not carried & set(build_kit.EXCLUDED), py
        assert not carried & TORCH_DEPS, (py, carried & TORCH_DEPS)  # torch brings them
    assert "numpy" in names(plan["3.11"]) and "numpy" not in names(plan["3.12"])
    assert {"tomli", "exceptiongroup"} <= names(plan["3.10"])  # pytest's markers for < 3.11
    assert not {"tomli", "exceptiongroup"} & names(plan["3.11"])


def test_megatron_core_is_pinned_to_the_tested_release():
    entries = dict(build_kit.manifest(["3.11"], numpy_for=[])["3.11"])
    assert "megatron-core==0.16.1" in entries


def fake_graph(name):
    return {
        "app": ["lib>=1", "old-only; python_version < '3.11'", "extra-only; extra == 'dev'", "torch"],
        "lib": ["leaf", "app"],  # a cycle
        "torch": ["torchdep"],
        "leaf": [], "old-only": [], "torchdep": [],
    }.get(name)


def test_closure_evaluates_markers_and_stops():
    got = build_kit.closure(["app"], fake_graph, "3.10", stop={"torch"})
    assert set(got) == {"app", "lib", "leaf", "old-only"}
    got = build_kit.closure(["app"], fake_graph, "3.12", stop={"torch"})
    assert set(got) == {"app", "lib", "leaf"}
    assert build_kit.provided_by_torch("3.11", fake_graph) == {"torch", "torchdep"}


def test_pins_installed_version_only_inside_the_range():
    req = Requirement("multidict<8.0,>=4.5")
    assert build_kit._pin("multidict", req, "7.2.1") == ("multidict==7.2.1", "multidict<8.0,>=4.5")
    assert build_kit._pin("multidict", req, "9.0") == ("multidict<8.0,>=4.5",) * 2
    assert build_kit._pin("tomli", Requirement("tomli>=1"), None) == ("tomli>=1", "tomli>=1")


def test_download_falls_back_package_by_package(monkeypatch):
    calls = []

    def fake(reqs, python, arch, out):
        calls.append(list(reqs))
        return reqs != ["a==2", "b==1"] and reqs != ["a==2"]  # a==2 needs a newer Python

    monkeypatch.setattr(build_kit, "_pip_download", fake)
    used = build_kit.download([("a==2", "a>=1"), ("b==1", "b")], "3.10", "x86_64", "/nowhere")
    assert used == ["a>=1", "b==1"]
    assert calls == [["a==2", "b==1"], ["a==2"], ["a>=1"], ["b==1"]]
    monkeypatch.setattr(build_kit, "_pip_download", lambda *a: False)
    with pytest.raises(SystemExit, match="no wheel of a>=1 for CPython 3.10"):
        build_kit.download([("a==2", "a>=1")], "3.10", "x86_64", "/nowhere")


def test_install_requires_is_read_without_running_setup(tmp_path):
    setup = tmp_path / "setup.py"
    setup.write_text("raise SystemExit('never run')\nsetup(install_requires=['x>=1', 'y'])\n")
    assert build_kit.install_requires(str(setup)) == ["x>=1", "y"]


def test_junit_summary_lists_outcomes_reasons_and_numbers(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_a" name="test_ok"><properties>'
        '<property name="loss_last" value="1.5"/></properties></testcase>'
        '<testcase classname="tests.gpu.test_b" name="test_skip">'
        '<skipped message="needs a CUDA device">x</skipped></testcase>'
        '<testcase classname="tests.gpu.test_c" name="test_bad"><failure message="assert 2 &lt;= 1&#10;more">'
        'tb</failure></testcase></testsuite></testsuites>')
    assert summarize_junit.summarize(str(xml)) == [
        "passed tests.gpu.test_a::test_ok loss_last=1.5",
        "skipped tests.gpu.test_b::test_skip (needs a CUDA device)",
        "FAILED tests.gpu.test_c::test_bad (assert 2 <= 1)",
    ]
