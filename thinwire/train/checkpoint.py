"""Checkpoints that survive a killed worker: atomic writes, loaded with ``weights_only=True``.

Layout: ``OUT/checkpoints/step_000123.pt`` (a pipelined run's stages in ``OUT/checkpoints/shards/``, one file
per rank, written before the checkpoint that names them: :func:`save_shard`). A checkpoint is written to a temporary file in the same
folder, flushed and fsync'ed, then renamed over its final name (``os.replace`` is atomic on POSIX),
and the folder is fsync'ed so the rename itself survives a crash. A reader therefore sees either the
previous checkpoint or the complete new one, never half of one. Only the newest ``keep`` are kept.

Contents (all plain tensors and containers, so ``torch.load(weights_only=True)`` accepts them):
``step``, ``samples``, ``model``, ``optimizer``, ``scheduler``, ``signature`` (parameter names and
shapes, to refuse a checkpoint of another model), ``config``, and ``ranks``: one entry per rank with
its RNG state and communication state (error-feedback residuals), because those differ by rank.
"""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
from pathlib import Path

import torch

from thinwire.errors import ThinwireError, cannot_write

FORMAT = "thinwire-checkpoint-1"
NAME = re.compile(r"^step_(\d{9})\.pt$")
TMP_NAME = re.compile(r"^\.step_(\d{9})\.(?:rank\d+\.)?pt\..*\.tmp$")  # save_atomic's temporary file of a checkpoint or shard


def checkpoint_dir(out: Path) -> Path:
    return out / "checkpoints"


def list_checkpoints(out: Path) -> list[Path]:
    d = checkpoint_dir(out)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if NAME.match(p.name)), key=lambda p: p.name)


def step_of(path: Path) -> int:
    """The step a checkpoint ``step_N.pt`` was taken at."""
    return int(NAME.match(path.name).group(1))


def latest(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError in ``e``'s chain (itself, its cause or the error it was raised while handling), if any."""
    for _ in range(8):
        if e is None or isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def save_atomic(obj: dict, path: Path) -> None:
    """Write ``obj`` to ``path`` so that ``path`` is never seen half-written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise cannot_write(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, Exception) and (os_error := _os_error(e)) is not None:  # torch.save wraps a full disk
            raise cannot_write(path, os_error) from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(out: Path, state: dict, keep: int) -> Path:
    """Write ``step_N.pt`` (after any shards of it: its presence means the whole checkpoint is there) and
    drop all but the newest ``keep`` checkpoints, with their shards."""
    path = checkpoint_dir(out) / f"step_{state['step']:09d}.pt"
    save_atomic({"format": FORMAT, **state}, path)
    for old in list_checkpoints(out)[:-keep]:
        old.unlink(missing_ok=True)
        for shard in (old.parent / "shards").glob(old.stem + ".rank*.pt"):
            shard.unlink(missing_ok=True)
    drop_partial(path.parent, state["step"])
    return path


def drop_partial(folder: Path, step: int) -> None:
    """Remove what a writer killed mid-write left (``save_atomic``'s temporary files, which only it would
    remove) for checkpoints up to ``step``: written by now, or never to be (every shard of a step is written
    before its checkpoint). Each restart after a kill could otherwise leave one more."""
    for tmp in [*folder.glob(".step_*.tmp"), *(folder / "shards").glob(".step_*.tmp")]:
        m = TMP_NAME.match(tmp.name)
        if m and int(m.group(1)) <= step:
            tmp.unlink(missing_ok=True)


def shard_path(main: Path, rank: int) -> Path:
    """Rank ``rank``'s own part of checkpoint ``main`` (a pipeline stage's parameters and optimizer state):
    ``checkpoints/shards/step_NNNNNNNNN.rankRRRRR.pt``."""
    return main.parent / "shards" / f"{main.stem}.rank{rank:05d}.pt"


def save_shard(out: Path, step: int, rank: int, shard: dict) -> None:
    """Each rank writes its shard atomically before rank 0 writes the checkpoint itself, so a rank never
    gathers another's tensors: a model too large for one host is checkpointed by the hosts holding it."""
    save_atomic({"format": FORMAT, **shard}, shard_path(checkpoint_dir(out) / f"step_{step:09d}.pt", rank))


def load_shard(main: Path, rank: int) -> dict:
    path = shard_path(main, rank)
    if not path.is_file():
        raise ThinwireError(f"checkpoint {str(main)!r} is incomplete: its shard {path.name} (rank {rank}'s stage) is "
                            f"missing. Move {main.name} out of {main.parent} to resume from the checkpoint before it, "
                            "or start a new run without --resume.")
    return load_shard_file(path)


def load_shard_file(path: Path) -> dict:
    state = _read(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ThinwireError(f"checkpoint shard {str(path)!r} is not a thinwire checkpoint (format {FORMAT} expected).")
    return state


def check_shards(main: Path, state: dict) -> None:
    """Every shard a pipelined checkpoint names is there and readable (checked before any worker starts)."""
    for rank in range(int(state.get("shards") or 0)):
        path = shard_path(main, rank)
        try:
            load_shard(main, rank)
        except ThinwireError as e:
            if not path.is_file():
                raise
            why = str(e).split(". ")[0].split(" is ", 1)[-1]  # "corrupt, truncated or ...": the reason alone
            raise ThinwireError(f"checkpoint {str(main)!r} has a damaged shard, {path.name} (rank {rank}'s stage): it "
                                f"is {why}. Move {main.name} and its shards out of {main.parent} to resume from the "
                                "checkpoint before it, or start a new run without --resume.") from None


def model_state(main: str | Path, state: dict) -> dict:
    """The whole model's state dict of a checkpoint: its own, or its shards' stages merged (a pipeline's)."""
    if state["model"] or not state.get("shards"):
        return state["model"]
    main = Path(main)
    merged: dict = {}
    for rank in range(int(state["shards"])):
        merged.update(load_shard(main, rank)["stage"])
    return merged


REQUIRED = {"step": int, "wall_s": (int, float), "model": dict, "optimizer": dict, "scheduler": dict,
            "signature": dict, "ranks": list, "config": dict}
INNER = {"optimizer": {"state": dict, "param_groups": list}}  # entries' own parts a resume reads
_REFUSED = "Weights only load failed"  # torch's message when weights_only=True meets another object


def load(path: Path) -> dict:
    """Load a checkpoint, turning corruption, a foreign file or a refused pickle into a clear error."""
    state = _read(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ThinwireError(f"checkpoint {str(path)!r} is not a thinwire checkpoint (format {FORMAT} expected).")
    _check_entries(path, state)
    return state


def stopped_before_first(folder: Path) -> bool:
    """Whether ``folder`` holds a run (its ``config.yaml`` and the run marker, ``thinwire.train.runfolder.MARKER``)
    that stopped before its first checkpoint: resuming it trains it again from step 0 with that configuration.
    Another tool's folder with a config.yaml (``thinwire doctor``'s) is no such run."""
    return latest(folder) is None and (folder / "config.yaml").is_file() and (folder / ".thinwire-run").is_file()


def resume_point(folder: Path) -> tuple[Path | None, Path]:
    """The checkpoint a resume of ``folder`` goes on from, and the folder it is in: ``folder``'s latest; for a run
    that stopped before its first checkpoint and had itself resumed another (its config.yaml's ``resume:``), that
    run's, and so on (a resume into a new folder starts from the old one's checkpoint, which a second resume must
    not drop); ``(None, folder)`` where there is none."""
    import yaml

    seen: set[Path] = set()
    while True:
        found = latest(folder)
        if found is not None or not stopped_before_first(folder):
            return found, folder
        seen.add(folder.resolve())
        try:
            prior = (yaml.safe_load((folder / "config.yaml").read_text()) or {}).get("resume")
        except (OSError, yaml.YAMLError, AttributeError):
            prior = None
        if not isinstance(prior, str) or not Path(prior).is_dir() or Path(prior).resolve() in seen:
            return None, folder
        folder = Path(prior)


def _read(path: Path):
    """``torch.load`` of a file whose every entry matches its checksum: ``torch.load`` reads the archive's
    entries without checking them, so bytes damaged on disk would load as other numbers (a NaN, a moment of
    the optimizer changed) and training would go on from them."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise ThinwireError(f"checkpoint {str(path)!r} is corrupt, truncated or not a checkpoint: it is not the zip "
                            f"archive torch.save writes ({type(e).__name__}: {str(e)[:120]}). Remove it to resume from "
                            "an earlier checkpoint, or start a new run without --resume.") from None
    if bad is not None:
        raise ThinwireError(f"checkpoint {str(path)!r} is damaged: its entry {bad!r} does not match its checksum. "
                            "Remove it to resume from an earlier checkpoint, or start a new run without --resume.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated/corrupt zip archives
        raise ThinwireError(_load_failure(path, e)) from None


def _load_failure(path: Path, e: Exception) -> str:
    detail = str(e).splitlines()[0][:160] if str(e) else "no detail"
    if _REFUSED in str(e):
        return (f"checkpoint {str(path)!r} was refused: it contains objects other than tensors and plain "
                f"containers, which a thinwire checkpoint never holds, and loading them could run code. "
                f"Do not resume from a file you did not write; start a new run without --resume.")
    return (f"checkpoint {str(path)!r} is corrupt or truncated and cannot be loaded ({type(e).__name__}: "
            f"{detail}). Remove it to resume from an earlier checkpoint, or start a new run without --resume.")


def _check_entries(path: Path, state: dict) -> None:
    wanted = [(key, key, state, kind) for key, kind in REQUIRED.items()]
    wanted += [(f"{outer}.{key}", key, state.get(outer) or {}, kind) for outer, parts in INNER.items()
               for key, kind in parts.items()]
    for name, key, where, kind in wanted:
        if not isinstance(where.get(key), kind) or isinstance(where.get(key), bool):
            got = "no such entry" if key not in where else f"a {type(where[key]).__name__}"
            raise ThinwireError(f"checkpoint {str(path)!r} is incomplete: its entry {name!r} is missing or of the "
                                f"wrong type ({got}). It was not written by thinwire's trainer; resume from "
                                f"another checkpoint or start a new run without --resume.")


def model_signature(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(p.shape) for name, p in model.named_parameters()}


def check_signature(path: Path, saved: dict, current: dict) -> None:
    if saved == current:
        return
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    diff = [k for k in current if k in saved and saved[k] != current[k]]
    detail = (f"parameters missing from it: {missing[:3]}" if missing else
              f"parameters it has that the model lacks: {extra[:3]}" if extra else
              f"shape of {diff[0]}: checkpoint {saved[diff[0]]}, model {current[diff[0]]}")
    raise ThinwireError(
        f"checkpoint {str(path)!r} belongs to a different model ({detail}). Resume with the same workload "
        f"and model options as the run that wrote it, or start a new run without --resume."
    )
