"""The built-in workloads' data."""

import subprocess
import sys

import numpy as np


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
