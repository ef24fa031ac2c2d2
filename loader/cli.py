"""The ``lum`` command line.

Structure: one typer app; each command is a small function that parses its options, imports what it
needs *inside* the function (the loader package must never import the builder at import time, and
``lum --help`` should stay fast), and reports through :func:`_spinner` (stderr) and plain stdout.
Expected failures — bad arguments, missing files, unknown model names, missing optional extras —
are raised as :class:`UserError` / ``ValueError`` / ``FileNotFoundError`` and turned by :func:`main`
into one line ``error: …`` on stderr and exit status 2. Set ``LUM_DEBUG=1`` to get the traceback.

Commands now: ``graph``. Later: ``build`` (builder), ``run``, ``inspect``, ``verify``, ``bench`` (loader).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Iterator, Optional, Sequence

import typer

EXIT_USAGE = 2

app = typer.Typer(
    name="lum",
    help=(
        "lum compiles tensor programs (transformer LLMs first) into .lumpkg packages for NVIDIA GPUs "
        "and runs them with a thin loader.\n\n"
        "Set LUM_DEBUG=1 to see full tracebacks instead of one-line errors."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class UserError(Exception):
    """An expected failure whose message is shown to the user as one line (exit status 2)."""


def _is_expected(exc: BaseException) -> bool:
    """Errors reported as one line: UserError, ValueError, any OSError (a missing file, a full disk, no
    permission: the environment, not lum), and any LumError subclass."""
    if isinstance(exc, (UserError, ValueError, OSError)):
        return True
    return any(cls.__name__ == "LumError" for cls in type(exc).__mro__)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        msg = f"{exc.strerror}: {exc.filename}"
    elif isinstance(exc, OSError) and exc.strerror:
        msg = exc.strerror
    else:
        msg = str(exc) or type(exc).__name__
    return " ".join(msg.split())


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def _spinner(message: str) -> Iterator[None]:
    """A transient spinner on stderr for a long step (shown only when stderr is a terminal)."""
    if not sys.stderr.isatty():
        yield
        return
    with _stderr_console().status(message):
        yield


def _builder_import_error(exc: ImportError) -> UserError:
    return UserError(f"this command needs the builder and its extras (pip install 'lum[build]'): {exc}")


# ====================================================================== version / root options
def _version_callback(value: bool) -> None:
    if value:
        from lum.format import __version__

        typer.echo(f"lum {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the lum version and exit.",
                                 callback=_version_callback, is_eager=True),
) -> None:
    """lum: compile LLMs into .lumpkg packages for NVIDIA GPUs and run them with a thin loader."""


# ====================================================================== lum graph
class DTypeChoice(str, Enum):
    f32 = "f32"
    bf16 = "bf16"


RANDOM_NAMES = "llama3-1b, llama3-8b, qwen3-0.6b, gemma3-4b, tiny-llama, tiny-qwen3, tiny-gemma3"


def _load_spec(src: Optional[Path], random_name: Optional[str], dtype: str, max_seq: Optional[int], seed: int = 0):
    if (src is None) == (random_name is None):
        raise UserError("give either a checkpoint folder SRC or --random NAME (exactly one)")
    if src is not None:
        if not src.exists():
            raise UserError(f"no such checkpoint folder: {src}")
        if not src.is_dir():
            raise UserError(f"not a folder: {src} (SRC is a Hugging Face checkpoint folder)")
    try:
        from lum.builder.models import load_spec
    except ImportError as exc:
        raise _builder_import_error(exc) from exc
    label = f"random {random_name}" if random_name else str(src)
    with _spinner(f"building HLIR graphs for {label} ({dtype})…"):
        return load_spec(src=None if src is None else str(src), random_name=random_name, dtype=dtype,
                         max_seq=max_seq, materialize=False, seed=seed)


@app.command("graph")
def graph_cmd(
    src: Optional[Path] = typer.Argument(
        None, metavar="SRC", show_default=False,
        help="A Hugging Face checkpoint folder (config.json; weights are not read).",
    ),
    random_name: Optional[str] = typer.Option(
        None, "--random", metavar="NAME", show_default=False,
        help=f"Use a named config with random weights instead of SRC: {RANDOM_NAMES}.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of tables."),
    max_seq: Optional[int] = typer.Option(
        None, "--max-seq", metavar="N", min=1, show_default=False,
        help="Maximum sequence length, which sizes the KV cache (default: the model's context length, "
             "capped by the model loader).",
    ),
    dtype: DTypeChoice = typer.Option(DTypeChoice.f32, "--dtype", help="Element type of weights and activations."),
    egraph: bool = typer.Option(
        False, "--egraph",
        help="Also saturate each group's e-graph with the rule files and extract a program: report "
             "e-classes, e-nodes, decision points, seconds to saturate and extract, GEMM calls and in-place ops.",
    ),
) -> None:
    """Build the model's HLIR graphs (prefill, decode) and report their size, chunks and groups.

    Per entry graph: HLIR nodes by op, how many chunks the graph breaks cut it into, the groups of structurally identical chunks (each group is compiled once) and the dyn vars; and the model's parameter count and bytes. Nothing is compiled and no weights are read (with --egraph, each group is saturated and extracted, still without weights).

    Examples: lum graph --random tiny-llama · lum graph ~/models/Llama-3.2-1B --json · lum graph --random llama3-8b --egraph
    """
    spec = _load_spec(src, random_name, dtype.value, max_seq)
    try:
        from lum.builder.summary import print_summary, summarize
    except ImportError as exc:
        raise _builder_import_error(exc) from exc
    if egraph:
        try:
            import egglog  # noqa: F401  (the e-graph needs the [build] extra)
        except ImportError as exc:
            raise _builder_import_error(exc) from exc
    with _spinner("saturating and extracting every group…" if egraph else "partitioning and hashing chunks…"):
        summary = summarize(spec, egraph=egraph) if egraph else summarize(spec)
    source = getattr(spec, "source", "") or (str(src) if src is not None else f"random:{random_name}")
    summary = {"source": source, "dtype": dtype.value, "max_seq": getattr(spec, "max_seq", max_seq), **summary}
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        sys.stdout.flush()
    else:
        print_summary(summary)


# ====================================================================== lum build
def _progress_bar(label: str):
    """A rich progress bar on stderr; returns (context, callback). When stderr is not a terminal (a log, a
    pipe) it writes plain lines instead, so that a build cut off by a timeout says how far it got."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext(), _progress_lines(label)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=_stderr_console(), transient=True)
    task = progress.add_task(label, total=None)

    def update(stage: str, done: int, total: int) -> None:
        progress.update(task, description=f"{label}: {stage}", completed=done, total=total)

    return progress, update


PROGRESS_LINE_EVERY_S = 10.0   # a stage's progress lines in a log, at most this often (its first and last always)


def _progress_lines(label: str):
    """The progress callback for a log: one line when a stage starts or ends, and every
    :data:`PROGRESS_LINE_EVERY_S` seconds within it, each with the seconds since the build began."""
    t0 = time.perf_counter()
    last = {"line": (None, 0, 0), "t": 0.0}     # the last line written: (stage, done, total), and when

    def update(stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if (stage, done, total) == last["line"] or (
                stage == last["line"][0] and done < total and now - last["t"] < PROGRESS_LINE_EVERY_S):
            return
        last.update(line=(stage, done, total), t=now)
        sys.stderr.write(f"[{now - t0:7.1f} s] {label}: {stage} {done}/{total}\n")
        sys.stderr.flush()

    return update


@app.command("build")
def build_cmd(
    src: Optional[Path] = typer.Argument(None, metavar="SRC", show_default=False,
                                         help="A Hugging Face checkpoint folder (config.json + *.safetensors)."),
    out: Path = typer.Option(..., "-o", "--out", metavar="OUT.lumpkg", help="The package to write (atomically)."),
    random_name: Optional[str] = typer.Option(None, "--random", metavar="NAME", show_default=False,
                                              help=f"A named config with seeded random weights: {RANDOM_NAMES}."),
    dtype: DTypeChoice = typer.Option(DTypeChoice.f32, "--dtype", help="Element type of weights and activations."),
    target: str = typer.Option("sm_90", "--target", help="GPU architecture the package is compiled for."),
    max_seq: Optional[int] = typer.Option(None, "--max-seq", metavar="N", min=1, show_default=False,
                                          help="Maximum sequence length (sizes the KV cache)."),
    budget: int = typer.Option(0, "--budget", metavar="N", min=0,
                               help="Measured-search evaluations per group on a GPU (0: cost model only)."),
    tune: Optional[str] = typer.Option(None, "--tune", metavar="ENTRIES", show_default=False,
                                       help="With --budget: measure only these entries' groups, comma-separated "
                                            "(e.g. decode); the others take the cost model's choice."),
    seed: int = typer.Option(0, "--seed", help="Seed of --random weights."),
) -> None:
    """Compile a model into a .lumpkg package.

    The HLIR of each entry point (prefill, decode) is partitioned into groups; each distinct group is
    saturated with the e-graph rules once and one program is extracted (by measurement on a GPU with
    --budget, otherwise by the cost model). LLIR, weights (page-aligned, mmap-able), the tokenizer
    (when SRC has tokenizer.json) and provenance go into one file, written atomically.

    Examples: lum build --random tiny-llama -o tiny.lumpkg · lum build ~/models/Llama-3.2-1B -o llama.lumpkg
    """
    import time

    if out.exists() and out.is_dir():
        raise UserError(f"{out} is a folder; -o takes a file name")
    if not out.parent.exists():
        raise UserError(f"folder {out.parent} does not exist")
    if random_name is not None and src is not None:
        raise UserError("give either SRC or --random NAME, not both")
    if random_name is None and src is None:
        raise UserError("give a checkpoint folder SRC or --random NAME")
    tune_entries = None
    if tune is not None:
        tune_entries = tuple(e.strip() for e in tune.split(",") if e.strip())
        bad = sorted(set(tune_entries) - {"prefill", "decode"})
        if bad or not tune_entries:
            raise UserError(f"--tune takes entries of prefill, decode; got {tune!r}")
        if not budget:
            raise UserError("--tune needs --budget N (the measured search it limits)")
    spec = _load_spec(src, random_name, dtype.value, max_seq, seed)
    try:
        from lum.builder.package_builder import BuildOptions, build_package
    except ImportError as exc:
        raise _builder_import_error(exc) from exc
    if budget:   # measured search (lum.builder.tuning) needs a GPU of the target; else the cost model
        from lum.builder.tuning import gpu_unavailable_reason

        reason = gpu_unavailable_reason(target)
        if reason is not None:
            sys.stderr.write(f"note: --budget ignored: {reason}; extracting with the cost model\n")
            budget = 0
    tokenizer = None
    if src is not None and (src / "tokenizer.json").is_file():
        tokenizer = (src / "tokenizer.json").read_text(encoding="utf-8")
    t0 = time.perf_counter()
    bar, update = _progress_bar(f"building {spec.name}")
    with bar:
        path = build_package(spec, out, None, BuildOptions(target=target, budget=budget, tune_entries=tune_entries),
                             tokenizer, update)
    size = path.stat().st_size
    sys.stderr.write(f"wrote {path} ({size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s\n")


# ====================================================================== lum run / inspect / verify
def _open_package(pkg: Path, verify: str = "metadata"):
    if not pkg.exists():
        raise UserError(f"no such package: {pkg}")
    from lum.loader.model import open as open_pkg

    return open_pkg(pkg, verify=verify)


def _parse_tokens(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--tokens takes comma-separated integers, got {text!r}") from None
    if not out:
        raise UserError("--tokens is empty")
    return out


class BackendChoice(str, Enum):
    auto = "auto"
    cuda = "cuda"
    reference = "reference"


@app.command("run")
def run_cmd(
    pkg: Path = typer.Argument(..., metavar="PKG", help="A .lumpkg package."),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text (needs a tokenizer in the package)."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Prompt as comma-separated token ids, e.g. 1,2,3."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=0, help="Tokens to generate (greedy)."),
    backend: BackendChoice = typer.Option(BackendChoice.auto, "--backend",
                                          help="cuda, reference (numpy, slow) or auto (cuda when a GPU is present)."),
    as_json: bool = typer.Option(False, "--json", help='Print {"tokens": [...], "text": ..., "tok_per_s": ...}.'),
) -> None:
    """Generate tokens greedily from a package: prefill the prompt, then decode with the KV cache."""
    import time

    if (prompt is None) == (tokens is None):
        raise UserError("give exactly one of --prompt TEXT or --tokens 1,2,3")
    p = _open_package(pkg)
    tok = None
    if prompt is not None or p.manifest.tokenizer is not None:
        tok_json = p.tokenizer_json()
        if tok_json is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError as exc:
                raise UserError(f"text in/out needs the tokenizers package: {exc}") from None
            tok = Tokenizer.from_str(tok_json)
        elif prompt is not None:
            raise UserError("this package carries no tokenizer; use --tokens")
    ids = _parse_tokens(tokens) if tokens is not None else tok.encode(prompt).ids
    sess = p.session(backend=backend.value)
    t0 = time.perf_counter()
    with _spinner(f"generating {max_new_tokens} tokens ({sess.backend} backend)…"):
        out = sess.generate(ids, max_new_tokens)
    dt = time.perf_counter() - t0
    text = tok.decode(out) if tok is not None else None
    result = {"tokens": out, "text": text, "tok_per_s": (len(out) / dt) if dt > 0 else None,
              "backend": sess.backend, "backend_reason": sess.backend_reason}
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        typer.echo(text if text is not None else " ".join(map(str, out)))
        sys.stderr.write(f"{len(out)} tokens in {dt:.2f} s ({result['tok_per_s'] or 0:.1f} tok/s, {sess.backend})\n")


def _parse_dyn(text: Optional[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    if not text:
        return out
    for part in text.split(","):
        name, eq, value = part.partition("=")
        if not eq or not name.strip():
            raise UserError(f"--dyn takes name=value pairs like s=128,p=0, got {part!r}")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            raise UserError(f"--dyn value for {name.strip()!r} is not an integer: {value!r}") from None
    return out


@app.command("inspect")
def inspect_cmd(
    pkg: Path = typer.Argument(..., metavar="PKG", help="A .lumpkg package."),
    dyn: Optional[str] = typer.Option(None, "--dyn", help="Dyn values for the buffer plan, e.g. s=128,p=0."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Show a package: target, provenance, entries, groups, kernels by kind, buffer plan and sizes."""
    from lum.loader.inspect import describe, print_description

    p = _open_package(pkg)
    info = describe(p, _parse_dyn(dyn))
    if as_json:
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
    else:
        print_description(info)


@app.command("verify")
def verify_cmd(pkg: Path = typer.Argument(..., metavar="PKG", help="A .lumpkg package.")) -> None:
    """Check every section's hash (weights included) and the package's structure."""
    p = _open_package(pkg, verify="all")
    n = len(p.reader.names())
    size = p.reader.file_size
    p.close()
    typer.echo(f"{pkg}: OK ({n} sections, {size / 2**20:.1f} MiB, all hashes match)")


# ====================================================================== entry point
def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point: runs the app, turning expected errors into ``error: …`` and exit 2."""
    try:
        app(args=None if argv is None else list(argv), prog_name="lum")
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("LUM_DEBUG"):
            raise
        if _is_expected(exc):
            sys.stderr.write(f"error: {_one_line(exc)}\n")
        elif isinstance(exc, ImportError):  # an optional dependency missing somewhere below a command
            sys.stderr.write(f"error: missing dependency: {_one_line(exc)}\n")
        else:
            raise
        sys.exit(EXIT_USAGE)

if __name__ == "__main__":
    main()
