"""benchmarks/ncu_decode.py: the ncu details page read into a record's rows (from the committed details of
2026-12-03, gemma3-4b's step: the embedding group, then two layers), and a clear error without ncu."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import ncu_decode  # noqa: E402

DETAILS = BENCH / "results" / "ncu-decode-gemma3-4b-bf16-2026-12-03-809809d-details.csv"


def test_details_become_one_row_a_kernel():
    rows = ncu_decode.kernels_from_details(DETAILS.read_text())
    assert [r["id"] for r in rows] == list(range(20))
    stage = rows[3]
    assert "scatternocopy_stage" in stage["kernel"] and stage["grid"] == 8 and stage["block"] == 128
    assert stage["registers"] == 128 and stage["us"] == pytest.approx(8.29)
    # 796 active cycles on average over 132 SMs, 8 of which ran a block
    assert stage["sm_cycles"] == round(stage["sm_active_cycles_avg"] * 132 / 8) and 12_000 < stage["sm_cycles"] < 14_000
    gate_up = rows[7]
    assert gate_up["grid"] == 5120 and gate_up["sm_cycles"] == round(gate_up["sm_active_cycles_avg"])
    assert gate_up["dram_pct"] > 70 and all(r["us"] > 0 for r in rows)


def test_other_csv_is_refused():
    with pytest.raises(ValueError, match="not an ncu details CSV"):
        ncu_decode.kernels_from_details("a,b\n1,2\n")


def test_without_ncu_the_cli_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(ncu_decode.shutil, "which", lambda name: None)
    monkeypatch.setattr(ncu_decode, "NCU_DIRS", (tmp_path / "nowhere",))
    with pytest.raises(SystemExit, match="ncu .* not found"):
        ncu_decode.main(["--model", "tiny-llama", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--kernels"):
        ncu_decode.main(["--kernels", "0"])
