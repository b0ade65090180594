"""A real text corpus that is always present: the Python standard library's own source files.

``load_corpus(None)`` reads the ``.py`` files of the running interpreter's standard library (no
site-packages), in an order fixed by a hash of each relative path, up to ``max_bytes``. A user's
``--data PATH`` (a text file or a folder of them) replaces it. The bytes are split deterministically
into train and validation by 64 KiB chunks, every tenth chunk going to validation, so both halves
come from the same mix of files.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from pathlib import Path

import torch

from thinwire.errors import ThinwireError

CHUNK = 64 * 1024
VAL_EVERY = 10
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".yaml", ".yml", ".csv", ".html", ".tex", ""}


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (not what is installed into its site-packages), in an order fixed by
    their paths' hashes. ``os.walk`` that skips the package folders: ``rglob`` walked them too (0.5 s per start)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())


def user_files(path: Path) -> list[Path]:
    if not path.exists():
        raise ThinwireError(f"data: path {str(path)!r} does not exist. Pass a text file or a folder of text files.")
    if path.is_file():
        if _binary(path):
            raise ThinwireError(f"data: {str(path)!r} is not a text file (it holds NUL bytes in its first 8 KiB: "
                                "compressed, compiled or an image?). Pass a text file (decompress a .gz first) or a "
                                "folder of text files.")
        return [path]
    if (path / ".thinwire-run").is_file():
        raise ThinwireError(f"data: {str(path)!r} is a thinwire run folder (its config, marker and summary are no "
                            "corpus). To go on with that run pass --resume " + str(path) + "; to train on text, pass "
                            "a text file or a folder of them.")
    if not path.is_dir():
        raise ThinwireError(f"data: {str(path)!r} is neither a file nor a folder (a device, a pipe?). Pass a text file "
                            "or a folder of text files.")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                   and not _skipped(p.relative_to(path), path) and not _binary(p))
    if not files:
        raise ThinwireError(f"data: folder {str(path)!r} holds no text files ({', '.join(sorted(s for s in TEXT_SUFFIXES if s))}). Pass a text file or a folder of them.")
    return files


def _skipped(rel: Path, root: Path) -> bool:
    """Hidden files and folders (``.git``'s objects) and thinwire run folders (a run written inside its own data
    folder would train on its config, its marker and its summary, different at every launch): a folder holding
    ``thinwire.train.runfolder.MARKER`` (not imported: workloads sit below the trainer)."""
    if any(part.startswith(".") for part in rel.parts):
        return True
    return any((root.joinpath(*rel.parts[:i]) / ".thinwire-run").is_file() for i in range(1, len(rel.parts)))


def _binary(path: Path) -> bool:
    """A NUL byte in its first 8 KiB (text never has one; compiled, compressed and image files do)."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except OSError:
        return False  # read_bytes names the file it cannot read


def read_bytes(files: list[Path], max_bytes: int) -> bytes:
    parts, total = [], 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError as e:
            raise ThinwireError(f"data: cannot read {str(f)!r} ({e.strerror}). Check its permissions or leave it out.") from None
        parts.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def _files_read(files: list[Path], n: int):
    """The files of which ``read_bytes`` took at least one of its ``n`` bytes."""
    total = 0
    for f in files:
        if total >= n:
            return
        yield f
        total += _size([f])


def _size(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files if f.is_file())


def load_corpus(data: str | None, max_bytes: int, min_bytes: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Train bytes, validation bytes (uint8 tensors) and a description for the run's summary."""
    files = stdlib_files() if data is None else user_files(Path(data))
    raw = read_bytes(files, max_bytes)
    source = "python-stdlib" if data is None else str(data)
    if len(raw) < min_bytes:
        raise ThinwireError(
            f"data: corpus {source!r} has {len(raw)} bytes; charlm needs at least {min_bytes} "
            f"(context + 1, in both the training and validation split). Pass a larger text file or folder."
        )
    data_t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    train, val = split(data_t)
    read = sum(1 for _ in _files_read(files, len(raw)))
    info = {"corpus": source, "corpus_files": read if data is not None else None,
            "corpus_files_found": len(files) if data is not None else None,
            "corpus_bytes": len(raw), "corpus_capped": len(raw) >= max_bytes and _size(files) > max_bytes, "corpus_sha1": hashlib.sha1(raw).hexdigest()[:12],
            "unigram_entropy_bits": unigram_entropy_bits(train)}
    return train, val, info


def split(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if len(data) < 2 * CHUNK * VAL_EVERY:  # small corpus: last tenth is validation
        cut = len(data) - max(1, len(data) // VAL_EVERY)
        return data[:cut].clone(), data[cut:].clone()
    chunks = list(torch.split(data, CHUNK))
    val = [c for i, c in enumerate(chunks) if i % VAL_EVERY == VAL_EVERY - 1]
    train = [c for i, c in enumerate(chunks) if i % VAL_EVERY != VAL_EVERY - 1]
    return torch.cat(train), torch.cat(val)


def unigram_entropy_bits(data: torch.Tensor) -> float:
    """Entropy of the byte distribution, in bits per byte: the loss of the best context-free model."""
    counts = torch.bincount(data.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum()) if len(p) else math.nan
