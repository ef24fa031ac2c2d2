"""benchmarks/prefill.py end to end on the CPU (its smoke-test mode): a tiny Gemma 3 (prompt longer than its
sliding window) made and saved, built with ``lum build``, prefilled by lum (reference backend) and HF sdpa,
the JSON written with every field and the two systems' last logits rows agreeing; a lum backend that cannot
run becomes that row's error; bad arguments exit 2 with one line and no traceback."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "prefill.py"
TINY = ["--model", "tiny-gemma3", "--dtype", "f32", "--prompt-len", "12", "--warmup", "1", "--repeats", "3",
        "--device", "cpu", "--commit", "test"]


def _cmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def _run(tmp_path: Path, *extra: str) -> dict:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    res = _cmd(*TINY, "--out", str(out), *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = out.glob("prefill-tiny-gemma3-f32-*.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_prefill_benchmark_smoke(tmp_path):
    d = _run(tmp_path, "--systems", "lum,lum-noflash,hf-sdpa", "--lum-backend", "reference")
    for key in ("benchmark", "commit", "gpu", "driver", "date", "config", "versions", "rows"):
        assert key in d
    assert d["benchmark"] == "prefill" and d["commit"] == "test"
    assert d["config"]["prompt_len"] == 12 and d["config"]["max_seq"] >= 12 and d["config"]["hf_cache"]
    rows = {r["system"]: r for r in d["rows"]}
    assert set(rows) == {"lum", "lum-noflash", "hf-sdpa"}
    for r in rows.values():
        assert r["error"] is None, r["error"]
        assert (r["model"], r["dtype"], r["prompt_len"]) == ("tiny-gemma3", "f32", 12)
        for k in ("median_s", "tokens_per_s", "cold_s"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["system"], k, r[k])
        assert r["repeats"] == 3
    for lum in (rows["lum"], rows["lum-noflash"]):    # a second package, prefill's attention as GEMMs
        assert lum["vs_torch"] == pytest.approx(lum["median_s"] / rows["hf-sdpa"]["median_s"], rel=1e-2)
        # the same weights: lum's reference backend reproduces HF's last logits row (sliding-window layers too)
        assert lum["last_row_rel_err_vs_hf_sdpa"] < 1e-4 and lum["argmax_matches_hf_sdpa"] is True
    assert rows["hf-sdpa"]["details"]["sdpa_calls"]["explicit_mask"] > 0


@pytest.mark.slow
def test_prefill_benchmark_records_an_unavailable_backend(tmp_path):
    d = _run(tmp_path, "--systems", "lum", "--lum-backend", "no-such-backend")
    (row,) = d["rows"]
    assert row["median_s"] is None and row["vs_torch"] is None and "no-such-backend" in row["error"]


@pytest.mark.parametrize("args, says", [
    (["--systems", "lum,tensorrt"], "--systems"),
    (["--model", "no-such-model"], "--model"),
    (["--dtype", "f64"], "--dtype"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--prompt-len", "64", "--max-seq", "32"], "--max-seq"),
    (["--repeats", "0"], "--repeats"),
    (["--pkg", "/no/such.lumpkg"], "--pkg"),
    (["--prompt-len", "many"], "--prompt-len"),
])
def test_prefill_benchmark_rejects_bad_arguments(tmp_path, args, says):
    res = _cmd("--out", str(tmp_path), *args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefill.py: error:") and says in lines[0], res.stderr
    assert "Traceback" not in res.stderr and not list(tmp_path.iterdir())
