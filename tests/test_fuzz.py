"""Property-based fuzzing of every loader a user's input reaches (issue 26).

Each test feeds one loader generated inputs: valid documents with a few values replaced, keys
deleted or added, list items nulled (structured), and raw text with junk spliced in. The property:
the loader returns a valid object or raises a :class:`~thinwire.errors.ThinwireError` whose message
is at most 2 KB; any other exception is a bug. Seeds are fixed (``derandomize``), so a run is
reproducible; ``EXAMPLES`` sums to over 5,000 inputs, about 30 s on two cores.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.inputs_docs import CLUSTER, PLAN, PROFILE, TRAIN
from thinwire.cluster.spec import load_cluster_spec, parse_duration, parse_loss, parse_rate, parse_size
from thinwire.config import dump_yaml
from thinwire.errors import MAX_MESSAGE, ThinwireError
from thinwire.measure.file import load_profile
from thinwire.plan.planfile import read_plan
from thinwire.train.config import load_train_config
from thinwire.commspec import parse_comm_spec
from thinwire.workloads.registry import check_workload_name

EXAMPLES = {"config": 900, "set": 700, "codec": 700, "cluster": 800, "plan": 600, "profile": 600,
            "workload": 300, "size": 500}  # 5,100 in all
assert sum(EXAMPLES.values()) >= 5000


def fuzz(name: str):
    return settings(max_examples=EXAMPLES[name], derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def clean(load, *args) -> None:
    """The property: ``load(*args)`` returns, or raises a ThinwireError of at most 2 KB."""
    try:
        load(*args)
    except ThinwireError as e:
        assert len(str(e)) <= MAX_MESSAGE, str(e)[:300]


# -- generated values and documents ---------------------------------------------------------------
NASTY_TEXT = ["1e999", "-1e999", ".inf", ".nan", "inf", "nan", "1e-320", "²", "٣", "a\n", "-1", "0", "", " ",
              "1:30", "off", "0x1F", "0o7", "~", "null", "9" * 5000, ":", ".x:y", "&a", "*a", "!!int x", "\x00",
              "10000000000000000", "512MiB", "1e999GiB", "100mbps", "5ms", "0.1%", "lab.v1", "LAB_v1"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=-1e-300, max_value=1e-300),
    st.text(max_size=12), st.sampled_from(NASTY_TEXT),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=6)
JUNK = st.one_of(st.text(max_size=8), st.sampled_from(["[" * 100, "{" * 70, "&a ", "*a", ": ", "\n- ", "\t", "'",
                                                       "\xff", "!!python/name:os.system ", "? ", "{1: 2}", "---\n"]))


@st.composite
def mutated(draw, base: dict) -> dict:
    """``base`` with one to three changes at random places: a value replaced, a key deleted, an
    unknown key added or a list item set to null."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        node = doc
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            if not isinstance(node[key], (dict, list)) or not node[key]:
                break
            node = node[key]
        _change(draw, node)
    return doc


def _change(draw, node) -> None:
    if isinstance(node, dict) and node:
        key = draw(st.sampled_from(sorted(node)))
        op = draw(st.sampled_from(["set", "set", "delete", "add"]))
        if op == "delete":
            del node[key]
        elif op == "add":
            node[draw(st.text(max_size=8))] = draw(VALUES)
        else:
            node[key] = draw(VALUES)
    elif isinstance(node, list) and node:
        node[draw(st.integers(0, len(node) - 1))] = draw(st.one_of(st.none(), VALUES))


@st.composite
def yaml_text(draw, base: dict) -> str:
    """A mutated document as YAML, sometimes with junk spliced into the text."""
    text = dump_yaml(draw(mutated(base)))
    if draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(JUNK) + text[at:]
    return text


FILE = Path(tempfile.mkdtemp(prefix="thinwire-fuzz-")) / "input.yaml"


def written(text: str) -> Path:
    FILE.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    return FILE


# -- the loaders ----------------------------------------------------------------------------------
@fuzz("config")
@given(yaml_text(TRAIN))
def test_config_file(text):
    clean(lambda: load_train_config(str(written(text)), {}, []))


KEYS = st.sampled_from(sorted(TRAIN) + ["model.width", "model.hidden", "nproc", "weight_decay", "bucket_mb",
                                       "grad_clip", "steps.x", "", ".", "a..b"])


@fuzz("set")
@given(st.lists(st.tuples(KEYS, st.one_of(st.sampled_from(NASTY_TEXT), st.text(max_size=16), JUNK)),
                min_size=1, max_size=3))
def test_set_items(items):
    clean(load_train_config, None, {}, [f"{k}={v}" for k, v in items])


CODEC_TEXT = st.one_of(
    st.builds(lambda n, k, v: f"{n}:{k}={v}",
              st.sampled_from(["int8", "topk", "powersgd", "qsgd", "randomk", "bfp", "torch:powersgd", "sign", "x"]),
              st.sampled_from(["rank", "ratio", "block", "levels", "approx", "warm_start", "zz", ""]),
              st.one_of(st.sampled_from(NASTY_TEXT), st.text(max_size=8), st.integers().map(str),
                        st.floats().map(repr))),
    st.text(max_size=30),
)


@fuzz("codec")
@given(CODEC_TEXT)
def test_codec_specs(text):
    clean(parse_comm_spec, text)


@fuzz("cluster")
@given(yaml_text(CLUSTER))
def test_cluster_spec(text):
    clean(load_cluster_spec, written(text))


@fuzz("plan")
@given(yaml_text(PLAN))
def test_plan_file(text):
    clean(read_plan, written(text))


@fuzz("profile")
@given(yaml_text(PROFILE))
def test_profile_file(text):
    clean(load_profile, written(text))


@fuzz("workload")
@given(st.one_of(st.text(max_size=20), st.sampled_from(NASTY_TEXT),
                 st.builds(lambda a, b: f"{a}:{b}", st.text(max_size=8), st.text(max_size=8))))
def test_workload_names(name):
    clean(check_workload_name, name)


SIZE_TEXT = st.one_of(
    st.builds(lambda n, u: f"{n}{u}", st.one_of(st.floats().map(repr), st.integers().map(str), st.sampled_from(NASTY_TEXT)),
              st.sampled_from(["", "B", "KiB", "MiB", "GiB", "GB", "mbit", "gbit", "ms", "s", "%", "mbps", "x"])),
    st.text(max_size=12), st.floats(), st.integers(min_value=-(10**400), max_value=10**400),
)
PARSERS = [parse_rate, parse_size, parse_duration, parse_loss,
           lambda v, f: load_train_config(None, {"memory_budget": v}, [])]


@fuzz("size")
@given(SIZE_TEXT, st.integers(0, len(PARSERS) - 1))
def test_sizes_rates_and_durations(value, which):
    clean(PARSERS[which], value, "field")


@pytest.mark.parametrize("text", ["[" * 5000, "a: &a [1]\n" + "b: *a\n" * 10, "{" * 3000 + "}" * 3000])
def test_hand_picked_documents_through_every_file_loader(text):
    for load in (lambda p: load_train_config(str(p), {}, []), load_cluster_spec, read_plan, load_profile):
        clean(load, written(text))
