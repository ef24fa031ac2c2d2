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
    """Errors reported as one line: UserError, ValueError, file errors, and any LumError subclass."""
    if isinstance(exc, (UserError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                        PermissionError)):
        return True
    return any(cls.__name__ == "LumError" for cls in type(exc).__mro__)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        msg = f"{exc.strerror}: {exc.filename}"
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


def _load_spec(src: Optional[Path], random_name: Optional[str], dtype: str, max_seq: Optional[int]):
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
                         max_seq=max_seq, materialize=False)


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
) -> None:
    """Build the model's HLIR graphs (prefill, decode) and report their size, chunks and groups.

    Per entry graph: HLIR nodes by op, how many chunks the graph breaks cut it into, the groups of structurally identical chunks (each group is compiled once) and the dyn vars; and the model's parameter count and bytes. Nothing is compiled and no weights are read.

    Examples: lum graph --random tiny-llama · lum graph ~/models/Llama-3.2-1B --json
    """
    spec = _load_spec(src, random_name, dtype.value, max_seq)
    try:
        from lum.builder.summary import print_summary, summarize
    except ImportError as exc:
        raise _builder_import_error(exc) from exc
    with _spinner("partitioning and hashing chunks…"):
        summary = summarize(spec)
    source = getattr(spec, "source", "") or (str(src) if src is not None else f"random:{random_name}")
    summary = {"source": source, "dtype": dtype.value, "max_seq": getattr(spec, "max_seq", max_seq), **summary}
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        sys.stdout.flush()
    else:
        print_summary(summary)


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
