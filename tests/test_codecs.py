"""Codecs against documented error bounds and invariants (lossy codecs: bounds, not equality).

Every codec: exact ``payload_bytes``, data-independent payload layout, finite output on adversarial
input (zeros, 1e30, 1e-30, the dtype's max, mixed magnitudes, empty, strided views, fp16/bf16),
no aliasing of the input. Then each codec's own bound, stated in its module docstring.
"""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.compress.codecs import (
    Bf16Codec, Bf16Config, BfpCodec, BfpConfig, Codec, Fp16Codec, Fp16Config, Int8Codec, Int8Config,
    Meta, NoneCodec, NoneConfig, PowerSGDCodec, PowerSGDConfig, QsgdCodec, QsgdConfig, RandomKCodec,
    RandomKConfig, SignCodec, SignConfig, TopKCodec, TopKConfig, payload_nbytes,
)
from thinwire.compress.codecs.common import mix_seed, sparse_k
from thinwire.compress.codecs.powersgd import (
    matrix_view, near_square, orthogonalize_, payload_bytes_matrix, should_compress,
)
from thinwire.compress.spec import spec_string
from thinwire.errors import ConfigError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CODECS = [
    NoneCodec(NoneConfig()), Fp16Codec(Fp16Config()), Bf16Codec(Bf16Config()),
    Int8Codec(Int8Config()), Int8Codec(Int8Config(block=64, stochastic=True)),
    Int8Codec(Int8Config(bits=4)), Int8Codec(Int8Config(block=8, bits=4, stochastic=True)),
    BfpCodec(BfpConfig()), BfpCodec(BfpConfig(block=32, mantissa_bits=4)),
    QsgdCodec(QsgdConfig()), QsgdCodec(QsgdConfig(levels=1, block=100)),
    TopKCodec(TopKConfig()), TopKCodec(TopKConfig(ratio=0.1, approx=True, sample_size=500)),
    RandomKCodec(RandomKConfig()), RandomKCodec(RandomKConfig(ratio=0.3, rescale=True)),
    SignCodec(SignConfig()), SignCodec(SignConfig(block=16)),
    PowerSGDCodec(PowerSGDConfig()), PowerSGDCodec(PowerSGDConfig(rank=1)),
]
each_codec = pytest.mark.parametrize("codec", CODECS, ids=[spec_string(c) for c in CODECS])


def meta_of(x: torch.Tensor, seed: int = 0, rank: int = 0) -> Meta:
    return Meta(numel=x.numel(), dtype=x.dtype, seed=seed, rank=rank)


def roundtrip(codec: Codec, x: torch.Tensor, seed: int = 0, rank: int = 0) -> torch.Tensor:
    return codec.roundtrip(x, meta_of(x, seed, rank))


def randn(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def wild(n: int, seed: int = 0, decades: float = 30.0) -> torch.Tensor:
    """Normal values times 10**U(-decades, decades): magnitudes vary wildly inside each block."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 10 ** ((torch.rand(n, generator=g) * 2 - 1) * decades)


def adversarial(n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Finite inputs of ``dtype`` (clamped into its range) that break naive implementations."""
    top = torch.finfo(dtype).max
    signs = torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
    cases = {
        "normal": randn(n), "zeros": torch.zeros(n), "huge": randn(n) * 1e30, "tiny": randn(n) * 1e-30,
        "max": signs * top, "mixed": wild(n), "one_spike": torch.zeros(n).index_fill_(0, torch.tensor(n // 2), 1e30),
    }
    return {k: v.clamp(-top, top).to(dtype) for k, v in cases.items()}


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element max |x| of its block, computed independently of the codecs' helpers."""
    pad = -x.numel() % block
    blocks = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, block)
    return blocks.amax(dim=1).repeat_interleave(block)[: x.numel()]


# -- invariants of every codec ------------------------------------------------------------------


@each_codec
def test_payload_bytes_equals_actual_payload(codec):
    for n in (0, 1, 7, 64, 1000, 4097):
        for dtype in DTYPES:
            payload = codec.compress(randn(n, dtype=dtype), Meta(numel=n, dtype=dtype))
            assert payload_nbytes(payload) == codec.payload_bytes(n, dtype), (n, dtype)


@each_codec
def test_payload_layout_depends_only_on_size(codec):
    for n in (1000, 4097):
        layouts = {
            name: [(t.shape, t.dtype) for t in codec.compress(x, Meta(numel=n, seed=s))]
            for s, (name, x) in enumerate(adversarial(n, torch.float32).items())
        }
        assert len(set(map(tuple, layouts.values()))) == 1, layouts


@each_codec
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decodes_finite_values_of_the_right_shape_and_dtype(codec, dtype):
    for name, x in adversarial(777, dtype).items():
        payload = codec.compress(x, meta_of(x, seed=3, rank=1))
        assert all(t.is_contiguous() and t.device == x.device for t in payload), name
        y = codec.decompress(payload, meta_of(x, seed=3, rank=1))
        assert y.shape == (777,) and y.dtype == dtype, name
        assert torch.isfinite(y).all(), (name, y[~torch.isfinite(y)][:4])
        if name == "zeros":
            assert (y == 0).all()


@each_codec
def test_empty_tensor(codec):
    for dtype in DTYPES:
        y = roundtrip(codec, torch.empty(0, dtype=dtype))
        assert y.shape == (0,) and y.dtype == dtype


@each_codec
def test_strided_view_gives_the_same_result_as_a_contiguous_copy(codec):
    base = randn(4000, seed=5)
    view = base[::2]
    assert not view.is_contiguous()
    assert torch.equal(roundtrip(codec, view, seed=9), roundtrip(codec, view.contiguous(), seed=9))


@each_codec
def test_payload_does_not_alias_the_input(codec):
    x = randn(3000, seed=2)
    meta = meta_of(x, seed=4)
    payload = codec.compress(x, meta)
    before = codec.decompress([t.clone() for t in payload], meta)
    x.mul_(-7.0)  # the caller reuses its gradient buffer
    assert torch.equal(codec.decompress(payload, meta), before)


@each_codec
def test_decompress_into_writes_what_decompress_returns(codec):
    x = randn(3000, seed=6)
    meta = meta_of(x, seed=2)
    payload = codec.compress(x, meta)
    out = torch.full((3000,), 7.0)
    assert codec.decompress_into(payload, meta, out) is out
    assert torch.equal(out, codec.decompress(payload, meta))


@pytest.mark.parametrize("codec", [Fp16Codec(Fp16Config()), Bf16Codec(Bf16Config())], ids=spec_string)
def test_cast_clamps_infinities_and_keeps_nan(codec):
    limit = torch.finfo(codec.wire_dtype).max
    (payload,) = codec.compress(torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0]), Meta(numel=4))
    assert payload[:2].float().tolist() == [limit, -limit] and payload[2].isnan() and payload[3] == 1


@each_codec
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf"), 1e38], ids=str)
def test_compress_checked_gives_compress_and_whether_the_input_is_finite(codec, bad):
    """A cast tells finiteness from its payload, with one exception it must catch: a finite value past
    fp16's range rounds to an infinity (clamped; the input was finite)."""
    x = randn(3000, seed=2)
    if bad is not None:
        x[1234] = bad
    payload, finite = codec.compress_checked(x, meta_of(x, 5))
    expected = codec.compress(x, meta_of(x, 5))
    assert finite == bool(torch.isfinite(x).all())
    assert len(payload) == len(expected)
    for a, b in zip(payload, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@each_codec
def test_same_meta_same_payload(codec):
    x = randn(5000, seed=1)
    a, b = codec.compress(x, meta_of(x, 11, 2)), codec.compress(x, meta_of(x, 11, 2))
    assert all(torch.equal(s, t) for s, t in zip(a, b))


# -- casts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_none_is_lossless(dtype):
    for name, x in adversarial(1000, dtype).items():
        assert torch.equal(roundtrip(NoneCodec(NoneConfig()), x), x), name


def test_fp16_relative_error_and_clamp():
    x = wild(10_000, decades=4)  # |x| within fp16's normal range [6.1e-5, 65504]
    x = x[(x.abs() > 6.2e-5) & (x.abs() < 65000)]
    err = (roundtrip(Fp16Codec(Fp16Config()), x) - x).abs()
    assert (err <= 2**-11 * x.abs()).all()
    clamped = roundtrip(Fp16Codec(Fp16Config()), torch.tensor([1e30, -1e30, 7e4]))
    assert clamped.tolist() == [65504.0, -65504.0, 65504.0]


def test_bf16_relative_error():
    x = wild(10_000, decades=30)
    err = (roundtrip(Bf16Codec(Bf16Config()), x) - x).abs()
    assert (err <= 2**-8 * x.abs()).all()


SUMMABLE_IN_ONE_ROUND = [c for c in CODECS if c.summable and c.name != "powersgd"]  # powersgd: 2 rounds


@pytest.mark.parametrize("codec", SUMMABLE_IN_ONE_ROUND, ids=spec_string)
def test_summed_payloads_decode_to_the_sum(codec):
    """What an all-reduce of the payloads gives: decode(p0 + p1) == roundtrip(x0) + roundtrip(x1)."""
    x0, x1 = randn(1000, seed=1) / 2, randn(1000, seed=2) / 2
    m0, m1 = meta_of(x0, seed=8, rank=0), meta_of(x1, seed=8, rank=1)
    summed = [a + b for a, b in zip(codec.compress(x0, m0), codec.compress(x1, m1))]
    expected = codec.roundtrip(x0, m0) + codec.roundtrip(x1, m1)
    assert torch.allclose(codec.decompress(summed, m0), expected, rtol=2**-7, atol=1e-6)


# -- int8 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [8, 256])
@pytest.mark.parametrize("stochastic", [False, True])
def test_int8_per_block_error_bound(block, stochastic, bits):
    """|err| <= absmax / 254 (nearest) or < absmax / 127 (stochastic), absmax of the value's block (/ 14 and / 7
    at 4 bits); plus 2**-22 absmax for fp32 rounding of q * scale and of the subtraction."""
    codec = Int8Codec(Int8Config(block=block, stochastic=stochastic, bits=bits))
    qmax = 127 if bits == 8 else 7
    for x in (randn(5000), wild(5000, decades=20), randn(5000, dtype=torch.float16).float()):
        absmax = block_absmax(x, block)
        bound = absmax / (qmax if stochastic else 2 * qmax) + absmax * 2**-22
        assert ((roundtrip(codec, x, seed=3) - x).abs() <= bound).all()


def test_int8_at_4_bits_sends_half_the_bytes_and_uses_all_fifteen_levels():
    """Two values a byte: the payload is half int8's (plus the same scales), and every level -7..7 decodes to itself
    (a packing that mixed up nibbles or values would move them)."""
    four, eight = Int8Codec(Int8Config(bits=4)), Int8Codec(Int8Config())
    assert four.payload_bytes(1000) == 4 * 256 // 2 + 4 * 4 and eight.payload_bytes(1000) == 4 * 256 + 4 * 4
    x = torch.arange(-7.0, 8.0).repeat(20)[:256] * 0.5  # absmax 3.5: q = 2x (the scale is one ulp under 0.5)
    assert torch.allclose(roundtrip(four, x), x, rtol=1e-6, atol=0)
    assert four.compress(x, meta_of(x))[0].dtype == torch.uint8
    for bad in ({"bits": 3}, {"bits": 16}, {"bits": True}, {"bits": 4, "block": 9}):
        with pytest.raises(ConfigError, match="int8.b"):
            Int8Config(**bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_inputs_meet_the_fp32_bound_plus_one_rounding(dtype):
    """Codecs compute in fp32; the only extra error is rounding the result to ``dtype`` (half an
    ulp: 2**-11 |y| for fp16, 2**-8 |y| for bf16)."""
    x = randn(4000, seed=3, dtype=dtype)
    half_ulp = torch.finfo(dtype).eps / 2
    for codec, bound in ((Int8Codec(Int8Config()), block_absmax(x.float(), 256) / 254),
                         (BfpCodec(BfpConfig()), torch.exp2(torch.frexp(block_absmax(x.float(), 16))[1] - 7.0))):
        y = roundtrip(codec, x)
        assert y.dtype == dtype
        assert ((y.float() - x.float()).abs() <= bound * (1 + 1e-6) + half_ulp * y.float().abs()).all()


def test_int8_stochastic_rounding_is_unbiased_and_rank_dependent():
    codec, x = Int8Codec(Int8Config(stochastic=True)), randn(256, seed=4)
    draws = 400
    mean = sum(roundtrip(codec, x, seed=s) for s in range(draws)) / draws
    scale = x.abs().max() / 127
    assert ((mean - x).abs() <= 5 * scale / (2 * math.sqrt(draws))).all()  # 5 sigma; nearest fails
    q0, q1 = codec.compress(x, meta_of(x, 1, 0))[0], codec.compress(x, meta_of(x, 1, 1))[0]
    assert not torch.equal(q0, q1)


# -- bfp ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(2, 9))
def test_bfp_error_bound_and_shared_exponent(bits):
    """|err| <= 2**(e - mantissa_bits + 1), e = frexp exponent of the block's max |x|."""
    codec = BfpCodec(BfpConfig(block=16, mantissa_bits=bits))
    x = wild(4000, seed=bits, decades=30)
    _, e = torch.frexp(block_absmax(x, 16))
    assert ((roundtrip(codec, x) - x).abs() <= torch.exp2((e - bits + 1).double())).all()
    stored = codec.compress(x, meta_of(x))[1]
    assert torch.equal(stored.long(), (e[::16] - 1).long())  # floor(log2 absmax)


def test_bfp_ratio_and_exact_values():
    codec = BfpCodec(BfpConfig())
    assert 4 * 16_000 / codec.payload_bytes(16_000) == pytest.approx(64 / 17)  # 3.76x
    x = torch.tensor([1.0, -0.5, 0.25, 3.0 / 64] + [0.0] * 12)  # multiples of the step 2**-6
    assert torch.equal(roundtrip(codec, x), x)


# -- qsgd --------------------------------------------------------------------------------------


def test_qsgd_error_per_draw_is_below_one_level():
    for levels in (1, 4, 127):
        codec = QsgdCodec(QsgdConfig(levels=levels, block=512))
        x = wild(3000, seed=levels, decades=3)
        blocks = torch.cat([x, x.new_zeros(-3000 % 512)]).view(-1, 512)
        norms = blocks.norm(dim=1).repeat_interleave(512)[:3000]
        assert ((roundtrip(codec, x, seed=1) - x).abs() <= norms / levels + norms * 2**-22).all()


def test_qsgd_is_unbiased_and_within_the_variance_bound():
    codec, x = QsgdCodec(QsgdConfig(levels=1, block=64)), randn(64, seed=6)
    draws = [roundtrip(codec, x, seed=s) for s in range(2000)]
    mean = sum(draws) / len(draws)
    sigma = x.norm() / (2 * math.sqrt(len(draws)))  # per-value std of one draw <= norm / (2 s)
    assert ((mean - x).abs() <= 5 * sigma).all()
    variance = sum(((d - x) ** 2).sum() for d in draws) / len(draws)
    assert variance <= min(64, 8) * x.norm() ** 2  # Lemma 3.1: min(d / s^2, sqrt(d) / s) ||x||^2


# -- top-k -------------------------------------------------------------------------------------


@pytest.mark.parametrize("numel,ratio,k", [
    (0, 0.01, 0), (1, 0.01, 1), (100, 0.07, 7), (101, 0.01, 2), (50, 1.0, 50), (10**8, 0.01, 10**6),
])
def test_sparse_k(numel, ratio, k):
    assert sparse_k(numel, ratio) == k


@pytest.mark.parametrize("approx", [False, True])
def test_topk_keeps_exactly_the_k_largest(approx):
    g = torch.Generator().manual_seed(1)
    x = (torch.randperm(20_000, generator=g) + 1) / 7 * (torch.rand(20_000, generator=g) - 0.5).sign()
    codec = TopKCodec(TopKConfig(ratio=0.01, approx=approx, sample_size=2000))
    y = roundtrip(codec, x, seed=5)
    expected = torch.topk(x.abs(), 200).indices
    assert set(y.nonzero().squeeze(1).tolist()) == set(expected.tolist())
    assert torch.equal(y[expected], x[expected])


def test_topk_approx_pads_with_zeros_when_the_sample_overshoots():
    """A 1-element sample makes the threshold a lottery: when fewer than k entries pass it, the
    payload is padded (value 0 at index 0) and x[0], the largest, must survive decoding."""
    x = torch.linspace(1.0, 0.001, 1000)
    codec = TopKCodec(TopKConfig(ratio=0.5, approx=True, sample_size=1))
    padded = 0
    for seed in range(20):
        values, idx = codec.compress(x, meta_of(x, seed))
        y = codec.decompress([values, idx], meta_of(x, seed))
        kept = int((y != 0).sum())
        assert values.numel() == 500 and kept <= 500 and y[0] == x[0]
        assert torch.equal(y[:kept], x[:kept]) and (y[kept:] == 0).all()  # a prefix of the largest
        padded += kept < 500
    assert padded > 0


def test_topk_auto_approx_switch():
    codec = TopKCodec(TopKConfig(approx_threshold=100))
    assert codec.uses_approx(100) and not codec.uses_approx(99) and not codec.uses_approx(0)
    assert not TopKCodec(TopKConfig(approx=False)).uses_approx(10**9)


@pytest.mark.parametrize("codec", [TopKCodec(TopKConfig(ratio=1.0)), RandomKCodec(RandomKConfig(ratio=1.0))],
                         ids=spec_string)
def test_ratio_one_is_lossless(codec):
    x = randn(999)
    assert torch.equal(roundtrip(codec, x), x)


# -- random-k ----------------------------------------------------------------------------------


def test_randomk_positions_are_shared_by_ranks_and_one_per_stratum():
    codec, x = RandomKCodec(RandomKConfig(ratio=0.1)), randn(1005)
    supports = [roundtrip(codec, x, seed=3, rank=r).nonzero().squeeze(1) for r in range(3)]
    assert all(torch.equal(s, supports[0]) for s in supports)
    idx, stratum = codec.positions(1005, 3, x.device)
    assert idx.numel() == 101 and torch.equal(idx, supports[0])  # sorted and distinct
    j = torch.arange(101)
    assert ((j * 1005 // 101 <= idx) & (idx < (j + 1) * 1005 // 101)).all()
    assert stratum.sum() == 1005
    assert not torch.equal(codec.positions(1005, 4, x.device)[0], idx)


@pytest.mark.parametrize("rescale", [False, True])
def test_randomk_expectation(rescale):
    """E[x_hat] = x with rescale=true, (k / numel) x without (what error feedback expects)."""
    codec, x = RandomKCodec(RandomKConfig(ratio=0.3, rescale=rescale)), randn(10, seed=7)
    mean = sum(roundtrip(codec, x, seed=s) for s in range(3000)) / 3000
    expected = x if rescale else x * torch.tensor([1 / 3] * 6 + [1 / 4] * 4)  # strata 3, 3, 4
    assert torch.allclose(mean, expected, atol=0.2 * x.abs().max().item())


# -- sign --------------------------------------------------------------------------------------


def test_sign_keeps_signs_and_block_mean_magnitude():
    codec, x = SignCodec(SignConfig(block=64)), wild(1000, decades=2)  # last block: 40 values
    y = roundtrip(codec, x)
    assert ((y > 0) == (x >= 0)).all() and ((y < 0) == (x < 0)).all()
    for start in range(0, 1000, 64):
        xb, yb = x[start : start + 64], y[start : start + 64]
        assert yb.abs().mean() == pytest.approx(xb.abs().mean().item(), rel=1e-5)
        assert (yb.abs() == yb.abs()[0]).all()


def test_sign_payload_is_one_bit_per_value():
    codec = SignCodec(SignConfig(block=8))
    bits, scale = codec.compress(torch.tensor([1.0, -1.0, -2.0, 0.0, 3.0, -1.0, -1.0, 1.0]), Meta(numel=8))
    assert bits.tolist() == [0b10011001] and scale.tolist() == [1.25]


# -- powersgd ----------------------------------------------------------------------------------


def test_powersgd_recovers_a_low_rank_matrix():
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e30, 1e-30):
        x = (torch.randn(64, 3, generator=g) @ torch.randn(3, 64, generator=g)).view(-1) * scale
        y = roundtrip(PowerSGDCodec(PowerSGDConfig(rank=3)), x, seed=1)
        assert ((y - x) / scale).norm() <= 1e-4 * (x / scale).norm()  # norms of 1e-30 values underflow


def test_powersgd_projection_error_is_below_the_norm():
    x = randn(5000)
    for rank in (1, 4, 16):
        assert (roundtrip(PowerSGDCodec(PowerSGDConfig(rank=rank)), x) - x).norm() < x.norm()


def test_orthogonalize_gives_orthonormal_columns_at_any_rank():
    m = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(orthogonalize_(m).T @ m, torch.eye(4), atol=1e-5)
    for z in (torch.zeros(10, 2), torch.ones(10, 3), torch.zeros(10, 2).index_fill_(1, torch.tensor([1]), 1.0)):
        orthogonalize_(z)   # a zero column, dependent columns: still orthonormal (a projection), never NaN
        assert torch.isfinite(z).all() and torch.allclose(z.T @ z, torch.eye(z.shape[1]), atol=1e-5)


def test_powersgd_shapes_and_prices():
    assert matrix_view(6 * 3 * 3 * 3, (6, 3, 3, 3)) == (6, 27) and matrix_view(10, (10,)) is None
    assert matrix_view(0, (0, 5)) is None
    assert near_square(10) == (4, 3) and near_square(16) == (4, 4) and near_square(0) == (0, 0)
    assert payload_bytes_matrix(100, 50, 4) == (100 + 50) * 4 * 4 == 2400
    assert payload_bytes_matrix(3, 1000, 4) == (3 + 1000) * 3 * 4  # rank clamped to min(m, n)
    assert not should_compress(10, 10, 4, 2.0)  # (10 + 10) * 4 * 2 = 160 >= 100
    assert should_compress(100, 100, 4, 2.0)  # 1600 < 10000
    assert PowerSGDCodec(PowerSGDConfig()).payload_bytes(10) == (4 + 3) * 3 * 4



def test_capability_flags():
    flags = {c.name: (c.summable, c.sparse, c.shared_randomness, c.lossless) for c in CODECS}
    assert flags == {
        "none": (True, False, False, True), "fp16": (True, False, False, False), "bf16": (True, False, False, False),
        "int8": (False, False, False, False), "bfp": (False, False, False, False), "qsgd": (False, False, False, False),
        "topk": (False, True, False, False), "randomk": (True, True, True, False), "sign": (False, False, False, False),
        "powersgd": (True, False, False, False),
    }


def test_mix_seed_separates_ranks_and_seeds():
    seeds = {mix_seed(s, r) for s in range(50) for r in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
