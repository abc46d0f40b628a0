"""Build the GPU carry kit: one folder (<= 60 MiB) with every wheel a torch+CUDA box lacks to
run megarl's GPU tier offline, megarl's own wheel and source tree, and the script that installs
them and runs the tier.

    python tools/gpu/build_kit.py [--out gpu_kit] [--python 3.10 --python 3.11 ...]
                                  [--numpy-for 3.11] [--arch x86_64] [--max-mib 60]

What goes in (`manifest`): the closure of setup.py's install_requires plus the parts of the test
extra that tests/gpu imports (pytest), with environment markers evaluated for each target Python.
What stays out (`EXCLUDED` and everything torch itself requires): the box's own CUDA torch,
transformer-engine and apex (CUDA builds, far over the budget; the TE test skips without them),
sglang (its own torch pin), and the rest of the test extra, which tests/gpu never imports.
numpy (~16 MiB a Python version) is nearly always beside torch, so its wheel is carried only for
the `--numpy-for` versions. Versions are pinned to the ones installed on the building machine
(the ones megarl's tests ran with); a package absent here takes the newest release its parent's
requirement allows. Wheels only (`pip download --no-deps --only-binary=:all:`), one platform set
per target Python; pure-Python wheels are the same file for all of them.
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys

from packaging.markers import Marker
from packaging.requirements import Requirement

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXCLUDED = {
    "torch": "the box's own CUDA build",
    "transformer-engine": "CUDA build, hundreds of MiB; the TE test skips without it",
    "apex": "built against the box's CUDA; optional",
    "sglang": "pins its own torch; the GPU tier serves with megarl-server",
}
TIER_EXTRAS = ("pytest",)  # from the test extra: what tests/gpu and its workers import
USUALLY_PRESENT = ("numpy",)  # carried only for --numpy-for versions
PLATFORMS = ("manylinux2014_{a}", "manylinux_2_17_{a}", "manylinux_2_24_{a}", "manylinux_2_28_{a}",
             "manylinux_2_34_{a}", "linux_{a}", "any")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_requires(setup_py: str = os.path.join(REPO, "setup.py")) -> list[str]:
    """The ``install_requires`` list literal of setup.py, read without running it."""
    with open(setup_py) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(e) for e in node.value.elts]
    raise ValueError(f"{setup_py}: no install_requires")


def marker_env(python: str) -> dict:
    """The marker environment of a Linux CPython `python` ("3.10") with no extras."""
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def closure(roots, requires_of, python: str, stop=()) -> dict[str, Requirement]:
    """Every requirement reachable from `roots` (requirement strings) for `python`, by canonical
    name; `requires_of(name)` gives a package's requirement strings (None: unknown); names in
    `stop` are neither kept nor followed. The first requirement seen for a name is kept."""
    env, out, todo = marker_env(python), {}, [Requirement(r) for r in roots]
    while todo:
        req = todo.pop(0)
        name = canonical(req.name)
        if name in out or name in stop or (req.marker and not req.marker.evaluate(env)):
            continue
        out[name] = req
        todo.extend(Requirement(r) for r in (requires_of(name) or ()))
    return out


def installed_requires(name: str):
    try:
        return md.requires(name)
    except md.PackageNotFoundError:
        return None


def installed_version(name: str):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def provided_by_torch(python: str, requires_of=installed_requires) -> set[str]:
    """torch and what it installs with it: on the box already, never carried."""
    return set(closure(["torch"], requires_of, python))


def manifest(pythons, numpy_for, requires_of=installed_requires, version_of=installed_version,
             setup_py: str = os.path.join(REPO, "setup.py")) -> dict[str, list[tuple[str, str]]]:
    """Target Python -> (preferred, fallback) pip requirement strings to download for it: the
    version installed here, else (e.g. it needs a newer Python) what the parent's range allows."""
    roots = [r for r in install_requires(setup_py) if canonical(Requirement(r).name) not in EXCLUDED]
    roots += list(TIER_EXTRAS)
    out = {}
    for py in pythons:
        stop = set(EXCLUDED) | provided_by_torch(py, requires_of)
        if py not in numpy_for:
            stop |= set(USUALLY_PRESENT)
        reqs = closure(roots, requires_of, py, stop)
        out[py] = [_pin(name, req, version_of(name)) for name, req in sorted(reqs.items())]
    return out


def _pin(name: str, req: Requirement, version) -> tuple[str, str]:
    loose = f"{name}{req.specifier}"
    if version is not None and req.specifier.contains(version, prereleases=True):
        return f"{name}=={version}", loose
    return loose, loose


def _pip_download(reqs: list[str], python: str, arch: str, out: str) -> bool:
    platforms = [a for p in PLATFORMS for a in ("--platform", p.format(a=arch))]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "--python-version", python, "--implementation", "cp", *platforms, "-d", out, *reqs]
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def download(entries: list[tuple[str, str]], python: str, arch: str, out: str) -> list[str]:
    """All preferred versions in one pip call; if that fails, package by package with the
    fallback range. Returns the requirement strings used (a failure of both raises)."""
    if _pip_download([pref for pref, _ in entries], python, arch, out):
        return [pref for pref, _ in entries]
    used = []
    for pref, loose in entries:
        for req in dict.fromkeys((pref, loose)):
            if _pip_download([req], python, arch, out):
                used.append(req)
                break
        else:
            raise SystemExit(f"no wheel of {loose} for CPython {python} ({arch})")
    return used


def add_megarl(out: str) -> None:
    """megarl's wheel (pure Python) and its source tree at HEAD (tests/, examples/, configs/)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", out, REPO], check=True)
    with open(os.path.join(out, "megarl-src.tar.gz"), "wb") as f:
        subprocess.run(["git", "-C", REPO, "archive", "--format=tar.gz", "HEAD"], stdout=f, check=True)
    shutil.copy(os.path.join(REPO, "tools", "gpu", "install_and_test.sh"), out)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO, "gpu_kit"))
    p.add_argument("--python", action="append", default=None, help="target Python (default 3.10 3.11 3.12)")
    p.add_argument("--numpy-for", action="append", default=None,
                   help="carry numpy for this Python (default: the building interpreter's)")
    p.add_argument("--arch", default="x86_64", choices=["x86_64", "aarch64"])
    p.add_argument("--max-mib", type=float, default=60.0)
    args = p.parse_args(argv)
    pythons = args.python or ["3.10", "3.11", "3.12"]
    numpy_for = args.numpy_for or [f"{sys.version_info.major}.{sys.version_info.minor}"]
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    with open(os.path.join(args.out, "MANIFEST.txt"), "w") as f:
        for py, entries in manifest(pythons, numpy_for).items():
            used = download(entries, py, args.arch, args.out)
            f.write(f"# CPython {py} ({args.arch})\n" + "".join(r + "\n" for r in used))
    add_megarl(args.out)
    size = folder_bytes(args.out)
    print(f"{args.out}: {len(os.listdir(args.out))} files, {size / 2**20:.1f} MiB")
    if size > args.max_mib * 2**20:
        print(f"over the {args.max_mib} MiB budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
