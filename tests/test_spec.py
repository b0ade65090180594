"""Codec spec strings and configs: parsing, canonical form, the registry, pinned error messages."""

from __future__ import annotations

import dataclasses

import pytest

from thinwire.compress.codecs import (
    BfpConfig, Int8Config, PowerSGDCodec, PowerSGDConfig, QsgdConfig, RandomKConfig, SignConfig, TopKCodec,
    TopKConfig,
)
from thinwire.compress.spec import (
    REGISTRY, CodecName, build_codec, codec_class, codec_help, parse_codec_spec, spec_string,
)
from thinwire.errors import ConfigError

ALL_NAMES = "none, fp16, bf16, int8, bfp, qsgd, topk, randomk, sign, powersgd"


def test_registry_covers_every_name_and_names_match_classes():
    assert set(REGISTRY) == set(CodecName)
    assert ", ".join(n.value for n in CodecName) == ALL_NAMES
    for name, cls in REGISTRY.items():
        assert cls.name == name.value and dataclasses.is_dataclass(cls.config_cls)


@pytest.mark.parametrize("name", [n.value for n in CodecName])
def test_bare_name_gives_the_default_config(name):
    codec = parse_codec_spec(name)
    assert type(codec) is codec_class(name) and codec.config == codec_class(name).config_cls()
    assert spec_string(codec) == name


def test_examples_from_the_docs():
    assert parse_codec_spec("int8:block=64").config.block == 64
    topk = parse_codec_spec("topk:ratio=0.01,approx=true")
    assert isinstance(topk, TopKCodec) and topk.config.ratio == 0.01 and topk.config.approx is True
    assert isinstance(parse_codec_spec("powersgd:rank=4"), PowerSGDCodec)


@pytest.mark.parametrize("spec,field,value", [
    ("int8:stochastic=1", "stochastic", True),
    ("int8:stochastic=FALSE", "stochastic", False),
    ("topk:approx=none", "approx", None),
    ("topk:approx=null", "approx", None),
    ("topk:approx_threshold=1e6", "approx_threshold", 1_000_000),
    ("topk:approx_threshold=2_000_000", "approx_threshold", 2_000_000),
    ("topk:ratio=1", "ratio", 1.0),
    (" INT8 : block = 64 ", "block", 64),
    ("powersgd:min_compression_rate=3", "min_compression_rate", 3.0),
])
def test_values_are_read_with_the_field_type(spec, field, value):
    got = getattr(parse_codec_spec(spec).config, field)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("spec", [
    "int8:block=64,stochastic=true", "bfp:block=32,mantissa_bits=4", "qsgd:levels=15,block=512",
    "topk:ratio=0.001,approx=false,sample_size=500", "randomk:ratio=0.25,rescale=true",
    "sign:block=64", "powersgd:rank=2,warm_start=false,min_compression_rate=1.5",
])
def test_spec_string_round_trips(spec):
    codec = parse_codec_spec(spec)
    assert spec_string(codec) == spec
    assert parse_codec_spec(spec_string(codec)).config == codec.config


def test_build_codec_takes_typed_params():
    assert build_codec("int8", {"block": 128}).config.block == 128
    with pytest.raises(ConfigError, match=r"int8.block: must be an integer, got '128'"):
        build_codec("int8", {"block": "128"})


@pytest.mark.parametrize("spec, field", [("int8:block=7", "int8.block"), ("topk:ratio=2", "topk.ratio"),
                                         ("powersgd:rank=0", "powersgd.rank"), ("bfp:block=0", "bfp.block")])
def test_a_codec_parameter_out_of_range_is_named_once(spec, field):
    """The codec's own check names ``int8.block``; the spec's parser used to prefix it again (``int8.int8.block``)."""
    with pytest.raises(ConfigError) as e:
        parse_codec_spec(spec)
    assert str(e.value).startswith(f"{field}: must be"), str(e.value)


@pytest.mark.parametrize("spec,message", [
    ("zstd", f"compression: must be one of {ALL_NAMES}, got 'zstd'"),
    ("", "compression: must be name or name:key=value,key=value (e.g. 'int8:block=64'), got ''"),
    ("int8:blok=3", "int8 parameter: must be one of block=256, stochastic=false, bits=8, got 'blok'. "
                    "E.g. int8:block=256."),
    ("topk:k=5", "topk parameter: must be one of ratio=0.01, approx=none, approx_threshold=1000000, "
                 "sample_size=10000, got 'k'"),
    ("none:x=1", "none parameter: must be absent, got 'x'. none takes no parameters: write just 'none'."),
    ("int8:block", "compression: must be name or name:key=value,key=value (e.g. 'int8:block=64'), "
                   "got 'int8:block'. Write each parameter as key=value, not 'block'."),
    ("int8:", "got 'int8:'. Write each parameter as key=value, not ''."),
    ("int8:=4", "Write each parameter as key=value, not '=4'."),
    ("int8:block=abc", "int8.block: must be an integer (8..65536), got 'abc'. E.g. int8:block=256."),
    ("int8:block=6.5", "int8.block: must be an integer (8..65536), got '6.5'"),
    ("int8:stochastic=yes", "int8.stochastic: must be true or false, got 'yes'. E.g. int8:stochastic=false."),
    ("topk:approx=maybe", "topk.approx: must be true or false or none, got 'maybe'"),
    ("topk:ratio=abc", "topk.ratio: must be a number (0 < ratio <= 1), got 'abc'. E.g. topk:ratio=0.01."),
    ("topk:ratio=1.5", "topk.ratio: must be in (0, 1], got 1.5"),
    ("randomk:ratio=nan", "randomk.ratio: must be a number (0 < ratio <= 1), got 'nan'"),
    ("int8:block=4", "int8.block: must be an integer in [8, 65536], got 4"),
    ("int8:block=64,block=128", "int8.block: must be given once, got 'int8:block=64,block=128'"),
])
def test_errors_are_pinned(spec, message):
    with pytest.raises(ConfigError) as info:
        parse_codec_spec(spec)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_codec_help_lists_every_codec_parameter_default_and_range():
    lines = codec_help().splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.split(" ")[0] in {n.value for n in CodecName}]
    assert [lines[i].split()[0] for i in starts] == [n.value for n in CodecName]
    for i, (name, cls) in zip(starts, REGISTRY.items()):
        for j, f in enumerate(dataclasses.fields(cls.config_cls)):  # one line per parameter
            assert f"{f.name}=" in lines[i + j] and f.metadata["allowed"] in lines[i + j], (name, f.name)
    assert "stochastic=false" in lines[starts[3] + 1] and "approx=none" in lines[starts[6] + 1]


def test_codec_help_prices_bytes_per_value():
    int8_line = next(ln for ln in codec_help().splitlines() if ln.startswith("int8 "))
    assert int8_line.split()[1:3] == ["1.02", "no"]  # (256 + 4) / 256 bytes per value


@pytest.mark.parametrize("make,match", [
    (lambda: Int8Config(block=4), r"int8.block: must be an integer in \[8, 65536\], got 4"),
    (lambda: Int8Config(block=True), r"int8.block: must be an integer in \[8, 65536\], got True"),
    (lambda: Int8Config(stochastic="yes"), r"int8.stochastic: must be true or false, got 'yes'"),
    (lambda: BfpConfig(mantissa_bits=9), r"bfp.mantissa_bits: must be an integer in \[2, 8\], got 9"),
    (lambda: QsgdConfig(levels=128), r"qsgd.levels: must be an integer in \[1, 127\], got 128"),
    (lambda: TopKConfig(ratio=1.5), r"topk.ratio: must be in \(0, 1\], got 1.5"),
    (lambda: TopKConfig(ratio=0), r"topk.ratio: must be in \(0, 1\], got 0"),
    (lambda: TopKConfig(approx="auto"), r"topk.approx: must be true, false or none"),
    (lambda: RandomKConfig(ratio=-0.1), r"randomk.ratio: must be in \(0, 1\], got -0.1"),
    (lambda: SignConfig(block=12), r"sign.block: must be a multiple of 8 \(bits are packed by 8\), got 12"),
    (lambda: PowerSGDConfig(rank=0), r"powersgd.rank: must be an integer in \[1, 1024\], got 0"),
    (lambda: PowerSGDConfig(min_compression_rate=0.5), r"powersgd.min_compression_rate: must be a number >= 1, "),
])
def test_config_errors_name_field_value_and_range(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_attach_and_convert_name_only_what_they_take():
    """A codec typo given to thinwire.attach listed the torch:* forms (and blamed `compression`), which attach then
    refused; convert's mode typo listed fp16 and auto, which convert then refused; a negative link rate was told
    to use other units."""
    import torch

    from thinwire.commspec import as_policy
    from thinwire.precision import convert
    from thinwire.units import parse_rate

    with pytest.raises(ConfigError) as e:
        as_policy("int9")
    assert str(e.value).startswith("codec: must be one of none,") and "torch:" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^codec: must be a thinwire codec or auto, got 'torch:bf16'\. PyTorch's hooks"):
        as_policy("torch:bf16")
    for mode, fix in (("int9", r"E.g. convert\(model, 'int8'\)"), ("auto", "auto is chosen by trial"),
                      ("fp16", "fp16 needs a loss scaler")):
        with pytest.raises(ValueError, match=rf"^convert: mode must be one of fp32, int8, bf16, got '{mode}'\. {fix}"):
            convert(torch.nn.Linear(2, 2), mode)
    with pytest.raises(ConfigError, match=r"got '-100mbit'\. A link needs a positive rate\.$"):
        parse_rate("-100mbit", "bandwidth")
