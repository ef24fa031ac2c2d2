"""The .lumpkg container (lum.format.package): round trips, zero-copy views, alignment, determinism,
atomic writes, verification, versions and features (docs/FORMAT.md). The fuzz test is
tests/test_package_fuzz.py, which also holds the independent spec encoder used here."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import lum.format.package as package
from lum.format.errors import (
    IntegrityError, LumError, MissingSectionError, PackageFormatError, UnknownFeatureError,
    UnsupportedVersionError,
)
from lum.format.package import PackageWriter, open_package
from tests.test_package_fuzz import HDR, ENT, Sec, encode, manifest_section

RNG = np.random.default_rng(7)
W32 = RNG.standard_normal((33, 65)).astype(np.float32)
WBF = RNG.standard_normal((7, 129)).astype(ml_dtypes.bfloat16)


def build(path: Path, **kw) -> Path:
    w = PackageWriter(**kw)
    w.set_manifest({"target": {"sm": 90}, "entry_points": {"decode": {"inputs": [["b", "s"]]}}, "ü": "ok"})
    w.add_section("llir/0", json.dumps({"ops": list(range(300))}).encode(), kind="llir")
    w.add_section("weights/a", W32, codec="none", kind="weights")
    w.add_section("weights/b", WBF, codec="none", kind="weights")
    w.add_section("cubin/0", b"\x7fELF" + bytes(range(256)) * 3, codec="none", kind="cubin")
    w.add_section("streamed", lambda: (np.full(1000, i, np.int32) for i in range(10)), codec="none",
                  length=40000, kind="weights", align=65536)
    w.add_section("tuning", iter([b"a" * 100, memoryview(b"b" * 100)]), length=200, required=False, kind="tuning")
    w.add_section("empty", b"")
    return w.write(path)


def mmap_base(pkg) -> int:
    return np.frombuffer(pkg._mv, np.uint8).ctypes.data


def test_round_trip(tmp_path):
    p = build(tmp_path / "m.lumpkg")
    with open_package(p, verify="all") as pkg:
        assert pkg.version == (1, 0) and pkg.features == ()
        assert pkg.manifest == {"target": {"sm": 90}, "entry_points": {"decode": {"inputs": [["b", "s"]]}},
                                "ü": "ok", "lumpkg": {"format": "1.0", "features": []}}
        assert pkg.names() == ["manifest", "llir/0", "weights/a", "weights/b", "cubin/0", "streamed",
                               "tuning", "empty"]
        assert json.loads(pkg.section_bytes("llir/0")) == {"ops": list(range(300))}
        assert pkg.section("llir/0").codec == "zstd" and pkg.section("llir/0").kind == "llir"
        assert pkg.section_bytes("tuning") == b"a" * 100 + b"b" * 100
        assert not pkg.section("tuning").required and pkg.section("cubin/0").required
        assert pkg.section_bytes("empty") == b""
        assert bytes(pkg.section_view("cubin/0")) == b"\x7fELF" + bytes(range(256)) * 3
        a = pkg.array("weights/a", np.float32, W32.shape)
        b = pkg.array("weights/b", "bfloat16", WBF.shape)
        s = pkg.array("streamed", np.int32, (10, 1000))
        np.testing.assert_array_equal(a, W32)
        np.testing.assert_array_equal(b.view(np.uint16), WBF.view(np.uint16))
        np.testing.assert_array_equal(s, np.repeat(np.arange(10, dtype=np.int32), 1000).reshape(10, 1000))
        # zero-copy: the arrays point into the map, read-only
        base = mmap_base(pkg)
        for name, arr in (("weights/a", a), ("weights/b", b), ("streamed", s)):
            assert arr.ctypes.data == base + pkg.section(name).offset
            assert not arr.flags.writeable and not arr.flags.owndata
        sub = pkg.array("weights/a", np.float32, (65,), offset=65 * 4)
        np.testing.assert_array_equal(sub, W32[1])
        with pytest.raises(PackageFormatError, match="too few"):
            pkg.array("weights/a", np.float32, (34, 65))
        with pytest.raises(MissingSectionError, match="'nope'"):
            pkg.section_bytes("nope")
        with pytest.raises(ValueError, match="compressed"):
            pkg.section_view("llir/0")
        assert "weights/a" in pkg and "nope" not in pkg
    # views outlive close()
    np.testing.assert_array_equal(a, W32)
    assert pkg.closed


def test_alignment(tmp_path):
    p = build(tmp_path / "m.lumpkg")
    with open_package(p) as pkg:
        for s in pkg.sections:
            assert s.offset % s.align == 0
            if s.is_raw and s.name != "empty":
                assert s.align >= 4096 and s.offset % 4096 == 0, s
        assert pkg.section("streamed").offset % 65536 == 0
        spans = sorted((s.offset, s.offset + s.stored_length) for s in pkg.sections)
        assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))


def test_layout_matches_spec(tmp_path):
    """Decode the header and table with the struct layouts of docs/FORMAT.md, independently."""
    p = build(tmp_path / "m.lumpkg", features=["x-feature"])
    buf = p.read_bytes()
    magic, major, minor, count, size, ioff, ilen, esize, foff, flen, digest = HDR.unpack_from(buf, 0)
    assert (magic, major, minor, size, ioff, esize) == (b"\x89LUMPKG\n", 1, 0, len(buf), 96, 96)
    assert hashlib.sha256(buf[:64] + buf[ioff:ioff + ilen]).digest() == digest
    strings = buf[ioff + count * esize:ioff + ilen]
    assert strings[foff:foff + flen] == b"x-feature"
    with open_package(p, supported_features=["x-feature"]) as pkg:
        for i, s in enumerate(pkg.sections):
            off, stored, raw, noff, nlen, klen, koff, align, codec, flags, sha = ENT.unpack_from(buf, ioff + i * esize)
            assert strings[noff:noff + nlen].decode() == s.name and strings[koff:koff + klen].decode() == s.kind
            assert (off, stored, raw, align, codec, flags & 1) == (
                s.offset, s.stored_length, s.raw_length, s.align, {"none": 0, "zstd": 1}[s.codec], s.required)
            assert hashlib.sha256(buf[off:off + stored]).digest() == sha
        assert pkg.sections[0].name == "manifest" and pkg.sections[0].kind == "manifest"
        assert pkg.manifest["lumpkg"] == {"format": "1.0", "features": ["x-feature"]}


def test_deterministic(tmp_path):
    a = build(tmp_path / "a.lumpkg").read_bytes()
    b = build(tmp_path / "b.lumpkg").read_bytes()
    assert a == b
    # the same bytes whatever the data source (array, bytes, memoryview, chunks) and manifest key order
    def one(src, manifest, **kw):
        w = PackageWriter()
        w.set_manifest(manifest)
        w.add_section("w", src, codec="none", **kw)
        w.add_section("m", W32)
        return w.write(tmp_path / "x.lumpkg").read_bytes()

    x1 = one(W32, {"z": 1, "a": [1, 2]})
    x2 = one(W32.tobytes(), {"z": 1, "a": [1, 2]})
    x3 = one(memoryview(W32.tobytes()), {"z": 1, "a": [1, 2]})
    x4 = one(lambda: (W32[i] for i in range(W32.shape[0])), {"a": [1, 2], "z": 1}, length=W32.nbytes)
    assert x1 == x2 == x3 == x4


def test_fortran_and_strided_arrays(tmp_path):
    f = np.asfortranarray(W32)
    w = PackageWriter()
    w.set_manifest({})
    w.add_section("f", f, codec="none")
    w.add_section("strided", W32[:, ::2], codec="none")
    p = w.write(tmp_path / "m.lumpkg")
    with open_package(p) as pkg:
        np.testing.assert_array_equal(pkg.array("f", np.float32, W32.shape), W32)   # C order bytes
        np.testing.assert_array_equal(pkg.array("strided", np.float32, W32[:, ::2].shape), W32[:, ::2])


def _no_leftovers(d: Path, keep=()):
    return sorted(x.name for x in d.iterdir() if x.name not in keep)


def test_atomic_write_failure_leaves_nothing(tmp_path):
    def boom():
        yield b"x" * 5000
        raise RuntimeError("disk on fire")

    w = PackageWriter()
    w.set_manifest({})
    w.add_section("w", boom, codec="none", length=10000)
    with pytest.raises(RuntimeError, match="disk on fire"):
        w.write(tmp_path / "m.lumpkg")
    assert _no_leftovers(tmp_path) == []
    # a failure does not touch an existing package either
    good = build(tmp_path / "m.lumpkg").read_bytes()
    with pytest.raises(RuntimeError):
        w.write(tmp_path / "m.lumpkg")
    assert _no_leftovers(tmp_path) == ["m.lumpkg"] and (tmp_path / "m.lumpkg").read_bytes() == good
    # a source that gives the wrong number of bytes is an error, with no file left
    for chunks in ([b"x" * 10], [b"x" * 10001], [b"x" * 6000, b"y" * 6000]):
        w = PackageWriter()
        w.set_manifest({})
        w.add_section("w", chunks, codec="none", length=10000)
        with pytest.raises(ValueError, match="length=10000"):
            w.write(tmp_path / "n.lumpkg")
        assert _no_leftovers(tmp_path) == ["m.lumpkg"]


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from lum.format.package import PackageWriter
    def chunks():
        for i in range(1000):
            if i == 3:
                print("writing", flush=True)
                time.sleep(60)
            yield np.full(1 << 18, i, np.float32)
    w = PackageWriter()
    w.set_manifest({"m": 1})
    w.add_section("weights", chunks, codec="none", length=1000 << 20)
    w.write(sys.argv[1])
""")


@pytest.mark.parametrize("existing", [False, True])
def test_killed_writer_leaves_no_file_under_target(tmp_path, existing):
    target = tmp_path / "m.lumpkg"
    if existing:
        old = build(target).read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", proc.stderr.read()
        tmps = [x for x in tmp_path.iterdir() if x.name.endswith(".tmp")]
        assert len(tmps) == 1 and tmps[0].stat().st_size > 0      # the temp file is being written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    if existing:
        assert target.read_bytes() == old
        open_package(target, verify="all").close()
    else:
        assert not target.exists()


def test_streaming_does_not_hold_section_in_memory(tmp_path):
    n_chunks, chunk = 32, 1 << 20

    def chunks():
        for i in range(n_chunks):
            yield np.full(chunk // 4, i, np.float32)

    w = PackageWriter()
    w.set_manifest({})
    w.add_section("weights", chunks, codec="none", length=n_chunks * chunk)
    tracemalloc.start()
    try:
        w.write(tmp_path / "big.lumpkg")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * chunk, peak
    with open_package(tmp_path / "big.lumpkg", verify="all") as pkg:
        assert pkg.array("weights", np.float32, (n_chunks, chunk // 4))[31, 5] == 31


def flip(path: Path, pos: int, bit: int = 0) -> None:
    b = bytearray(path.read_bytes())
    b[pos] ^= 1 << bit
    path.write_bytes(b)


def test_verify_all_detects_flip_in_raw_section(tmp_path):
    p = build(tmp_path / "m.lumpkg")
    with open_package(p) as pkg:
        s = pkg.section("weights/a")
    flip(p, s.offset + 17, 3)
    for mode in ("none", "metadata"):
        with open_package(p, verify=mode) as pkg:     # opens: raw data is not hashed on every open
            assert not np.array_equal(pkg.array("weights/a", np.float32, W32.shape), W32)
            with pytest.raises(IntegrityError, match="'weights/a' hash mismatch"):
                pkg.verify()
            pkg.verify(["weights/b", "llir/0"])
    with pytest.raises(IntegrityError, match=r"m\.lumpkg: section 'weights/a' hash mismatch"):
        open_package(p, verify="all")


def test_flip_in_metadata_detected_on_every_open(tmp_path):
    p = build(tmp_path / "m.lumpkg")
    with open_package(p) as pkg:
        s = pkg.section("llir/0")
    flip(p, s.offset + s.stored_length // 2)
    with pytest.raises(IntegrityError, match="'llir/0' hash mismatch"):
        open_package(p)
    flip(p, s.offset + s.stored_length // 2)
    flip(p, 20)                                      # the header's file_size: caught as corruption
    with pytest.raises(PackageFormatError):
        open_package(p)
    flip(p, 20)
    flip(p, 96 + 8)                                  # the table: the index hash
    with pytest.raises(IntegrityError, match="index hash mismatch"):
        open_package(p)


def test_error_messages_are_one_line_with_path(tmp_path):
    p = tmp_path / "bad.lumpkg"
    for data, cls, text in ((b"", PackageFormatError, "truncated: 0 bytes"),
                            (b"PK\x03\x04" + bytes(200), PackageFormatError, "not a lum package"),
                            (build(tmp_path / "m.lumpkg").read_bytes()[:-1], PackageFormatError,
                             "truncated: the header says")):
        p.write_bytes(data)
        with pytest.raises(cls) as ei:
            open_package(p)
        msg = str(ei.value)
        assert msg.startswith(f"{p}: ") and text in msg and "\n" not in msg
        assert isinstance(ei.value, LumError) and ei.value.path == str(p)
    with pytest.raises(FileNotFoundError):
        open_package(tmp_path / "missing.lumpkg")


def test_versions(tmp_path, monkeypatch):
    monkeypatch.setattr(package, "FORMAT_MINOR", 9)      # a newer minor: accepted
    build(tmp_path / "minor.lumpkg")
    monkeypatch.setattr(package, "FORMAT_MAJOR", 2)      # a newer major: refused
    build(tmp_path / "major.lumpkg")
    monkeypatch.undo()
    with open_package(tmp_path / "minor.lumpkg", verify="all") as pkg:
        assert pkg.version == (1, 9) and pkg.manifest["lumpkg"]["format"] == "1.9"
    with pytest.raises(UnsupportedVersionError, match=r"format 2\.9 is not supported.*upgrade lum"):
        open_package(tmp_path / "major.lumpkg")
    # an older minor than the reader's and a larger table entry (a newer minor may extend entries)
    p = tmp_path / "wide.lumpkg"
    p.write_bytes(encode([manifest_section({"x": 1}, "1.4"), Sec("w", b"abc", align=4096)], minor=4,
                         entry_size=160))
    with open_package(p, verify="all") as pkg:
        assert pkg.section_bytes("w") == b"abc" and pkg.manifest["x"] == 1


def test_required_features(tmp_path):
    p = build(tmp_path / "m.lumpkg", features=["paged-kv", "bf16-weights"])
    with pytest.raises(UnknownFeatureError, match="requires feature.*bf16-weights, paged-kv"):
        open_package(p)
    with open_package(p, supported_features=["bf16-weights", "paged-kv", "other"]) as pkg:
        assert pkg.features == ("bf16-weights", "paged-kv")
        assert pkg.manifest["lumpkg"]["features"] == ["bf16-weights", "paged-kv"]
    with pytest.raises(ValueError, match="invalid feature"):
        PackageWriter(features=["Bad Feature"])


def test_known_kinds_and_optional_sections(tmp_path):
    p = build(tmp_path / "m.lumpkg")
    kinds = {"manifest", "llir", "weights", "cubin", ""}
    with open_package(p, known_kinds=kinds) as pkg:          # "tuning" is optional: skipped, not refused
        assert pkg.section("tuning").kind == "tuning"
    with pytest.raises(UnknownFeatureError, match="'cubin/0' has kind 'cubin'"):
        open_package(p, known_kinds=kinds - {"cubin"})
    # an unknown codec is refused on a required section, tolerated (but unreadable) on an optional one
    m = manifest_section({})
    p.write_bytes(encode([m, Sec("x", b"abc", codec=5, flags=0)]))
    with open_package(p) as pkg:
        assert pkg.section("x").codec == "unknown(5)"
        with pytest.raises(UnknownFeatureError):
            pkg.section_bytes("x")
    p.write_bytes(encode([m, Sec("x", b"abc", codec=5)]))
    with pytest.raises(UnknownFeatureError, match="codec 5"):
        open_package(p)


def test_zstd_limits(tmp_path):
    # a highly compressible section would break the reader's ratio limit: the writer stores it raw
    w = PackageWriter()
    w.set_manifest({})
    w.add_section("zeros", bytes(1 << 22))
    w.add_section("text", b"abc" * 1000)
    p = w.write(tmp_path / "m.lumpkg")
    with open_package(p) as pkg:
        assert pkg.section("zeros").codec == "none" and pkg.section_bytes("zeros") == bytes(1 << 22)
        assert pkg.section("text").codec == "zstd"
    # a forged bomb (true frame, 16 MiB from a few hundred bytes) is refused before decompression
    import zstandard
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))
    p.write_bytes(encode([manifest_section({}), Sec("b", bomb, codec=1, raw_length=1 << 24)]))
    tracemalloc.start()
    try:
        with pytest.raises(PackageFormatError, match="declared size 16777216 is too large"):
            open_package(p, verify="none")
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_writer_rejects_misuse(tmp_path):
    w = PackageWriter()
    with pytest.raises(ValueError, match="set_manifest"):
        w.write(tmp_path / "m.lumpkg")
    with pytest.raises(ValueError, match="reserved"):
        w.set_manifest({"lumpkg": 1})
    with pytest.raises(ValueError, match="JSON"):
        w.set_manifest({"x": float("nan")})
    with pytest.raises(ValueError, match="JSON"):
        w.set_manifest({"x": object()})
    w.add_section("a", b"")
    for kw, msg in ((dict(name="a", data=b""), "duplicate"), (dict(name="manifest", data=b""), "set_manifest"),
                    (dict(name="has space", data=b""), "invalid section name"),
                    (dict(name="b", data=b"", codec="lz4"), "unknown codec"),
                    (dict(name="b", data=b"", align=3), "power of two"),
                    (dict(name="b", data=iter([b""])), "length="),
                    (dict(name="b", data=b"xy", length=3), "length=3")):
        with pytest.raises(ValueError, match=msg):
            w.add_section(**kw)
    assert _no_leftovers(tmp_path) == []


def test_manifest_is_a_private_copy(tmp_path):
    m = {"a": [1, 2]}
    w = PackageWriter()
    w.set_manifest(m)
    m["a"].append(3)
    with open_package(w.write(tmp_path / "m.lumpkg")) as pkg:
        assert pkg.manifest["a"] == [1, 2]


def test_large_alignment_and_zstd_chunk_sources(tmp_path):
    w = PackageWriter()
    w.set_manifest({})
    w.add_section("meta", lambda: [b'{"a":', np.frombuffer(b"1}", np.uint8)], length=7)
    w.add_section("huge-align", b"x", codec="none", align=1 << 22)
    w.add_section("bad-meta", [b"abc"], length=4)
    with pytest.raises(ValueError, match="gave 3 bytes, length=4"):
        w.write(tmp_path / "m.lumpkg")
    w = PackageWriter()
    w.set_manifest({})
    w.add_section("meta", lambda: [b'{"a":', np.frombuffer(b"1}", np.uint8)], length=7)
    w.add_section("huge-align", b"x", codec="none", align=1 << 22)
    with open_package(w.write(tmp_path / "m.lumpkg"), verify="all") as pkg:
        assert pkg.section_bytes("meta") == b'{"a":1}'
        assert pkg.section("huge-align").offset == 1 << 22 and pkg.section_bytes("huge-align") == b"x"


def test_write_reports_its_progress_by_section_bytes(tmp_path):
    """``write(progress=)``: the sections' declared bytes, from 0 to the total, never going back."""
    w = PackageWriter()
    w.add_section("a", b"x" * 1000)
    w.add_section("w", lambda: iter([np.ones(512, np.float32)] * 3), codec="none", length=3 * 2048)
    w.set_manifest({"k": 1})
    seen = []
    w.write(tmp_path / "p.lumpkg", progress=lambda done, total: seen.append((done, total)))
    assert seen[0] == (0, 1000 + 3 * 2048) and seen[-1] == (1000 + 3 * 2048,) * 2
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
