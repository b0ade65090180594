"""The built-in workloads' data."""

import subprocess
import sys

import numpy as np
import pytest


def test_digits_reads_scikit_learns_set_as_load_digits_gives_it_without_importing_scikit_learn(monkeypatch):
    from sklearn.datasets import load_digits

    from thinwire.workloads import digits

    code = "import sys; from thinwire.workloads import digits; x, y = digits.load(); print('sklearn' in sys.modules, x.shape)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "(1797,", "64)"]   # every worker's start: no scikit-learn (1-2 s), no SciPy
    x, y = digits.load()
    bunch = load_digits()
    assert np.array_equal(x, bunch.data) and np.array_equal(y, bunch.target) and x.dtype == bunch.data.dtype
    monkeypatch.setattr(digits.importlib.util, "find_spec", lambda name: None)   # no file where it is kept
    x2, y2 = digits.load()
    assert np.array_equal(x2, bunch.data) and np.array_equal(y2, bunch.target)


def test_charlms_default_corpus_is_the_standard_librarys_own_files_not_what_is_installed_into_it(tmp_path, monkeypatch):
    import sysconfig
    from pathlib import Path

    from thinwire.workloads import corpus

    root = tmp_path / "lib"
    for rel in ("os.py", "json/__init__.py", "json/README", "site-packages/pip/__init__.py", "x/dist-packages/y.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("pass\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    assert sorted(corpus.stdlib_files()) == [root / "json" / "__init__.py", root / "os.py"]
    monkeypatch.undo()
    real = Path(sysconfig.get_paths()["stdlib"])
    assert real / "os.py" in corpus.stdlib_files()


def test_a_data_folder_leaves_out_hidden_binary_and_run_folders_and_says_where_it_was_capped(tmp_path):
    """`--data .` read .git's objects (zlib, suffix-less) as text, and a run folder written inside the data folder
    (its marker, config and summary: different at every launch, so a resume was not exact); the cap
    (model.max_bytes) was silent and corpus_files counted every file found."""
    from thinwire.workloads import corpus

    root = tmp_path / "proj"
    for rel, data in (("a.txt", b"x" * 3000), ("b.txt", b"y" * 3000), ("notes", b"plain text\n"),
                      (".git/index", b"DIRC\0\0"), (".git/objects/ab/cd", b"x\x9c\0\x01"), (".hidden.txt", b"h"),
                      ("logo", b"\x89PNG\r\n\x1a\n\0\0"), ("runs/r1/.thinwire-run", b"id"),
                      ("runs/r1/config.yaml", b"steps: 3\n"), ("runs/r1/summary.json", b"{}")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    assert corpus.user_files(root) == [root / "a.txt", root / "b.txt", root / "notes"]
    _, _, info = corpus.load_corpus(str(root), max_bytes=4000, min_bytes=10)
    assert (info["corpus_files"], info["corpus_files_found"], info["corpus_bytes"], info["corpus_capped"]) == (2, 3, 4000, True)
    _, _, whole = corpus.load_corpus(str(root), max_bytes=10_000, min_bytes=10)
    assert (whole["corpus_files"], whole["corpus_bytes"], whole["corpus_capped"]) == (3, 6011, False)


def test_data_naming_a_binary_file_or_a_run_folder_itself_is_refused(tmp_path):
    """`--data corpus.txt.gz` trained on the compressed bytes, and `--data RUN` (mistaken for --resume) on the run's
    config and summary, each without a word: the folder check left both out only below the folder given."""
    from thinwire.errors import ThinwireError
    from thinwire.workloads import corpus

    gz = tmp_path / "corpus.txt.gz"
    gz.write_bytes(b"\x1f\x8b\x08\0" + bytes(100))
    run = tmp_path / "run1"
    run.mkdir()
    for name, data in ((".thinwire-run", b"id"), ("config.yaml", b"steps: 3\n"), ("summary.json", b"{}")):
        (run / name).write_bytes(data)
    with pytest.raises(ThinwireError, match=r"^data: '.*corpus.txt.gz' is not a text file .*decompress a .gz first"):
        corpus.user_files(gz)
    with pytest.raises(ThinwireError, match=r"^data: '.*run1' is a thinwire run folder .*pass --resume .*run1"):
        corpus.user_files(run)
