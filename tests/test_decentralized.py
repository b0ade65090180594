"""Decentralized modes. Gossip (D-PSGD): its topologies mix doubly stochastically, 4 gloo ranks equal
a closed-form reference of local SGD steps then neighbour averages, it sends ``degree`` parameter
copies per step, its spec refuses what it cannot run, a resume through ``thinwire train`` is
bit-identical. Dynamic averaging: a threshold no drift reaches never averages, one every drift
reaches is local SGD with the check period, and its resume is bit-identical too."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from thinwire.compress.sync.gossip import TOPOLOGIES, degree, neighbours
from thinwire.errors import ConfigError
from thinwire.syncspec import parse_sync_spec
from tests.distributed import run_ranks
from tests.test_sync import STEPS, _assert_equal, _grads_one, _net, _sgd, _straight_and_resumed, _train


def mixing(topology: str, world: int, step: int) -> torch.Tensor:
    w = torch.zeros(world, world, dtype=torch.float64)
    for i in range(world):
        recv = neighbours(topology, i, world, step)[1]
        for j in [i, *recv]:
            w[i, j] += 1 / (1 + len(recv))
    return w


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 8, 9])
def test_every_topology_mixes_doubly_stochastically(topology, world):
    for step in range(6):
        for i in range(world):
            send, recv = neighbours(topology, i, world, step)
            assert i not in send and i not in recv
            for j in send:  # what i sends, j expects from i
                assert i in neighbours(topology, j, world, step)[1]
        w = mixing(topology, world, step)
        torch.testing.assert_close(w.sum(0), torch.ones(world, dtype=torch.float64))
        torch.testing.assert_close(w.sum(1), torch.ones(world, dtype=torch.float64))


def test_exp2_spreads_every_rank_to_every_rank_in_log2_p_steps():
    for world in (4, 8, 16):
        product = torch.eye(world, dtype=torch.float64)
        for step in range(int(math.log2(world))):
            product = mixing("exp2", world, step) @ product
        torch.testing.assert_close(product, torch.full((world, world), 1 / world, dtype=torch.float64))


@pytest.mark.parametrize("topology", ["ring", "exp2", "random"])
def test_four_ranks_equal_local_sgd_then_neighbour_averages(topology):
    out = run_ranks(_train, 4, f"gossip:topology={topology}", "none")
    ws = [_net().state_dict() for _ in range(4)]
    for step in range(STEPS):
        ws = [_sgd(w, _grads_one(w, step, r)) for r, w in enumerate(ws)]
        mix = mixing(topology, 4, step)
        ws = [{k: sum(float(mix[i, j]) * ws[j][k] for j in range(4) if mix[i, j] > 0) for k in ws[0]} for i in range(4)]
    for r in range(4):
        for k in ws[r]:
            torch.testing.assert_close(out[r]["params"][k], ws[r][k], rtol=1e-5, atol=1e-6)
    assert len({tuple(out[r]["params"]["weight"].flatten().tolist()) for r in range(4)}) > 1  # ranks differ
    numel = 5 * 3 + 3
    assert out[0]["sent"] == [4 * numel * len(neighbours(topology, 0, 4, s)[0]) for s in range(STEPS)]


@pytest.mark.parametrize("topology", ["ring", "exp2"])
def test_overlapped_gossip_mixes_each_round_in_one_step_later(topology):
    """``overlap=1`` (SGP's overlap): the round started after step t (the parameters then) is mixed into
    step t+1's parameters as the correction ``w sum_j (x_j^t - x_i^t)``; the last round stays in flight."""
    out = run_ranks(_train, 4, f"gossip:topology={topology},overlap=1", "none")
    ws, sent = [_net().state_dict() for _ in range(4)], None
    for step in range(STEPS):
        ws = [_sgd(w, _grads_one(w, step, r)) for r, w in enumerate(ws)]
        if sent is not None:
            for i in range(4):
                recv = neighbours(topology, i, 4, step - 1)[1]
                ws[i] = {k: ws[i][k] + (sum(sent[j][k] for j in recv) - len(recv) * sent[i][k]) / (1 + len(recv))
                         for k in ws[i]}
        sent = [{k: v.clone() for k, v in w.items()} for w in ws]
    for r in range(4):
        for k in ws[r]:
            torch.testing.assert_close(out[r]["params"][k], ws[r][k], rtol=1e-5, atol=1e-6)
    numel = 5 * 3 + 3
    assert out[0]["sent"] == [4 * numel * len(neighbours(topology, 0, 4, s)[0]) for s in range(STEPS)]


def test_gossip_on_a_complete_graph_equals_all_reduce_averaging():
    """Two ranks are each other's only neighbour: every step ends with both at the exact average, as
    local SGD averaging after every step (an all-reduce)."""
    gossip = run_ranks(_train, 2, "gossip:topology=ring", "none")
    allreduce = run_ranks(_train, 2, "local:period=1,warmup=0", "none")
    for r in range(2):
        for k in gossip[r]["params"]:
            torch.testing.assert_close(gossip[r]["params"][k], allreduce[r]["params"][k], rtol=1e-6, atol=1e-7)


def test_spec_and_refusals():
    assert parse_sync_spec("gossip").topology == "exp2"
    assert parse_sync_spec("gossip:topology=RING").text == "gossip:topology=ring"
    with pytest.raises(ConfigError, match="sync.topology.*exp2, ring, torus, random.*star"):
        parse_sync_spec("gossip:topology=star")
    from thinwire.commspec import check_sync_pairing, parse_comm_spec

    with pytest.raises(ConfigError, match="sync.topology.*ring, torus or exp2 with --compression int8"):
        check_sync_pairing(parse_sync_spec("gossip:topology=random"), parse_comm_spec("int8"))   # any two ranks pair
    check_sync_pairing(parse_sync_spec("gossip:topology=ring"), parse_comm_spec("int8"))   # CHOCO, gamma auto 1
    check_sync_pairing(parse_sync_spec("gossip"), parse_comm_spec("int8"))   # exp2: a public copy per edge
    with pytest.raises(ConfigError, match="sync.gamma.*explicit consensus step.*topk"):
        check_sync_pairing(parse_sync_spec("gossip:topology=ring"), parse_comm_spec("topk:ratio=0.01"))
    check_sync_pairing(parse_sync_spec("gossip:topology=ring,gamma=0.1"), parse_comm_spec("topk:ratio=0.01"))
    with pytest.raises(ConfigError, match=r"sync\.gamma: must be left out with a lossless codec \(--compression none\)"):
        check_sync_pairing(parse_sync_spec("gossip:topology=ring,gamma=0.3"), parse_comm_spec("none"))  # had no effect
    with pytest.raises(ConfigError, match="compression.*other than powersgd"):
        check_sync_pairing(parse_sync_spec("gossip:topology=torus,gamma=0.5"), parse_comm_spec("powersgd"))
    for bad in ("gossip:gamma=0", "gossip:gamma=1.5", "gossip:gamma=nan", "local:period=4,gamma=0.5"):
        with pytest.raises(ConfigError, match="sync"):
            parse_sync_spec(bad)
    assert parse_sync_spec("gossip:topology=ring,gamma=0.25").text == "gossip:topology=ring,gamma=0.25"
    assert parse_sync_spec("gossip:overlap=1").text == "gossip:topology=exp2,overlap=1"
    for bad in ("gossip:overlap=2", "local:period=4,overlap=1", "dynamic:overlap=1"):
        with pytest.raises(ConfigError, match="sync"):
            parse_sync_spec(bad)
    assert degree("ring", 8) == 2 and degree("exp2", 8) == 1 and degree("torus", 9) == 4 and degree("ring", 2) == 1
    from thinwire.compress.sync.gossip import check_topology

    check_topology("torus", 4)
    for world in (2, 3, 5, 7):
        with pytest.raises(ConfigError, match="sync.topology.*torus"):
            check_topology("torus", world)


def _train_choco_exact(rank: int, world: int, topology: str) -> dict:
    """CHOCO's code path with an exact codec (``none``): must be D-PSGD's average."""
    from torch.nn.parallel import DistributedDataParallel

    import thinwire
    from tests.test_sync import LR, _data, _loss

    ddp = DistributedDataParallel(_net())
    sync = thinwire.sync(ddp, f"gossip:topology={topology}", codec="none")
    sync.choco = True
    sync.start_public()
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _data(step, rank)
        with sync.no_sync():
            _loss(ddp, x, y).backward()
        sync.step(opt)
        opt.zero_grad(set_to_none=True)
    sync.close()
    return {"params": {k: v.clone() for k, v in ddp.module.state_dict().items()}}


@pytest.mark.parametrize("topology,world", [("ring", 4), ("exp2", 4), ("exp2", 3)])   # exp2: a copy per edge
def test_compressed_gossip_with_an_exact_codec_is_d_psgd(topology, world):
    choco = run_ranks(_train_choco_exact, world, topology)
    plain = run_ranks(_train, world, f"gossip:topology={topology}", "none")
    assert len({tuple(choco[r]["params"]["weight"].flatten().tolist()) for r in range(world)}) > 1   # ranks differ
    for r in range(world):
        for k in plain[r]["params"]:
            torch.testing.assert_close(choco[r]["params"][k], plain[r]["params"][k], rtol=1e-5, atol=1e-6)


def _consensus(rank: int, world: int, codec: str, spec: str, rounds: int) -> dict:
    """Ranks start apart and only gossip (no gradient): CHOCO keeps the mean and contracts to it."""
    from torch.nn.parallel import DistributedDataParallel

    import thinwire

    torch.manual_seed(rank)
    ddp = DistributedDataParallel(torch.nn.Linear(64, 32))
    with torch.no_grad():
        for p in ddp.module.parameters():
            p.copy_(torch.randn_like(p) * (rank + 1))   # replicas differ (DDP broadcast rank 0's weights)
    start = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    sync = thinwire.sync(ddp, spec, codec=codec)
    sent = []
    for _ in range(rounds):
        before = sync.comm.wire.bytes_sent
        sync.after_step()
        sent.append(sync.comm.wire.bytes_sent - before)
    state, stats = sync.state_dict(), sync.comm.stats()
    sync.close()
    return {"start": start, "end": {k: v.clone() for k, v in ddp.module.state_dict().items()}, "sent": sent,
            "state": state, "stats": stats}


@pytest.mark.parametrize("codec,spec", [("int8", "gossip:topology=ring"), ("topk:ratio=0.1", "gossip:topology=ring,gamma=0.3"),
                                        ("int8", "gossip:topology=exp2"), ("bfp", "gossip:topology=exp2"),
                                        ("int8", "gossip:topology=exp2,overlap=1")])
def test_compressed_gossip_keeps_the_mean_and_reaches_consensus(codec, spec):
    out = run_ranks(_consensus, 4, codec, spec, 60)
    for k in out[0]["end"]:
        mean0 = sum(o["start"][k] for o in out) / 4
        mean1 = sum(o["end"][k] for o in out) / 4
        torch.testing.assert_close(mean1, mean0, rtol=1e-4, atol=1e-4)   # doubly stochastic: the mean stays
        spread0 = max(float((o["start"][k] - mean0).abs().max()) for o in out)
        spread1 = max(float((o["end"][k] - mean1).abs().max()) for o in out)
        assert spread1 < 0.05 * spread0, (k, spread0, spread1)
    numel = 64 * 32 + 32
    from thinwire.compress.spec import parse_codec_spec

    payload = parse_codec_spec(codec).payload_bytes(numel)
    assert payload < numel * 4 / 3   # compressed
    # the codec's runs and time counted as the hook counts them (gossip said {} and 0 s while it compressed)
    assert out[0]["stats"]["counts"] == {parse_codec_spec(codec).name: 60} and out[0]["stats"]["compress_s"] > 0
    if "exp2" in spec:   # one peer per step; a public copy per edge: to and from ranks 2^0 and 2^1 away
        assert out[0]["sent"] == [payload] * 60
        assert set(out[0]["state"]["public"]) == {"to:1", "to:2", "from:3", "from:2"}
    else:   # two ring neighbours; its own public copy and its neighbours'
        assert out[0]["sent"] == [2 * payload] * 60
        assert set(out[0]["state"]["public"]) == {"0", "1", "3"}


@pytest.mark.parametrize("spec", ["gossip:topology=exp2", "gossip:topology=ring,overlap=1"])
def test_compressed_gossip_on_one_rank_keeps_its_parameters(spec):
    out = run_ranks(_consensus, 1, "int8", spec, 3)
    for k in out[0]["end"]:
        torch.testing.assert_close(out[0]["end"][k], out[0]["start"][k], rtol=0, atol=0)
    assert out[0]["sent"] == [0, 0, 0]


def test_priced_from_the_all_reduce():
    from thinwire.compress.sync import StepParts, kind

    spec = parse_sync_spec("gossip:topology=ring")
    parts = StepParts(allreduce_step_s=0.3, compute_s=0.1, comm_s=0.15, codec_s=0.0, hosts=4)
    # ring: 2 copies of the parameters out, an all-reduce sends 1.5: 0.1 + 0.15 * 2 / 1.5
    assert kind(spec).step_s(spec, parts) == pytest.approx(0.3)
    overlapped = parse_sync_spec("gossip:topology=ring,overlap=1")   # the slower of compute and the copies
    assert kind(spec).step_s(overlapped, parts) == pytest.approx(0.2)
    assert kind(spec).step_s(overlapped, dataclasses.replace(parts, compute_s=0.25)) == pytest.approx(0.25)
    assert kind(spec).bytes_per_step(spec, 1500, hosts=4) == pytest.approx(2000)


@pytest.mark.slow
@pytest.mark.parametrize("codec,topology", [("none", "ring"), ("int8", "ring"),   # int8: CHOCO's public copies (per
                                            ("none", "exp2,overlap=1"), ("int8", "exp2,overlap=1")])   # edge on exp2); a round in flight
def test_resume_is_bit_identical_through_the_trainer(tmp_path, codec, topology):          # public copies too
    common = ["--workload", "digits", "--nproc", "2", "--compression", codec, "--sync", f"gossip:topology={topology}",
              "--eval-every", "5"]
    a, b = _straight_and_resumed(common, tmp_path / "straight", tmp_path / "split")
    for ra, rb in zip(a["ranks"], b["ranks"]):
        _assert_equal(ra["sync"], rb["sync"])
        _assert_equal(ra["model"], rb["model"])
    # validation's averages are counted over the whole run, as training's bytes are (the split run's first part
    # also validated at its last step)
    consensus = [json.loads((tmp_path / o / "summary.json").read_text())["bytes_sent_consensus_all_ranks"]
                 for o in ("straight", "split")]
    assert consensus[1] >= consensus[0] > 0, consensus


# -- dynamic averaging ------------------------------------------------------------------------------
def test_dynamic_never_averages_below_its_threshold_and_always_above_it():
    never = run_ranks(_train, 2, "dynamic:threshold=9,check_every=2", "none")
    assert not all(torch.equal(never[0]["params"][k], never[1]["params"][k]) for k in never[0]["params"])
    assert never[0]["sent"] == [0, 1, 0, 1, 0, 1]  # a one-byte vote every 2 steps, nothing else
    always = run_ranks(_train, 2, "dynamic:threshold=1e-9,check_every=2", "none")
    local = run_ranks(_train, 2, "local:period=2,warmup=0", "none")
    for r in range(2):
        for k in local[r]["params"]:
            torch.testing.assert_close(always[r]["params"][k], local[r]["params"][k], rtol=0, atol=0)
    numel = 5 * 3 + 3
    assert always[0]["sent"] == [0, 1 + 4 * numel] * 3


def test_dynamic_on_one_worker_checks_nothing_and_reports_no_averages():
    (one,) = run_ranks(_train, 1, "dynamic:threshold=1e-9,check_every=2", "none")
    assert one["sent"] == [0] * STEPS and one["stats"] == {"checks": 0, "syncs": 0, "sync_rate": None}


def _spread(rank: int, world: int, same: bool) -> dict:
    """Ranks move from a common anchor, each its own way (or all the same way): rule=spread's value
    against the exact spread around the ranks' mean, and rule=drift's own drift."""
    from torch.nn.parallel import DistributedDataParallel

    import thinwire

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(100, 100))
    sync = thinwire.sync(ddp, "dynamic:rule=spread", codec="none")
    sync.before_step()   # the anchor: the common start
    common = torch.Generator().manual_seed(1)
    mine = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for p in ddp.module.parameters():
            p.add_(torch.randn(p.shape, generator=common))   # all ranks alike: not a spread
            if not same:
                p.add_(0.3 * torch.randn(p.shape, generator=mine))
    out = {"spread": sync.spread(), "drift": sync.drift(),
           "x": torch.cat([p.detach().flatten() for p in ddp.module.parameters()]),
           "a": torch.cat(sync.anchor)}
    sync.close()
    return out


def test_dynamic_spread_is_the_ranks_spread_around_their_mean():
    out = run_ranks(_spread, 4, False)
    xs = torch.stack([o["x"] for o in out]).double()
    exact = float((xs - xs.mean(0)).pow(2).sum(1).mean().sqrt() / out[0]["a"].double().norm())
    assert len({o["spread"] for o in out}) == 1   # one value on every rank: one decision
    assert out[0]["spread"] == pytest.approx(exact, rel=0.2)   # a 256-value sketch of 10,100 values
    assert out[0]["drift"] > 3 * exact   # the drift rule also counts the ranks' common motion
    alike = run_ranks(_spread, 4, True)
    assert alike[0]["spread"] < 1e-6 and alike[0]["drift"] > 1   # moved together: nothing to average


def _by_lr(rank: int, world: int) -> dict:
    """dynamic:threshold=9,by_lr=1: no drift reaches 9 at the peak learning rate; once the rate falls to a
    billionth, the threshold does too, and the drift made at the peak rate crosses it (one average); the
    drift made at the small rate is as much smaller as the threshold, and does not."""
    from torch.nn.parallel import DistributedDataParallel

    import thinwire
    from tests.test_sync import LR, _data, _loss

    ddp = DistributedDataParallel(_net())
    mode = thinwire.sync(ddp, "dynamic:threshold=9,check_every=2,by_lr=1", codec="none")
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    syncs = []
    for step in range(8):
        if step == 4:
            opt.param_groups[0]["lr"] = LR * 1e-9
        x, y = _data(step, rank)
        with mode.no_sync():
            _loss(ddp, x, y).backward()
        mode.step(opt)
        opt.zero_grad(set_to_none=True)
        syncs.append(mode.syncs)
    state = mode.state_dict()
    mode.close()
    return {"syncs": syncs, "peak": state["lr_peak"]}


def test_dynamic_by_lr_scales_the_threshold_by_the_learning_rate():
    out = run_ranks(_by_lr, 2)
    from tests.test_sync import LR

    assert out[0]["syncs"] == [0, 0, 0, 0, 0, 1, 1, 1] and out[0]["peak"] == LR   # checks after steps 2, 4, 6, 8


def test_dynamic_spec():
    spec = parse_sync_spec("dynamic")
    assert parse_sync_spec("dynamic:rule=spread").text == "dynamic:threshold=0.05,check_every=4,warmup=0,rule=spread"
    with pytest.raises(ConfigError, match="sync.rule"):
        parse_sync_spec("dynamic:rule=norm")
    assert parse_sync_spec("dynamic:by_lr=1").text == "dynamic:threshold=0.05,check_every=4,warmup=0,by_lr=1"
    for bad in ("dynamic:by_lr=2", "local:period=4,by_lr=1"):
        with pytest.raises(ConfigError, match="sync"):
            parse_sync_spec(bad)
    assert (spec.threshold, spec.check_every, spec.warmup) == (0.05, 4, 0)
    assert parse_sync_spec("dynamic:threshold=0.05,check_every=8").text == "dynamic:threshold=0.05,check_every=8,warmup=0"
    for bad, key in (("dynamic:threshold=0", "threshold"), ("dynamic:threshold=-1", "threshold"),
                     ("dynamic:check_every=0", "check_every")):
        with pytest.raises(ConfigError, match=f"sync.{key}"):
            parse_sync_spec(bad)


def test_dynamic_prices_its_checks_bytes():
    """At most an average per check, plus the check's all-reduce: a byte's vote or the spread rule's 2 KiB sketch."""
    from thinwire.compress.sync import kind
    from thinwire.compress.sync.dynamic import SKETCH

    drift, spread = parse_sync_spec("dynamic:check_every=4"), parse_sync_spec("dynamic:check_every=4,rule=spread")
    assert kind(drift).bytes_per_step(drift, 1000, hosts=4) == pytest.approx((1000 + 1.5) / 4)
    assert kind(spread).bytes_per_step(spread, 1000, hosts=4) == pytest.approx((1000 + 1.5 * (SKETCH + 2) * 8) / 4)


@pytest.mark.slow
def test_dynamic_resume_is_bit_identical_and_reports_its_rate(tmp_path):
    import json

    common = ["--workload", "digits", "--nproc", "2", "--compression", "int8", "--sync",
              "dynamic:threshold=0.002,check_every=2", "--eval-every", "5"]
    a, b = _straight_and_resumed(common, tmp_path / "straight", tmp_path / "split")
    for ra, rb in zip(a["ranks"], b["ranks"]):
        _assert_equal(ra["sync"], rb["sync"])
        _assert_equal(ra["model"], rb["model"])
        _assert_equal(ra["comm"]["residuals"], rb["comm"]["residuals"])
    sync = json.loads((tmp_path / "straight" / "summary.json").read_text())["sync"]
    assert sync["mode"].startswith("dynamic") and sync["checks"] == 5 and 0 <= sync["syncs"] <= 5
