"""A codec added in this file alone: registered, it runs through ``attach``, the model prices it exactly
as the hook sends it, ``thinwire codecs`` and ``thinwire simulate`` show it, and the planner and
``auto`` take it as a candidate. No other file knows its name."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import check_int, param
from thinwire.compress.spec import REGISTRY, default_candidates, parse_codec_spec, register_codec


@dataclasses.dataclass(kw_only=True, frozen=True)
class Int4Config:
    block: int = param(64, "2..4096 (even)", "values sharing one fp32 scale")

    def __post_init__(self) -> None:
        check_int("int4.block", self.block, 2, 4096, "E.g. int4:block=64.")
        if self.block % 2:
            raise ValueError(f"int4.block must be even, got {self.block}")


class Int4Codec(Codec):
    """Block-wise absmax 4-bit quantization, two values per byte: levels -7..7 and one fp32 scale per block."""

    name = "int4"
    candidate = "int4"
    config_cls = Int4Config

    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        b = self.config.block
        flat = torch.nn.functional.pad(x.reshape(-1).float(), (0, -meta.numel % b)).view(-1, b)
        scale = flat.abs().amax(dim=1) / 7
        q = (flat / torch.where(scale > 0, scale, 1.0).unsqueeze(1)).round().clamp(-7, 7).to(torch.uint8) + 8
        q = q.view(-1, 2)
        return [(q[:, 0] | (q[:, 1] << 4)).contiguous(), scale]

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        packed, scale = payload
        q = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1, self.config.block).float() - 8
        return (q * scale.unsqueeze(1)).view(-1)[: meta.numel].to(meta.dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        blocks = math.ceil(numel / self.config.block)
        return blocks * (self.config.block // 2 + 4)


@pytest.fixture
def int4():
    register_codec(Int4Codec)
    try:
        yield Int4Codec
    finally:
        REGISTRY.unregister("int4")


def test_the_new_codec_parses_lists_and_is_a_default_candidate(int4, capsys):
    from thinwire.cli.main import main

    assert isinstance(parse_codec_spec("int4:block=32"), Int4Codec)
    assert "int4" in default_candidates()
    assert default_candidates().index("int8") < default_candidates().index("int4")  # lighter first
    assert main(["codecs"]) == 0
    assert any(line.startswith("int4 ") for line in capsys.readouterr().out.splitlines())
    with pytest.raises(ValueError, match="taken"):
        register_codec(Int4Codec)


def test_after_unregistering_the_name_is_unknown_again():
    from thinwire.errors import ConfigError

    with pytest.raises(ConfigError, match=r"compression: must be one of none, .*got 'int4'"):
        parse_codec_spec("int4")
    assert "int4" not in default_candidates()


def _averaged(rank, world):
    """Each rank's gradient and the one DDP hands back with int4 on the wire, on 2 or 3 ranks."""
    import thinwire
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 32))
    state = thinwire.attach(model, "int4", error_feedback=False, min_compress_bytes=0)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    local = torch.func.grad(lambda w: nn.functional.linear(x, w, model.module.bias).square().sum())(
        model.module.weight.detach())
    state.close()
    return local, model.module.weight.grad, state.stats()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_new_codec_runs_through_attach_and_is_priced_exactly(int4, world):
    from tests.distributed import run_ranks
    from tests.test_perf import _bytes_per_step
    from thinwire.perf.model import Network, bucket_cost
    from thinwire.sim.inputs import codec_model

    results = run_ranks(_averaged, world)
    mean = sum(r[0] for r in results) / world
    for _, got, stats in results:
        assert stats["counts"].get("int4", 0) >= 1, "the bucket must have travelled as int4"
        # 4-bit levels: each of the (one or two) quantizations is off by at most half a step, scale/2
        assert (got - mean).abs().max() <= 2 * mean.abs().max() / 7 / 2 * 1.01 + 1e-6
        assert (got - mean).abs().max() > 0, "a lossy codec changed nothing: the hook fell back to fp32"
    sent, layout = run_ranks(_bytes_per_step, world, ["int4"])[0]["int4"]
    model = codec_model("int4", None, shapes=[shapes for _, shapes in layout])
    net = Network(alpha_s=0.0, beta_s_per_byte=1e-9)
    predicted = sum(bucket_cost(model, i, n, world, net).bytes_sent for i, (n, _) in enumerate(layout))
    assert predicted == sent > 0


def test_simulate_shows_the_new_codec(int4, tmp_path, capsys):
    from tests.test_perf import ROOT, _cli, _profile_file

    cost = {"encode": {"fixed_s": 1e-5, "per_byte_s": 3e-10}, "decode": {"fixed_s": 0, "per_byte_s": 1e-10}}
    prof = _profile_file(tmp_path, codecs={"int4": cost})
    rc = _cli("simulate", "--cluster", ROOT / "examples/clusters/pair-100mbit.yaml", "--profile", prof,
              "--compression", "int4", "--hosts", "2,4", "--out", tmp_path / "sim", "--json")
    assert rc == 0
    points = json.loads(capsys.readouterr().out)["points"]
    per_value = Int4Codec(Int4Config()).payload_bytes(445952) / 445952
    assert [p["hosts"] for p in points] == [2, 4]
    assert points[0]["bytes_per_rank"] < 4 * 445952 * per_value  # int4's bytes, not fp32's


def test_the_planner_takes_the_new_codec_by_default(int4):
    from tests.test_plan import EXAMPLES, profile
    from thinwire.cluster.spec import load_cluster_spec
    from thinwire.measure.file import CodecCost, Cost
    from thinwire.plan.planner import PlanOptions, make_plan

    prof = profile()
    prof.codecs["int4"] = CodecCost(encode=Cost(per_byte_s=1e-9), decode=Cost(per_byte_s=5e-10), ef_error=0.05)
    options = PlanOptions(batch_size=32)
    assert "int4" in options.codecs
    plan = make_plan(load_cluster_spec(EXAMPLES / "pair-100mbit.yaml"), prof, workload="charlm", model={},
                     options=options)
    assert set(plan.chosen.codecs) == {"int4"}  # the fewest bytes of the measured codecs under the cap


def _auto_with_int4(rank, world):
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire
    from thinwire.auto import AutoConfig, AutoPolicy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=0.25)
    # 4 bits leave ~0.13 of a random gradient behind with feedback, over the default cap (0.1)
    policy = AutoPolicy(AutoConfig(warmup_steps=2, baseline_steps=1, check_every=3, max_error=0.2,
                                   candidates=("none", "bf16", "int4")))
    state = thinwire.attach(model, policy)
    policy.link.estimate = lambda p: (1e-4, 8 / 1e6)  # every rank "measures" the same 1 Mbit/s link
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        nn.functional.cross_entropy(model(torch.randn(16, 64, generator=g)),
                                    torch.randint(0, 10, (16,), generator=g)).backward()
        model.zero_grad()
    state.close()
    return policy.decisions


@pytest.mark.slow
def test_auto_takes_the_new_codec_as_a_candidate(int4):
    from tests.distributed import run_ranks
    from thinwire.auto import AutoConfig

    assert "int4" in AutoConfig().candidates
    decisions, other = run_ranks(_auto_with_int4, 2)
    assert decisions == other
    assert "int4" in decisions[0]["shadow_errors"][0]  # guarded like every candidate
    assert "int4" in decisions[0]["choices"].values()  # a slow link: the strongest candidate under the cap


class _ShortCodec(Int4Codec):
    """payload_bytes one byte more than compress gives: every rank receives what payload_bytes says."""
    name = "int4short"
    candidate = None

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return super().payload_bytes(numel, dtype) + 1


class _NanCodec(Int4Codec):
    """Decodes finite gradients to NaN (a scale divided by zero, say)."""
    name = "int4nan"
    candidate = None

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        return torch.full((meta.numel,), float("nan"))


def _broken(rank, world, codec):
    import thinwire
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(nn.Linear(64, 32))
    state = thinwire.attach(model, codec, error_feedback=False, min_compress_bytes=0)
    try:
        model(torch.randn(8, 64)).square().sum().backward()
        return "trained"
    except Exception as e:  # noqa: BLE001 - what reaches the user's loop, whatever DDP wraps it in
        return str(e)
    finally:
        state.close()


@pytest.mark.parametrize("cls, says", [
    (_ShortCodec, r"codec int4short: compress gave \d+ bytes for \d+ values, and payload_bytes\(\d+\) says \d+; they "
                  r"must agree"),
    (_NanCodec, r"codec int4nan decoded bucket 0 at step 0 to non-finite values though every rank's gradient was "
                r"finite")])
def test_a_codec_that_breaks_its_contract_is_named(cls, says):
    """A payload of another size than payload_bytes failed deep in the codec's decode or aborted gloo ("Received data
    size doesn't match expected size"); a codec decoding finite gradients to NaN was blamed on the gradient."""
    import re

    from tests.distributed import run_ranks

    register_codec(cls)
    try:
        for said in run_ranks(_broken, 2, cls.name):
            assert re.search(says, said), said
    finally:
        REGISTRY.unregister(cls.name)


def _gossip_nan(rank, world):
    import thinwire
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = thinwire.sync(model, "gossip:topology=ring,gamma=0.5", codec="int4nan", optimizer=opt)
    try:
        with mode.no_sync():
            model(torch.randn(8, 64)).square().sum().backward()
        mode.step(opt)
        return "trained"
    except FloatingPointError as e:
        return str(e)
    finally:
        mode.close()


def test_a_codec_decoding_to_nan_under_gossip_is_named():
    """CHOCO gossip with such a codec trained on to NaN parameters and exited 0 without a word."""
    from tests.distributed import run_ranks

    register_codec(_NanCodec)
    try:
        for said in run_ranks(_gossip_nan, 2):
            assert said.startswith("gossip: codec int4nan decoded bucket 0 at step 1 to non-finite values"), said
    finally:
        REGISTRY.unregister(_NanCodec.name)
