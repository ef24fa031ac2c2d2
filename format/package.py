"""The ``.lumpkg`` container: a fixed header, an index of sections, then the sections (docs/FORMAT.md).

This module knows nothing of what the sections mean (the manifest content, LLIR, cubins, weights belong
to the layers above); it stores named byte strings, zstd-compressed or raw and aligned, each with a
SHA-256, and a JSON manifest inside a small envelope. Writing is atomic and deterministic; reading maps
the file, checks every length and offset against the file size before it allocates anything, and gives
raw sections out as zero-copy views of the map.

    w = PackageWriter()
    w.set_manifest({"entry_points": {...}})
    w.add_section("llir/0", llir_json_bytes, kind="llir")                   # zstd
    w.add_section("weights", array_chunks, codec="none", length=n, kind="weights")   # streamed, 4096-aligned
    w.write("model.lumpkg")

    with open_package("model.lumpkg") as pkg:       # verify="metadata": index + zstd sections hashed
        pkg.manifest, pkg.section_bytes("llir/0"), pkg.array("weights", "float16", (4096, 4096))
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator, Optional, Union

import numpy as np
import zstandard

from lum.format.atomic import atomic_file

from lum.format.errors import (
    IntegrityError,
    MissingSectionError,
    PackageFormatError,
    UnknownFeatureError,
    UnsupportedVersionError,
)

__all__ = [
    "FORMAT_MAJOR", "FORMAT_MINOR", "MAGIC", "SUPPORTED_FEATURES",
    "PackageWriter", "PackageReader", "SectionInfo", "open_package",
]

# ----------------------------------------------------------------------------------------- constants
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
MAGIC = b"\x89LUMPKG\n"

#: Required-feature strings this reader implements (none yet: format 1.0 needs none).
SUPPORTED_FEATURES: frozenset = frozenset()

HEADER_SIZE = 96
HASHED_HEADER = 64          # header bytes [0, 64) are covered by the index hash; [64, 96) is that hash
ENTRY_SIZE = 96             # v1.0 entry; readers accept larger (newer minors) and ignore the tail
MAX_ENTRY_SIZE = 4096
MAX_SECTIONS = 1 << 20
MAX_NAME = 1024
MAX_KIND = 64
MAX_FEATURE = 64
MAX_FEATURES = 256
MAX_ALIGN = 1 << 30

CODEC_NONE = 0
CODEC_ZSTD = 1
CODECS = {CODEC_NONE: "none", CODEC_ZSTD: "zstd"}
CODEC_IDS = {v: k for k, v in CODECS.items()}
FLAG_REQUIRED = 0x01

ZSTD_LEVEL = 10
#: A zstd section's declared raw length is refused above this hard cap …
MAX_ZSTD_RAW = 1 << 30
#: … and above ``MAX_ZSTD_RATIO * stored_length + ZSTD_SLACK`` (a decompression bomb cannot make a
#: reader allocate more than that). The writer stores a section raw when zstd would exceed either.
MAX_ZSTD_RATIO = 256
ZSTD_SLACK = 1 << 16
ZSTD_MAX_WINDOW = 1 << 27

DEFAULT_RAW_ALIGN = 4096
DEFAULT_ZSTD_ALIGN = 8
MAX_JSON_DEPTH = 64
MANIFEST = "manifest"
ENVELOPE_KEY = "lumpkg"

_HEADER = struct.Struct("<8sHHIQQQIII12x32s")   # 96 bytes
_ENTRY = struct.Struct("<QQQIHHIIBB6x32s16x")   # 96 bytes
assert _HEADER.size == HEADER_SIZE and _ENTRY.size == ENTRY_SIZE

_NAME_RE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_NAME)
_KIND_RE = re.compile(rb"[\x21-\x7e]{0,%d}" % MAX_KIND)
_FEATURE_RE = re.compile(rb"[a-z0-9][a-z0-9._-]{0,%d}" % (MAX_FEATURE - 1))

VERIFY_MODES = ("none", "metadata", "all")

ChunkSource = Union[bytes, bytearray, memoryview, np.ndarray, Iterable[Any], Callable[[], Iterable[Any]]]


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _as_bytes_view(chunk: Any) -> memoryview:
    """A flat byte view of a bytes-like object or numpy array (copies only a non-contiguous input)."""
    if isinstance(chunk, np.ndarray):
        if chunk.dtype.hasobject:
            raise TypeError("cannot store a numpy array of Python objects")
        a = np.ascontiguousarray(chunk)
        return memoryview(a.reshape(-1).view(np.uint8))
    try:
        mv = memoryview(chunk)
    except TypeError:
        raise TypeError(f"section data chunk must be bytes-like or a numpy array, not {type(chunk).__name__}") from None
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def _static_length(data: Any) -> Optional[int]:
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    return None


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


# ----------------------------------------------------------------------------------------- writer
@dataclass
class _PendingSection:
    name: str
    data: Any
    codec: str
    align: int
    required: bool
    kind: str
    length: Optional[int]


class PackageWriter:
    """Collects sections and a manifest, then :meth:`write` s them to a file atomically.

    The bytes written depend only on what was added (order included) and on the zstd library's output for
    level :data:`ZSTD_LEVEL`: no timestamps, no paths, no randomness.
    """

    def __init__(self, *, features: Iterable[str] = ()) -> None:
        self._sections: list[_PendingSection] = []
        self._names: set[str] = set()
        self._manifest: Optional[dict] = None
        self._features: set[str] = set()
        for f in features:
            self.require_feature(f)

    # -- building
    def require_feature(self, name: str) -> None:
        """Record a required feature: readers that do not implement ``name`` refuse the package."""
        if not isinstance(name, str) or not _FEATURE_RE.fullmatch(name.encode("ascii", "replace")):
            raise ValueError(f"invalid feature name {name!r}: lower-case [a-z0-9._-], 1..{MAX_FEATURE} chars, "
                             "starting with a letter or digit")
        self._features.add(name)
        if len(self._features) > MAX_FEATURES:
            raise ValueError(f"more than {MAX_FEATURES} required features")

    def set_manifest(self, manifest: dict) -> None:
        """Set the manifest: a JSON-serialisable dict, stored as canonical JSON in the zstd section
        ``"manifest"``. The key ``"lumpkg"`` is reserved for the envelope the writer adds."""
        if not isinstance(manifest, dict):
            raise TypeError(f"manifest must be a dict, not {type(manifest).__name__}")
        if ENVELOPE_KEY in manifest:
            raise ValueError(f"manifest key {ENVELOPE_KEY!r} is reserved for the package envelope")
        try:
            encoded = _canonical_json(manifest)
        except (TypeError, ValueError) as e:
            raise ValueError(f"manifest is not JSON-serialisable: {e}") from None
        self._manifest = json.loads(encoded)    # a private deep copy, as it will be read back

    def add_section(self, name: str, data: ChunkSource, *, codec: str = "zstd", align: Optional[int] = None,
                    required: bool = True, kind: str = "", length: Optional[int] = None) -> None:
        """Add a section.

        ``data`` is bytes-like, a numpy array (its bytes in C order), an iterable of such chunks, or a
        callable returning one (called at write time; chunks are written one by one, so a multi-GB weights
        section is never held twice). Iterables and callables need ``length``, the total byte count.
        ``codec`` is ``"zstd"`` (default; metadata) or ``"none"`` (stored as is at an offset that is a
        multiple of ``align``, default 4096, so it can be used in place from a memory map).
        """
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name.encode("utf-8")):
            raise ValueError(f"invalid section name {name!r}: 1..{MAX_NAME} printable ASCII characters, no space")
        if name == MANIFEST:
            raise ValueError("the 'manifest' section is written by set_manifest()")
        if name in self._names:
            raise ValueError(f"duplicate section name {name!r}")
        if codec not in CODEC_IDS:
            raise ValueError(f"unknown codec {codec!r}; expected 'zstd' or 'none'")
        if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind.encode("utf-8")):
            raise ValueError(f"invalid section kind {kind!r}: 0..{MAX_KIND} printable ASCII characters")
        if align is None:
            align = DEFAULT_RAW_ALIGN if codec == "none" else DEFAULT_ZSTD_ALIGN
        if not isinstance(align, int) or not _is_pow2(align) or align > MAX_ALIGN:
            raise ValueError(f"align must be a power of two <= {MAX_ALIGN}, not {align!r}")
        static = _static_length(data)
        if static is not None:
            if length is not None and length != static:
                raise ValueError(f"section {name!r}: length={length} but the data has {static} bytes")
            length = static
        elif length is None:
            raise ValueError(f"section {name!r}: an iterable or callable data source needs length=")
        elif not isinstance(length, int) or length < 0:
            raise ValueError(f"section {name!r}: length must be a non-negative int")
        self._names.add(name)
        self._sections.append(_PendingSection(name, data, codec, align, bool(required), kind, length))

    # -- writing
    def write(self, path: Union[str, os.PathLike],
              progress: Optional[Callable[[int, int], None]] = None) -> Path:
        """Write the package to ``path`` atomically: a temporary file in the same directory, written,
        flushed and fsynced, renamed over ``path``, then the directory fsynced. On any failure the
        temporary file is removed and ``path`` is untouched. Returns ``path``. ``progress(done, total)``
        is called with the sections' declared bytes written so far, after each section (a model's weights
        take minutes to make and write)."""
        if self._manifest is None:
            raise ValueError("set_manifest() was not called")
        path = Path(path)
        with atomic_file(path, buffering=1 << 20) as f:
            self._write_to(f, progress)
        return path

    def _plan(self) -> tuple[list[_PendingSection], bytes, list[tuple[int, int, int, int]]]:
        envelope = {"format": f"{FORMAT_MAJOR}.{FORMAT_MINOR}", "features": sorted(self._features)}
        manifest = dict(self._manifest)
        manifest[ENVELOPE_KEY] = envelope
        sections = [_PendingSection(MANIFEST, _canonical_json(manifest), "zstd", DEFAULT_ZSTD_ALIGN, True,
                                    MANIFEST, None)] + self._sections
        strings = bytearray()
        refs = []

        def put(b: bytes) -> int:
            off = len(strings)
            strings.extend(b)
            return off

        feats = "\n".join(sorted(self._features)).encode("ascii")
        feat_ref = (put(feats), len(feats))
        for s in sections:
            n, k = s.name.encode(), s.kind.encode()
            refs.append((put(n), len(n), put(k), len(k)))
        return sections, bytes(strings), [feat_ref] + refs

    def _write_to(self, f, progress: Optional[Callable[[int, int], None]] = None) -> None:
        sections, strings, refs = self._plan()
        feat_ref, refs = refs[0], refs[1:]
        total, done = sum(s.length or 0 for s in sections), 0
        if progress:
            progress(0, total)
        index_len = len(sections) * ENTRY_SIZE + len(strings)
        pos = HEADER_SIZE + index_len
        _write_zeros(f, pos)                      # header + index, rewritten at the end
        entries = []
        for s, (noff, nlen, koff, klen) in zip(sections, refs):
            codec, payload = s.codec, None
            raw_len = s.length
            if codec == "zstd":
                raw = b"".join(bytes(_as_bytes_view(c)) for c in _chunks(s)) if not isinstance(s.data, bytes) \
                    else s.data
                raw_len = len(raw)
                if s.length is not None and raw_len != s.length:
                    raise ValueError(f"section {s.name!r}: the data source gave {raw_len} bytes, "
                                     f"length={s.length} was declared")
                payload = _compress(raw)
                if raw_len > MAX_ZSTD_RAW or raw_len > MAX_ZSTD_RATIO * len(payload) + ZSTD_SLACK:
                    codec, payload = "none", raw    # zstd would exceed the reader's limits: store raw
            start = _align_up(pos, s.align)
            _write_zeros(f, start - pos)
            h = hashlib.sha256()
            if payload is not None:
                f.write(payload)
                h.update(payload)
                stored = len(payload)
            else:
                stored = 0
                for chunk in _chunks(s):
                    mv = _as_bytes_view(chunk)
                    stored += mv.nbytes
                    if stored > s.length:
                        break
                    f.write(mv)
                    h.update(mv)
                if stored != s.length:
                    got = f"more than {s.length}" if stored > s.length else f"only {stored}"
                    raise ValueError(f"section {s.name!r}: the data source gave {got} bytes, "
                                     f"length={s.length} was declared")
            pos = start + stored
            flags = FLAG_REQUIRED if s.required else 0
            done += s.length or 0
            if progress:
                progress(done, total)
            entries.append(_ENTRY.pack(start, stored, raw_len if codec == "zstd" else stored, noff, nlen, klen,
                                       koff, s.align, CODEC_IDS[codec], flags, h.digest()))
        index = b"".join(entries) + strings
        assert len(index) == index_len
        head = _HEADER.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR, len(sections), pos, HEADER_SIZE, index_len,
                            ENTRY_SIZE, feat_ref[0], feat_ref[1], b"\0" * 32)
        digest = hashlib.sha256(head[:HASHED_HEADER] + index).digest()
        f.seek(0)
        f.write(head[:HASHED_HEADER] + digest + index)
        f.seek(pos)
        f.truncate()


def _chunks(s: _PendingSection) -> Iterator[Any]:
    data = s.data
    if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
        yield data
        return
    if callable(data):
        data = data()
    try:
        it = iter(data)
    except TypeError:
        raise TypeError(f"section {s.name!r}: data must be bytes-like, a numpy array, an iterable of chunks "
                        f"or a callable returning one, not {type(data).__name__}") from None
    yield from it


def _write_zeros(f, n: int) -> None:
    block = bytes(min(n, 1 << 20))
    while n > 0:
        f.write(block[:n] if n < len(block) else block)
        n -= len(block)


def _compress(raw: bytes) -> bytes:
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True, threads=0)
    return cctx.compress(raw)


# ----------------------------------------------------------------------------------------- reader
@dataclass(frozen=True, slots=True)
class SectionInfo:
    """One entry of the section table, as validated by the reader."""

    name: str
    kind: str
    codec: str            # "none" | "zstd" | "unknown(<id>)" (only for optional sections)
    offset: int           # absolute file offset of the stored bytes
    stored_length: int    # bytes in the file
    raw_length: int       # bytes after decompression (== stored_length for "none")
    align: int
    required: bool
    sha256: bytes         # of the stored bytes

    @property
    def is_raw(self) -> bool:
        return self.codec == "none"


class PackageReader:
    """An open ``.lumpkg`` file. Use :func:`open_package`; close it (or use ``with``) when done.

    ``verify``: ``"metadata"`` (default) checks the index hash and the hash of every compressed section
    on open; ``"all"`` also hashes every raw section (what ``lum verify`` does); ``"none"`` checks only
    structure (lengths, offsets, overlaps, alignment) — corrupted data may then surface later as a
    :class:`PackageFormatError` or as wrong values.
    Views and arrays given out stay valid after :meth:`close` as long as they are referenced.
    """

    def __init__(self, path: Union[str, os.PathLike], verify: str = "metadata", *,
                 supported_features: Iterable[str] = (), known_kinds: Optional[Collection[str]] = None) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
        self.path = os.fspath(path)
        self.verify_mode = verify
        self._mm: Optional[mmap.mmap] = None
        self._mv: Optional[memoryview] = None
        self._manifest: Optional[dict] = None
        if not stat.S_ISREG(os.stat(self.path).st_mode):
            raise self._fmt("not a regular file")
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_SIZE:
                raise self._fmt(f"truncated: {size} bytes, a package header needs {HEADER_SIZE}")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._mv = memoryview(self._mm)
        self.file_size = len(self._mm)
        try:
            self._open(verify, frozenset(SUPPORTED_FEATURES) | frozenset(supported_features), known_kinds)
        except BaseException:
            self.close()
            raise

    # -- errors
    def _fmt(self, msg: str) -> PackageFormatError:
        return PackageFormatError(msg, path=self.path)

    # -- parsing
    def _open(self, verify: str, supported: frozenset, known_kinds: Optional[Collection[str]]) -> None:
        mv, size = self._mv, self.file_size
        (magic, major, minor, count, file_size, ioff, ilen, esize, foff, flen, digest) = \
            _HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise self._fmt(f"not a lum package (magic {bytes(magic)!r}, expected {MAGIC!r})")
        if major != FORMAT_MAJOR:
            raise UnsupportedVersionError(
                f"package format {major}.{minor} is not supported: this reader implements format "
                f"{FORMAT_MAJOR}.x" + (" (upgrade lum)" if major > FORMAT_MAJOR else ""), path=self.path)
        self.version = (major, minor)
        if file_size != size:
            what = "truncated" if size < file_size else "has trailing data"
            raise self._fmt(f"{what}: the header says {file_size} bytes, the file has {size}")
        if ioff < HEADER_SIZE or ioff > size or ilen > size - ioff:
            raise self._fmt(f"index [{ioff}, +{ilen}) lies outside the file ({size} bytes)")
        if esize < ENTRY_SIZE or esize > MAX_ENTRY_SIZE or esize % 8:
            raise self._fmt(f"invalid section entry size {esize}")
        if count > MAX_SECTIONS or count * esize > ilen:
            raise self._fmt(f"section count {count} does not fit the index ({ilen} bytes)")
        index = mv[ioff:ioff + ilen]
        try:
            if verify != "none":
                h = hashlib.sha256(mv[:HASHED_HEADER])
                h.update(index)
                if h.digest() != bytes(digest):
                    raise IntegrityError("index hash mismatch (header or section table corrupted)",
                                         path=self.path)
            self._parse_index(index, count, esize, foff, flen, ioff + ilen, supported, known_kinds)
        finally:
            index.release()
        if MANIFEST not in self._by_name:
            raise MissingSectionError("package has no 'manifest' section", path=self.path)
        if verify != "none":
            for s in self.sections:
                if verify == "all" or not s.is_raw:
                    self._check_hash(s)
        self._manifest = self._parse_manifest()

    def _parse_index(self, index: memoryview, count: int, esize: int, foff: int, flen: int, data_start: int,
                     supported: frozenset, known_kinds: Optional[Collection[str]]) -> None:
        size = self.file_size
        sbase = count * esize
        strings_len = len(index) - sbase

        def string(off: int, n: int, what: str) -> bytes:
            if off > strings_len or n > strings_len - off:
                raise self._fmt(f"{what} [{off}, +{n}) lies outside the string table ({strings_len} bytes)")
            return bytes(index[sbase + off:sbase + off + n])

        # required features
        if flen > MAX_FEATURES * (MAX_FEATURE + 1):
            raise self._fmt(f"feature list too long ({flen} bytes)")
        feats_raw = string(foff, flen, "feature list")
        feats = feats_raw.split(b"\n") if feats_raw else []
        for ft in feats:
            if not _FEATURE_RE.fullmatch(ft):
                raise self._fmt(f"invalid feature name {ft[:MAX_FEATURE]!r}")
        if feats != sorted(set(feats)):
            raise self._fmt("feature list is not sorted and unique")
        self.features = tuple(ft.decode("ascii") for ft in feats)
        unknown = [ft for ft in self.features if ft not in supported]
        if unknown:
            raise UnknownFeatureError(f"package requires feature(s) {', '.join(unknown)} that this reader "
                                      "does not support (upgrade lum)", path=self.path)

        # section table
        sections: list[SectionInfo] = []
        by_name: dict[str, SectionInfo] = {}
        for i in range(count):
            (off, stored, raw, noff, nlen, klen, koff, align, codec, flags, sha) = \
                _ENTRY.unpack_from(index, i * esize)
            nb = string(noff, nlen, f"name of section #{i}")
            if not _NAME_RE.fullmatch(nb):
                raise self._fmt(f"section #{i} has an invalid name {nb[:64]!r}")
            name = nb.decode("ascii")
            kb = string(koff, klen, f"kind of section {name!r}")
            if not _KIND_RE.fullmatch(kb):
                raise self._fmt(f"section {name!r} has an invalid kind {kb[:64]!r}")
            kind = kb.decode("ascii")
            required = bool(flags & FLAG_REQUIRED)
            if name in by_name:
                raise self._fmt(f"duplicate section {name!r}")
            if not _is_pow2(align) or align > MAX_ALIGN:
                raise self._fmt(f"section {name!r}: invalid alignment {align}")
            if off < data_start or off > size or stored > size - off:
                raise self._fmt(f"section {name!r} [{off}, +{stored}) lies outside the data area "
                                f"[{data_start}, {size})")
            if off % align:
                raise self._fmt(f"section {name!r} at offset {off} is not aligned to {align}")
            if codec == CODEC_NONE:
                if raw != stored:
                    raise self._fmt(f"raw section {name!r}: raw length {raw} != stored length {stored}")
            elif codec == CODEC_ZSTD:
                if raw > MAX_ZSTD_RAW or raw > MAX_ZSTD_RATIO * stored + ZSTD_SLACK:
                    raise self._fmt(f"zstd section {name!r}: declared size {raw} is too large for "
                                    f"{stored} compressed bytes (limit {MAX_ZSTD_RATIO}x + {ZSTD_SLACK}, "
                                    f"at most {MAX_ZSTD_RAW})")
            elif required:
                raise UnknownFeatureError(f"required section {name!r} uses codec {codec}, unknown to this "
                                          "reader (upgrade lum)", path=self.path)
            if required and known_kinds is not None and kind not in known_kinds:
                raise UnknownFeatureError(f"required section {name!r} has kind {kind!r}, unknown to this "
                                          "reader (upgrade lum)", path=self.path)
            info = SectionInfo(name, kind, CODECS.get(codec, f"unknown({codec})"), off, stored,
                               raw if codec != CODEC_NONE else stored, align, required, bytes(sha))
            sections.append(info)
            by_name[name] = info
        spans = sorted((s.offset, s.offset + s.stored_length, s.name) for s in sections if s.stored_length)
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise self._fmt(f"sections {an!r} and {bn!r} overlap")
        self.sections: tuple[SectionInfo, ...] = tuple(sections)
        self._by_name = by_name

    def _check_hash(self, s: SectionInfo) -> None:
        with self._mv[s.offset:s.offset + s.stored_length] as data:
            ok = hashlib.sha256(data).digest() == s.sha256
        if not ok:
            raise IntegrityError(f"section {s.name!r} hash mismatch (corrupted data)", path=self.path)

    def _parse_manifest(self) -> dict:
        raw = self.section_bytes(MANIFEST)
        try:
            text = raw.decode("utf-8")
            obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise self._fmt(f"manifest is not valid JSON: {' '.join(str(e).split())[:200]}") from None
        if not isinstance(obj, dict):
            raise self._fmt(f"manifest is a JSON {type(obj).__name__}, expected an object")
        if _depth_exceeds(obj, MAX_JSON_DEPTH):
            raise self._fmt(f"manifest nests deeper than {MAX_JSON_DEPTH} levels")
        env = obj.get(ENVELOPE_KEY)
        if not isinstance(env, dict):
            raise self._fmt(f"manifest has no {ENVELOPE_KEY!r} envelope object")
        want_version = f"{self.version[0]}.{self.version[1]}"
        if env.get("format") != want_version or env.get("features") != list(self.features):
            raise self._fmt(f"manifest envelope (format {env.get('format')!r}, features {env.get('features')!r}) "
                            f"disagrees with the header (format {want_version!r}, features {list(self.features)!r})")
        return obj

    # -- access
    @property
    def manifest(self) -> dict:
        """The manifest dict (including the ``"lumpkg"`` envelope). Do not mutate it."""
        return self._manifest

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        return [s.name for s in self.sections]

    def section(self, name: str) -> SectionInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise MissingSectionError(f"no section {name!r}", path=self.path) from None

    def _live(self) -> memoryview:
        if self._mv is None:
            raise ValueError(f"{self.path}: package is closed")
        return self._mv

    def section_view(self, name: str) -> memoryview:
        """A zero-copy read-only view of a raw (codec ``none``) section in the memory map."""
        s = self.section(name)
        if not s.is_raw:
            raise ValueError(f"{self.path}: section {name!r} is {s.codec}-compressed; use section_bytes()")
        return self._live()[s.offset:s.offset + s.stored_length]

    def section_bytes(self, name: str) -> bytes:
        """A section's content, decompressed (a copy, even for a raw section)."""
        s = self.section(name)
        mv = self._live()
        if s.codec == "none":
            return bytes(mv[s.offset:s.offset + s.stored_length])
        if s.codec != "zstd":
            raise UnknownFeatureError(f"section {name!r} uses {s.codec} codec", path=self.path)
        with mv[s.offset:s.offset + s.stored_length] as data:
            try:
                declared = zstandard.frame_content_size(data)
            except zstandard.ZstdError as e:
                raise self._fmt(f"section {name!r}: not a zstd frame ({e})") from None
            if declared != s.raw_length:
                raise self._fmt(f"section {name!r}: zstd frame declares {declared} bytes, "
                                f"the section table {s.raw_length}")
            try:
                out = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).decompress(
                    data, max_output_size=s.raw_length)
            except zstandard.ZstdError as e:
                raise self._fmt(f"section {name!r}: corrupt zstd data ({e})") from None
        if len(out) != s.raw_length:
            raise self._fmt(f"section {name!r}: decompressed to {len(out)} bytes, expected {s.raw_length}")
        return out

    def array(self, name: str, dtype: Any, shape: Union[int, Iterable[int]], offset: int = 0) -> np.ndarray:
        """A read-only numpy array of ``shape`` and ``dtype`` at byte ``offset`` in a section: a zero-copy
        view of the memory map for a raw section, a view of the decompressed bytes otherwise."""
        dt = np.dtype(getattr(dtype, "np", dtype))
        if dt.hasobject:
            raise ValueError("cannot view package bytes as Python objects")
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        if any(d < 0 for d in shape) or offset < 0:
            raise ValueError(f"negative shape {shape} or offset {offset}")
        s = self.section(name)
        n = int(np.prod(shape, dtype=object)) if shape else 1
        nbytes = n * dt.itemsize
        if offset + nbytes > s.raw_length:
            raise self._fmt(f"section {name!r} has {s.raw_length} bytes, too few for {dt} {list(shape)} "
                            f"at offset {offset} ({nbytes} bytes)")
        if s.is_raw:
            if (s.offset + offset) % max(dt.alignment, 1):
                raise self._fmt(f"section {name!r}: offset {offset} is misaligned for {dt}")
            arr = np.frombuffer(self._live(), dtype=dt, count=n, offset=s.offset + offset)
        else:
            arr = np.frombuffer(self.section_bytes(name), dtype=dt, count=n, offset=offset)
        return arr.reshape(shape)

    def verify(self, names: Optional[Iterable[str]] = None) -> None:
        """Hash the given sections (default: all) now; raise :class:`IntegrityError` on a mismatch."""
        self._live()
        for s in (self.sections if names is None else [self.section(n) for n in names]):
            self._check_hash(s)

    # -- lifetime
    def close(self) -> None:
        mv, mm = self._mv, self._mm
        self._mv = self._mm = None
        if mv is not None:
            try:
                mv.release()
            except BufferError:
                pass
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass    # views given out still use the map; it is unmapped when the last one goes

    @property
    def closed(self) -> bool:
        return self._mv is None

    def __enter__(self) -> "PackageReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        v = getattr(self, "version", ("?", "?"))
        return f"<PackageReader {self.path!r} format {v[0]}.{v[1]}, {len(getattr(self, 'sections', ()))} sections>"


def open_package(path: Union[str, os.PathLike], verify: str = "metadata", *,
                 supported_features: Iterable[str] = (),
                 known_kinds: Optional[Collection[str]] = None) -> PackageReader:
    """Open and validate a package (see :class:`PackageReader`). ``supported_features`` adds to
    :data:`SUPPORTED_FEATURES`; with ``known_kinds``, a required section of another kind is refused."""
    return PackageReader(path, verify, supported_features=supported_features, known_kinds=known_kinds)


def _no_duplicates(pairs: list) -> dict:
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k[:64]!r}")
        d[k] = v
    return d


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _depth_exceeds(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return True
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return False
