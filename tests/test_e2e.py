"""End to end on the CPU: HF folder → `lum build` → `lum run --backend reference` == transformers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.hf_checkpoints import save_hf_model

TINY = ["tiny-llama", "tiny-qwen3", "tiny-gemma3"]
PROMPT = [1, 5, 9, 3, 17, 100, 7, 8]
NEW = 8


def lum(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "lum.loader.cli", *args], capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"lum {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module", params=TINY)
def built(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, root / "hf")
    pkg = root / "model.lumpkg"
    lum("build", str(root / "hf"), "-o", str(pkg), "--max-seq", "64")
    return request.param, model, pkg


def test_build_then_run_gives_transformers_greedy_tokens(built):
    name, model, pkg = built
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)[0, len(PROMPT):].tolist()
    out = json.loads(lum("run", str(pkg), "--backend", "reference", "--tokens", ",".join(map(str, PROMPT)),
                         "--max-new-tokens", str(NEW), "--json").stdout)
    assert out["tokens"] == ref
    assert len(set(ref)) > 1
    assert out["tok_per_s"] > 0


def test_inspect_shows_kv_cache_in_place_and_arena_reuse(built):
    _, _, pkg = built
    info = json.loads(lum("inspect", str(pkg), "--dyn", "s=8,p=8", "--json").stdout)
    aliases = [a for g in info["groups"] for a in g["aliases"]]
    assert any(a["kind"] == "scatter_nocopy" and a["writes_into"].startswith(("k_cache", "v_cache"))
               for a in aliases), aliases
    for entry in info["entries"].values():
        plan = entry["buffer_plan"]
        assert 0 < plan["arena_bytes"] < plan["unshared_bytes"]
    lum("inspect", str(pkg))  # the table form renders too


def test_verify_and_corruption_gives_one_line_exit_2(built, tmp_path):
    _, _, pkg = built
    assert "OK" in lum("verify", str(pkg)).stdout
    data = bytearray(pkg.read_bytes())
    from lum.format.package import open_package

    with open_package(pkg) as reader:
        weights = [s for s in reader.sections if s.kind == "weight"]
    first, last = weights[0], max(weights, key=lambda s: s.stored_length)
    for where in (first.offset, last.offset + last.stored_length // 2):   # inside weight sections
        bad = tmp_path / "bad.lumpkg"
        flipped = bytearray(data)
        flipped[where] ^= 0x40
        bad.write_bytes(flipped)
        proc = lum("verify", str(bad), check=False)
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and "error:" in proc.stderr
    truncated = tmp_path / "short.lumpkg"
    truncated.write_bytes(data[: len(data) // 3])
    for cmd in (["run", str(truncated), "--tokens", "1,2"], ["inspect", str(truncated)], ["verify", str(truncated)]):
        proc = lum(*cmd, check=False)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_killed_build_leaves_no_file(tmp_path):
    """SIGKILL `lum build` while it writes a large package: nothing appears under the target name."""
    target = tmp_path / "big.lumpkg"
    proc = subprocess.Popen([sys.executable, "-m", "lum.loader.cli", "build", "--random", "llama3-1b", "-o",
                             str(target), "--max-seq", "16"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if any(p.name.endswith(".tmp") and p.stat().st_size > 1 << 20 for p in tmp_path.iterdir()):
            break
        if proc.poll() is not None:
            pytest.fail("build finished before it could be killed")
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("build never started writing")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not target.exists()


def test_loader_imports_stay_thin():
    code = ("import sys, lum.loader, lum.loader.model, lum.loader.reference_backend; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('egglog', 'torch', 'typer', 'transformers') "
            "or m.startswith('lum.builder')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_run_errors_are_one_line(built, tmp_path):
    _, _, pkg = built
    for args in (["run", str(pkg), "--prompt", "hi"],                       # no tokenizer in the package
                 ["run", str(pkg), "--tokens", "1,x"],
                 ["run", str(pkg), "--tokens", "1", "--max-new-tokens", "100000"],
                 ["run", str(tmp_path / "missing.lumpkg"), "--tokens", "1"],
                 ["inspect", str(pkg), "--dyn", "s=abc"]):
        proc = lum(*args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stderr.startswith("error:"), proc.stderr


def test_prompt_text_through_the_packaged_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_hf_model("tiny-llama", tmp_path / "hf")
    words = ["<unk>", "hello", "world", "lum", "runs", "models", "on", "gpus"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    pkg = tmp_path / "m.lumpkg"
    lum("build", str(tmp_path / "hf"), "-o", str(pkg), "--max-seq", "32")
    by_text = json.loads(lum("run", str(pkg), "--prompt", "hello world lum", "--max-new-tokens", "5",
                             "--backend", "reference", "--json").stdout)
    ids = tok.encode("hello world lum").ids
    by_ids = json.loads(lum("run", str(pkg), "--tokens", ",".join(map(str, ids)), "--max-new-tokens", "5",
                            "--backend", "reference", "--json").stdout)
    assert by_text["tokens"] == by_ids["tokens"] and len(by_text["tokens"]) == 5
    assert by_text["text"] == tok.decode(by_text["tokens"])
