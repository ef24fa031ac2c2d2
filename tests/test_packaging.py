"""The ``lum.*`` package-dir mapping works outside the repo, editable and from a built wheel."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lum.builder", "lum.builder.models", "lum.format", "lum.loader", "lum.rules", "lum.templates")
DATA = {"lum.rules": ("rules", ("*.egg",)), "lum.templates": ("templates", ("*.cu", "*.cuh"))}

# Imports every package, then reports where each came from and which data files importlib.resources sees.
_PROBE = f"""
import importlib, importlib.resources, json
out = {{}}
for name in {PACKAGES!r}:
    mod = importlib.import_module(name)
    files = sorted(p.name for p in importlib.resources.files(name).iterdir() if p.is_file())
    out[name] = {{"file": mod.__file__, "files": files}}
print(json.dumps(out))
"""

_COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                      ".pytest_cache", ".hypothesis", "scratch", ".whl", "*.lumpkg", ".gl")


def _probe(cmd: list[str], cwd: Path, env: dict | None = None) -> dict:
    res = subprocess.run([*cmd, "-c", _PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _source_data_files() -> dict[str, list[str]]:
    out = {}
    for pkg, (folder, patterns) in DATA.items():
        out[pkg] = sorted({p.name for pat in patterns for p in (REPO / folder).glob(pat)})
    return out


def test_import_from_outside_the_repo(tmp_path):
    """The current (editable) install resolves every package to the repo's folders, from any cwd."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    seen = _probe([sys.executable], tmp_path, env)
    folders = {"lum.builder": "builder", "lum.builder.models": "builder/models", "lum.format": "format",
               "lum.loader": "loader", "lum.rules": "rules", "lum.templates": "templates"}
    for name, folder in folders.items():
        assert Path(seen[name]["file"]).resolve().parent == (REPO / folder).resolve(), (name, seen[name])
    for pkg, files in _source_data_files().items():
        assert set(files) <= set(seen[pkg]["files"]), (pkg, files, seen[pkg]["files"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built (without build isolation) from a copy of the source tree."""
    for mod in ("setuptools", "pip"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (pip install -e '.[dev]' installs it)")
    version = importlib.metadata.version("setuptools")  # not imported here: it patches distutils
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        pytest.skip(f"setuptools {version} needs the `wheel` package to build wheels "
                    "(pip install -e '.[dev]' installs it)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_COPY_IGNORE)  # build off-tree: never write build/ into the checkout
    out = tmp / "dist"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          str(src), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("lum-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_contains_every_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in PACKAGES:
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    assert not any(n.startswith(("tests/", "scratch/", "lum/tests/")) for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)


@pytest.mark.slow
def test_wheel_ships_rule_and_template_files(wheel):
    wanted = _source_data_files()
    if not any(wanted.values()):
        pytest.skip("no rules/*.egg or templates/*.cu(h) files exist yet; nothing to check")
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg, files in wanted.items():
        for f in files:
            assert f"{pkg.replace('.', '/')}/{f}" in names, (pkg, f)


@pytest.mark.slow
def test_installed_wheel_imports_from_outside_the_repo(wheel, tmp_path):
    """A normal install: the wheel into a --target folder, run with -S so no editable finder (.pth) loads."""
    target = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                          "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    deps = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), *deps])
    seen = _probe([sys.executable, "-S"], tmp_path, env)
    for name, info in seen.items():
        assert Path(info["file"]).resolve().is_relative_to(target.resolve()), (name, info["file"])
    for pkg, files in _source_data_files().items():
        assert set(files) <= set(seen[pkg]["files"]), (pkg, files, seen[pkg]["files"])
    # the console script's entry point resolves in the installed copy
    code = "from lum.loader.cli import main, app; print(main.__module__)"
    res = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "lum.loader.cli", res.stderr
