"""The ``lum`` console script: help, one-line errors with exit status 2, ``lum graph --json``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lum.loader.cli import main


def _lum_script() -> str | None:
    """The installed console script of this interpreter's environment (else the one on PATH)."""
    here = Path(sys.executable).parent / ("lum.exe" if os.name == "nt" else "lum")
    return str(here) if here.exists() else shutil.which("lum")


def lum(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = _lum_script()
    cmd = [script] if script else [sys.executable, "-m", "lum.loader.cli"]
    env = {k: v for k, v in os.environ.items() if k != "LUM_DEBUG"}
    env["COLUMNS"] = "100"
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """Run the entry point in-process; returns (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    code = info.value.code
    return (0 if code is None else int(code)), out, err


def _has_load_spec() -> bool:
    try:
        from lum.builder.models import load_spec  # noqa: F401
    except ImportError:
        return False
    return True


needs_models = pytest.mark.skipif(not _has_load_spec(), reason="lum.builder.models.load_spec does not exist yet")


def assert_one_line_error(code: int, out: str, err: str) -> None:
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert out == ""


# ====================================================================== the installed script
def test_console_script_is_installed():
    assert _lum_script(), "the `lum` console script is not installed next to python nor on PATH"


def test_help():
    res = lum("--help")
    assert res.returncode == 0, res.stderr
    assert "graph" in res.stdout and ".lumpkg" in res.stdout
    assert lum("--version").stdout.startswith("lum ")


def test_graph_help_explains_options():
    res = lum("graph", "--help")
    assert res.returncode == 0, res.stderr
    for word in ("SRC", "--random", "--json", "--max-seq", "--dtype", "bf16", "tiny-llama", "checkpoint"):
        assert word in res.stdout, word


def test_bad_src_path_is_a_one_line_error(tmp_path):
    res = lum("graph", str(tmp_path / "no-such-checkpoint"))
    assert_one_line_error(res.returncode, res.stdout, res.stderr)
    assert "no-such-checkpoint" in res.stderr


def test_loader_cli_does_not_import_the_builder():
    code = ("import sys, lum.loader, lum.loader.cli; "
            "bad = sorted(m for m in sys.modules if m.startswith('lum.builder')); "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


# ====================================================================== argument errors (in-process)
@pytest.mark.parametrize("args", [
    pytest.param((), id="neither-src-nor-random"),
    pytest.param(("some/dir", "--random", "tiny-llama"), id="both"),
])
def test_src_xor_random(capsys, args):
    assert_one_line_error(*run_main(capsys, "graph", *args))


def test_src_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    assert_one_line_error(*run_main(capsys, "graph", str(f)))


def test_bad_option_value_exits_2(capsys):
    code, out, err = run_main(capsys, "graph", "--random", "tiny-llama", "--dtype", "f64")
    assert code == 2 and "Traceback" not in err


# ====================================================================== with the model API
@needs_models
def test_unknown_random_name(capsys):
    code, out, err = run_main(capsys, "graph", "--random", "no-such-model")
    assert_one_line_error(code, out, err)
    assert "no-such-model" in err


@needs_models
def test_folder_without_config(capsys, tmp_path):
    assert_one_line_error(*run_main(capsys, "graph", str(tmp_path)))


@needs_models
def test_graph_json():
    res = lum("graph", "--random", "tiny-llama", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)  # the whole of stdout is one JSON object
    for key in ("model", "source", "dtype", "max_seq", "param_count", "param_bytes", "config", "graphs"):
        assert key in data, key
    assert data["model"] == "tiny-llama" and data["dtype"] == "f32"
    assert data["param_bytes"] == 4 * data["param_count"] > 0
    assert set(data["graphs"]) == {"prefill", "decode"}
    for g in data["graphs"].values():
        assert g["nodes"] == sum(g["ops"].values()) > 0
        assert g["chunks"] == sum(len(grp["chunks"]) for grp in g["groups"])
        assert all(len(grp["hash"]) == 64 for grp in g["groups"])
        assert isinstance(g["dyn_vars"], list) and g["dyn_vars"]
        n_layers = data["config"].get("num_layers") if isinstance(data["config"], dict) else None
        if n_layers:        # the layers: one group, or two with the norms ahead (the last layer alone)
            layers = [grp["chunks"] for grp in g["groups"] if not {0, g["chunks"] - 1} & set(grp["chunks"])]
            assert sorted(sum(layers, [])) == list(range(1, n_layers + 1)) and len(layers) <= 2, layers


@needs_models
def test_graph_tables_bf16_and_max_seq(capsys):
    code, out, err = run_main(capsys, "graph", "--random", "tiny-qwen3", "--dtype", "bf16", "--max-seq", "64")
    assert code == 0, err
    for word in ("tiny-qwen3", "prefill", "decode", "HLIR nodes", "groups", "Mul"):
        assert word in out, word
    code, out, err = run_main(capsys, "graph", "--random", "tiny-qwen3", "--dtype", "bf16", "--max-seq", "64",
                              "--json")
    data = json.loads(out)
    assert data["dtype"] == "bf16" and data["max_seq"] == 64
    assert data["param_bytes"] == 2 * data["param_count"]


@needs_models
@pytest.mark.slow
def test_graph_of_a_hugging_face_folder(capsys, tmp_path):
    hf = pytest.importorskip("tests.hf_checkpoints")
    hf.save_hf_model("tiny-llama", tmp_path)
    code, out, err = run_main(capsys, "graph", str(tmp_path), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data["graphs"]) == {"prefill", "decode"} and data["param_count"] > 0


@needs_models
def test_a_full_disk_is_a_one_line_error_and_leaves_no_file(capsys, tmp_path, monkeypatch):
    """An OSError while writing (ENOSPC here, as a benchmark's kept work folder once caused) is reported as
    one line with exit status 2, not a traceback, and the atomic write leaves nothing under the name."""
    import errno

    from lum.format import package

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(package.PackageWriter, "write", full)
    out = tmp_path / "t.lumpkg"
    code, _, err = run_main(capsys, "build", "--random", "tiny-llama", "-o", str(out))
    assert code == 2 and err.strip().splitlines()[-1] == "error: No space left on device"
    assert "Traceback" not in err and not out.exists()


@needs_models
def test_build_into_a_log_writes_its_progress_as_lines(capsys, tmp_path):
    """With stderr not a terminal (a benchmark's build log), `lum build` writes a line as each stage starts
    and ends, with the seconds since the build began, so a build cut off by a timeout says how far it got."""
    import re

    out = tmp_path / "t.lumpkg"
    code, _, err = run_main(capsys, "build", "--random", "tiny-llama", "--max-seq", "16", "-o", str(out))
    assert code == 0, err
    assert out.is_file()
    lines = [ln for ln in err.splitlines() if ln.startswith("[")]
    got = [re.fullmatch(r"\[ *(\d+\.\d) s\] building tiny-llama: (\w+) (\d+)/(\d+)", ln) for ln in lines]
    assert all(got), lines
    stages = [m.group(2) for m in got]
    assert {"compile", "kernels", "write"} <= set(stages), stages     # write: percent of the package's bytes
    for stage in ("compile", "kernels", "write"):          # each stage ends with its last step done
        last = [m for m in got if m.group(2) == stage][-1]
        assert last.group(3) == last.group(4) != "0", lines
    seconds = [float(m.group(1)) for m in got]
    assert seconds == sorted(seconds)


def test_progress_lines_are_rate_limited_within_a_stage(capsys, monkeypatch):
    """Within one stage a line at most every PROGRESS_LINE_EVERY_S seconds; a new stage, a stage's end
    and nothing twice over."""
    from lum.loader import cli

    clock = iter([0.0, 0.0, 1.0, 2.0, 20.0, 21.0, 21.0, 22.0, 23.0])
    monkeypatch.setattr(cli.time, "perf_counter", lambda: next(clock))
    update = cli._progress_lines("building x")
    for stage, done, total in [("compile", 0, 3), ("compile", 1, 3), ("compile", 2, 3), ("compile", 2, 3),
                               ("compile", 3, 3), ("compile", 3, 3), ("kernels", 0, 2), ("kernels", 1, 2)]:
        update(stage, done, total)
    err = capsys.readouterr().err
    assert [ln.split("] ")[1] for ln in err.splitlines()] == [
        "building x: compile 0/3", "building x: compile 2/3", "building x: compile 3/3", "building x: kernels 0/2"]
