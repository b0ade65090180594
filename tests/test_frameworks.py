"""thinwire inside Lightning, accelerate and the Hugging Face Trainer, each on 2 CPU processes
(torchrun, gloo): the gradient the framework's optimizer sees is every rank's gradient averaged
through thinwire's int8 codec (within int8's error, the same on both ranks, the hook's counters say
int8 travelled), and the framework's own checkpoint restores every rank's error-feedback residuals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.frameworks import common
from tests.test_cli import ROOT

pytestmark = pytest.mark.slow

WORKERS = ROOT / "tests" / "frameworks"
INT8_TOL = 0.03  # int8 with per-block scales: about 1% relative error on this gradient; one rank's own gradient is ~50% off


def torchrun(script: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{script.name} {args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def check_averaged_int8(out: Path) -> list[dict]:
    """Step 0's gradient on each rank is the int8 average of both ranks' gradients; returns the end states."""
    got = [load(out / f"grads_rank{r}.pt") for r in range(2)]
    ref = common.reference_grads(world=2)
    own = []  # rank 0's gradient alone, to show the tolerance separates averaged from not
    net = common.make_net()
    common.loss_fn(net, *common.batch(0, 0)).backward()
    own = common.grads(net)
    assert common.rel_err(own, ref) > 10 * INT8_TOL
    assert common.rel_err(got[0], ref) < INT8_TOL
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)  # every rank decodes the same average
    ends = [load(out / f"end_rank{r}.pt") for r in range(2)]
    for end in ends:
        assert end["stats"]["counts"].get("int8", 0) > 0, end["stats"]
        assert end["stats"]["bytes_sent"] < end["stats"]["bytes_raw"] / 3
        residuals = end["state"]["residuals"]
        assert any(float(t.abs().sum()) > 0 for t in residuals["buckets"].values()) or \
            any(float(t.abs().sum()) > 0 for t in residuals["params"].values())
    return ends


def check_restored(ends: list[dict], out: Path) -> None:
    for r in range(2):
        start = load(out / f"start_state_rank{r}.pt")
        assert start["step"] == ends[r]["state"]["step"] > 0
        # the counters go on from the saved run: bytes and each codec's count alike
        assert start["counters"] == ends[r]["state"]["counters"] and start["counters"]["counts"]["int8"] > 0
        torch.testing.assert_close(start["residuals"], ends[r]["state"]["residuals"], rtol=0, atol=0)
    # rank-specific: the two ranks' residuals differ, so each got its own back
    a, b = (load(out / f"start_state_rank{r}.pt")["residuals"] for r in range(2))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(a, b)


def test_lightning_strategy_averages_int8_and_checkpoint_restores_residuals(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    torchrun(WORKERS / "lightning_worker.py", "--out", str(first), "--steps", "6")
    ends = check_averaged_int8(first)
    saved = load(first / "last.ckpt")["thinwire"]
    assert saved["world_size"] == 2
    for r in range(2):
        torch.testing.assert_close(saved["ranks"][r]["comm"]["residuals"], ends[r]["state"]["residuals"], rtol=0, atol=0)
    torchrun(WORKERS / "lightning_worker.py", "--out", str(second), "--steps", "8", "--resume", str(first / "last.ckpt"))
    check_restored(ends, second)


@pytest.mark.parametrize("sync, extra", [("local:period=3,warmup=0", []), ("delayed", []),
                                         ("delayed", ["--clip", "0.5", "--accumulate", "2"]),
                                         ("local:period=3,warmup=0", ["--save-after-fit"])])
def test_lightning_sync_mode_resumes_exactly(tmp_path, sync, extra):
    """Local SGD in Lightning (int8 parameter averages every 3 steps, SGD with momentum): 4 steps, a
    checkpoint between averages (the ranks' parameters and momenta differ), 4 more from it, ends
    where 8 straight steps end, on every rank, bit for bit. delayed likewise: its first step after the resume
    predicts its weights with the optimizer (the strategy tells the mode before the step's forward), also where
    Lightning clips the gradients and where the first micro-batch's forward runs before the optimizer's step. And from
    trainer.save_checkpoint after fit, where every rank holds the ranks' average: it stored that as each rank's own
    model, so the fit resumed from it was not the straight run (0.016 apart)."""
    straight, first, resumed = (tmp_path / n for n in ("straight", "first", "resumed"))
    for d in (straight, first, resumed):
        d.mkdir()
    mode = ["--sync", sync, *extra]
    torchrun(WORKERS / "lightning_worker.py", "--out", str(straight), "--steps", "8", *mode)
    torchrun(WORKERS / "lightning_worker.py", "--out", str(first), "--steps", "4", *mode)
    ckpt = first / ("after.ckpt" if "--save-after-fit" in extra else "last.ckpt")
    saved = load(ckpt)["thinwire"]
    if sync.startswith("local"):
        a, b = (saved["ranks"][r]["model"] for r in range(2))
        assert any(not torch.equal(a[k], b[k]) for k in a), "the checkpoint should fall between averages"
    torchrun(WORKERS / "lightning_worker.py", "--out", str(resumed), "--steps", "8", "--resume", str(ckpt), *mode)
    for r in range(2):
        want, got = load(straight / f"end_rank{r}.pt"), load(resumed / f"end_rank{r}.pt")
        torch.testing.assert_close(got["params"], want["params"], rtol=0, atol=0)
        assert got["stats"]["counts"].get("int8", 0) > 0


def test_lightning_local_checkpoint_holds_the_average_and_resumes_equal_ranks_under_allreduce(tmp_path):
    """A checkpoint written between two local SGD averages (not at validation) holds the ranks' average as
    Lightning's state_dict (what a job of another size, or inference, loads); resumed with sync='allreduce',
    every rank goes on from that model, so the ranks end equal (their own models would never meet again)."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir(), resumed.mkdir()
    torchrun(WORKERS / "lightning_worker.py", "--out", str(first), "--steps", "4", "--sync", "local:period=3,warmup=0")
    ckpt = load(first / "last.ckpt")
    a, b = (ckpt["thinwire"]["ranks"][r]["model"] for r in range(2))
    assert any(not torch.equal(a[k], b[k]) for k in a), "the checkpoint should fall between averages"
    for k, v in ckpt["state_dict"].items():
        torch.testing.assert_close(v, (a[k] + b[k]) / 2, rtol=1e-6, atol=1e-7)
    torchrun(WORKERS / "lightning_worker.py", "--out", str(resumed), "--steps", "6", "--resume", str(first / "last.ckpt"))
    ends = [load(resumed / f"end_rank{r}.pt")["params"] for r in range(2)]
    torch.testing.assert_close(ends[0], ends[1], rtol=0, atol=0)


def test_lightning_diloco_checkpoint_resumed_as_local_sgd_starts_every_rank_from_the_average(tmp_path):
    """A checkpoint between two DiLoCo outer steps resumed under local SGD (another mode whose ranks differ): every
    rank starts from the ranks' average, so the first average leaves them equal. Each rank's own model as local
    SGD's fresh anchor kept them apart for good (the same averaged change added to two different anchors)."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir(), resumed.mkdir()
    torchrun(WORKERS / "lightning_worker.py", "--out", str(first), "--steps", "4", "--sync", "diloco:period=3")
    torchrun(WORKERS / "lightning_worker.py", "--out", str(resumed), "--steps", "6", "--resume", str(first / "last.ckpt"),
             "--sync", "local:period=2,warmup=0")
    ends = [load(resumed / f"end_rank{r}.pt")["params"] for r in range(2)]
    torch.testing.assert_close(ends[0], ends[1], rtol=0, atol=0)


def test_lightning_strategy_checks_its_keywords_before_any_process_starts():
    """timeout_s, nonfinite, sync=None, a keyword neither thinwire's nor DDP's, and static_graph with a mode
    that runs under no_sync: each refused where the strategy is built, naming it."""
    from thinwire.integrations.lightning import ThinwireStrategy

    for kw, says in ((dict(timeout_s=-1), "timeout_s"), (dict(nonfinite="ignore"), "nonfinite"),
                     (dict(sync=None), "sync must be a sync spec"), (dict(bogus_kw=1), "unknown keyword 'bogus_kw'"),
                     (dict(sync="delayed", static_graph=True), "static_graph=True runs with sync='allreduce' only")):
        with pytest.raises((TypeError, ValueError), match=says):
            ThinwireStrategy("int8", **kw)
    ThinwireStrategy("int8", static_graph=True, find_unused_parameters=False, nonfinite="raise", timeout_s=30)


def test_lightning_refuses_a_sync_mode_with_two_optimizers(tmp_path):
    """A mode averages once per step: with two optimizers Lightning would step it twice per batch."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKERS / "lightning_worker.py"), "--out", str(tmp_path), "--steps", "2", "--sync",
                           "local:period=2", "--two-optimizers"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode != 0
    assert "sync=local runs one optimizer, and configure_optimizers returned 2" in proc.stdout + proc.stderr


def test_lightning_validates_the_ranks_average_and_trains_on_untouched(tmp_path):
    """Local SGD averaging every 4 steps, validation every 3: at step 3 the ranks differ; validation sees
    their average on both ranks, ModelCheckpoint's save at validation's end holds the average as
    Lightning's state_dict and each rank's own under "thinwire", and training goes on as without it."""
    plain, val = tmp_path / "plain", tmp_path / "val"
    for d in (plain, val):
        d.mkdir()
    mode = ["--sync", "local:period=4,warmup=0", "--steps", "7"]
    torchrun(WORKERS / "lightning_worker.py", "--out", str(plain), *mode)
    torchrun(WORKERS / "lightning_worker.py", "--out", str(val), *mode, "--val")
    own = [load(val / f"own_rank{r}_step3.pt") for r in range(2)]
    assert any(not torch.equal(a, b) for a, b in zip(*own)), "the ranks should differ between averages"
    mean = [(a + b) / 2 for a, b in zip(*own)]
    for r in range(2):
        torch.testing.assert_close(load(val / f"val_rank{r}_step3.pt"), mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(load(val / f"end_rank{r}.pt")["params"], load(plain / f"end_rank{r}.pt")["params"],
                                   rtol=0, atol=0)
    ckpt = load(next((val / "val_ckpt").glob("*step=3.ckpt")))
    torch.testing.assert_close(list(ckpt["state_dict"].values()), mean, rtol=1e-6, atol=1e-7)
    for r in range(2):
        torch.testing.assert_close(list(ckpt["thinwire"]["ranks"][r]["model"].values()), own[r], rtol=0, atol=0)


def test_lightning_validate_after_fit_evaluates_the_ranks_average(tmp_path):
    """trainer.validate after a fit whose ranks differ (local SGD, 6 steps, averages every 4) evaluated rank 0's own
    model on every rank (Lightning sends rank 0's parameters to all before it validates): every rank now ends fit
    holding the ranks' average, the model the run stands for."""
    out = tmp_path / "run"
    out.mkdir()
    torchrun(WORKERS / "lightning_worker.py", "--out", str(out), "--sync", "local:period=4,warmup=0", "--steps", "6",
             "--validate-after-fit")
    own = [load(out / f"own_rank{r}_step6.pt") for r in range(2)]
    assert any(not torch.equal(a, b) for a, b in zip(*own)), "the ranks should differ between averages"
    mean = [(a + b) / 2 for a, b in zip(*own)]
    for r in range(2):
        torch.testing.assert_close(load(out / f"valvalidate_rank{r}_step6.pt"), mean, rtol=1e-6, atol=1e-7)


def test_accelerate_attach_averages_int8_and_save_state_restores_residuals(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    torchrun(WORKERS / "accelerate_worker.py", "--out", str(first), "--steps", "6")
    ends = check_averaged_int8(first)
    torchrun(WORKERS / "accelerate_worker.py", "--out", str(second), "--steps", "2", "--resume", str(first / "state"))
    check_restored(ends, second)


@pytest.mark.parametrize("sync, extra", [("local:period=3,warmup=0", ()), ("delayed", ()),
                                         ("local:period=3,warmup=0", ("--save-in-consensus",))])
def test_accelerate_sync_mode_resumes_exactly_between_two_averages(tmp_path, sync, extra):
    """Local SGD through thinwire.integrations.accelerate.sync (int8 averages every 3 steps, SGD with momentum):
    save_state after 4 steps (the ranks' parameters and momenta differ), load_state and 4 more steps end where
    8 straight steps end, on every rank, bit for bit. accelerate's own checkpoint holds rank 0's model and
    optimizer only: without every rank's own, both ranks went on from rank 0's."""
    straight, first, resumed = (tmp_path / n for n in ("straight", "first", "resumed"))
    for d in (straight, first, resumed):
        d.mkdir()
    worker = WORKERS / "accelerate_sync_worker.py"
    torchrun(worker, "--out", str(straight), "--steps", "8", "--sync", sync)
    torchrun(worker, "--out", str(first), "--steps", "4", "--sync", sync, *extra)  # in consensus: its own saved
    if sync.startswith("local"):
        a, b = (load(first / f"end_rank{r}.pt")["params"] for r in range(2))
        assert any(not torch.equal(x, y) for x, y in zip(a, b)), "the state should be saved between averages"
    torchrun(worker, "--out", str(resumed), "--first-step", "4", "--steps", "8", "--resume", str(first / "state"),
             "--sync", sync)
    for r in range(2):
        want, got = load(straight / f"end_rank{r}.pt"), load(resumed / f"end_rank{r}.pt")
        torch.testing.assert_close(got["params"], want["params"], rtol=0, atol=0)
        assert got["stats"]["counts"].get("int8", 0) > 0


@pytest.mark.parametrize("sync", ["local:period=3,warmup=1", "delayed"])
def test_accelerate_gradient_accumulation_steps_the_mode_once_per_optimizer_step(tmp_path, sync):
    """accelerate's gradient accumulation (2 micro-batches per optimizer step) ends where one batch per step ends:
    the mode counted micro-batches as steps (local: its period and warm-up halved) and ``delayed`` averaged and
    applied half-accumulated gradients."""
    one, two = tmp_path / "one", tmp_path / "two"
    for d, k in ((one, "1"), (two, "2")):
        d.mkdir()
        torchrun(WORKERS / "accelerate_sync_worker.py", "--out", str(d), "--steps", "7", "--sync", sync, "--codec", "none",
                 "--accumulate", k)
    for r in range(2):
        want, got = load(one / f"end_rank{r}.pt"), load(two / f"end_rank{r}.pt")
        torch.testing.assert_close(got["params"], want["params"], rtol=1e-5, atol=1e-6)
        assert got["stats"]["collectives"] == want["stats"]["collectives"] > 0


def test_accelerate_resume_into_another_mode(tmp_path):
    """save_state of attach() resumed with sync() (its mode starts fresh; was a KeyError in every worker), and of
    DiLoCo between two outer steps resumed as local SGD: every rank starts from the ranks' average, so the first
    average leaves them equal (each rank's own model as its anchor kept them apart for good)."""
    hook, diloco, resumed = (tmp_path / n for n in ("hook", "diloco", "resumed"))
    for d in (hook, diloco, resumed):
        d.mkdir()
    worker = WORKERS / "accelerate_sync_worker.py"
    torchrun(WORKERS / "accelerate_worker.py", "--out", str(hook), "--steps", "2")
    torchrun(worker, "--out", str(resumed), "--first-step", "2", "--steps", "3", "--resume", str(hook / "state"))
    torchrun(worker, "--out", str(diloco), "--steps", "4", "--sync", "diloco:period=3")
    torchrun(worker, "--out", str(resumed), "--first-step", "4", "--steps", "6", "--resume", str(diloco / "state"),
             "--sync", "local:period=2,warmup=0")
    ends = [load(resumed / f"end_rank{r}.pt")["params"] for r in range(2)]
    torch.testing.assert_close(ends[0], ends[1], rtol=0, atol=0)


def test_hf_trainer_callback_averages_int8_and_resume_restores_residuals(tmp_path):
    torchrun(WORKERS / "transformers_worker.py", "--out", str(tmp_path), "--steps", "6")
    ends = check_averaged_int8(tmp_path)
    for r in range(2):
        assert (tmp_path / "run" / "checkpoint-6" / f"thinwire_rank{r}.pt").exists()
    torchrun(WORKERS / "transformers_worker.py", "--out", str(tmp_path), "--steps", "8", "--resume")
    check_restored(ends, tmp_path)


def test_bad_codec_is_refused_before_launch():
    from thinwire.errors import ConfigError
    from thinwire.integrations.lightning import ThinwireStrategy

    with pytest.raises(ConfigError, match="int9"):
        ThinwireStrategy("int9")
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        ThinwireStrategy("int8", ddp_comm_hook=lambda *a: None)
    with pytest.raises(ConfigError, match="sync"):
        ThinwireStrategy("int8", sync="local:period=0")
    with pytest.raises(ConfigError):
        ThinwireStrategy("auto", sync="local:period=4")  # auto is a DDP-hook policy: no sync mode
    # these were taken here and failed in every spawned rank with a traceback
    with pytest.raises(ConfigError, match=r"codec: must be a thinwire codec or auto, got 'torch:fp16'"):
        ThinwireStrategy("torch:fp16")
    with pytest.raises(TypeError, match=r"ThinwireStrategy: codec must be a spec string .*got None"):
        ThinwireStrategy(None)
    with pytest.raises(ValueError, match=r"warmup_steps must be an integer >= 0, got -3"):
        ThinwireStrategy("int8", warmup_steps=-3)


def test_hf_attach_checks_its_codec_and_keywords_when_called():
    """They were checked when training began, in every rank (with one process, never)."""
    from types import SimpleNamespace

    from thinwire.errors import ConfigError
    from thinwire.integrations.transformers import attach

    trainer = SimpleNamespace(add_callback=lambda cb: None)
    with pytest.raises(TypeError, match=r"unknown keyword 'sync'.*sync modes are offered in Lightning and accelerate"):
        attach(trainer, "int8", sync="local:period=4")
    with pytest.raises(ValueError, match=r"warmup_steps must be an integer >= 0, got -3"):
        attach(trainer, "int8", warmup_steps=-3)
    with pytest.raises(ConfigError, match=r"must be a thinwire codec or auto, got 'torch:bf16'"):
        attach(trainer, "torch:bf16")
    assert attach(trainer, "int8", warmup_steps=2, timeout_s=30).attach_kwargs == {"warmup_steps": 2, "timeout_s": 30}


@pytest.mark.parametrize("script,args", [
    ("lightning_train.py", ["--steps", "20", "--sync", "diloco:period=5"]),
    ("accelerate_train.py", ["--steps", "20", "--sync", "local:period=4"]),
    ("hf_trainer.py", ["--steps", "20"]),
])
def test_framework_examples_run(script, args, tmp_path):
    proc = torchrun(ROOT / "examples" / script, *args, "--out", str(tmp_path))
    assert "MB sent" in proc.stdout, proc.stdout[-2000:]


def test_accelerate_sync_on_one_process_runs_the_same_loop_and_averages_nothing():
    from accelerate import Accelerator

    from thinwire.integrations.accelerate import OneProcess, sync

    accelerator = Accelerator(cpu=True)
    net = common.make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = accelerator.prepare(net, opt)
    mode = sync(accelerator, model, "local:period=4", "int8", optimizer=opt)
    assert isinstance(mode, OneProcess) and mode.comm is None
    before = [p.detach().clone() for p in model.parameters()]
    with mode.no_sync():
        accelerator.backward(common.loss_fn(model, *common.batch(0, 0)))
    mode.step(opt)
    with mode.consensus():
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_accelerate_on_one_process_checks_what_several_would_and_has_every_method_of_a_mode():
    """On one process attach and sync returned at once: 'int9', a misspelt keyword or 'local' without a period
    surfaced only on the first run on several; and a loop calling before_step/after_step itself failed."""
    from accelerate import Accelerator

    from thinwire.errors import ConfigError
    from thinwire.integrations.accelerate import attach, sync

    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(common.make_net(), torch.optim.SGD(common.make_net().parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="int9"):
        attach(accelerator, model, "int9")
    with pytest.raises(TypeError, match="error_feedbak"):
        attach(accelerator, model, "int8", error_feedbak=False)
    with pytest.raises(ConfigError, match=r"sync\.period: must be given"):
        sync(accelerator, model, "local", "int8")
    with pytest.raises(ConfigError, match="locall"):
        sync(accelerator, model, "locall:period=4")
    with pytest.raises(TypeError, match="error_feedbak"):
        sync(accelerator, model, "local:period=4", error_feedbak=False)
    tensors = len(list(model.parameters()))
    with pytest.raises(ConfigError, match=rf"sync\.fragments: must be at most {tensors}, the model's trainable"):
        sync(accelerator, model, f"diloco:period={2 * tensors},fragments={2 * tensors}")  # taken on one process only
    mode = sync(accelerator, model, "local:period=4", "int8", optimizer=opt)
    accelerator.backward(common.loss_fn(model, *common.batch(0, 0)))
    mode.before_step()
    opt.step()
    mode.after_step()
    mode.load_state_dict(mode.state_dict())


def test_an_accelerate_checkpoint_moves_between_one_process_and_several(tmp_path):
    """On one process nothing registered with accelerate, so its checkpoint and one of several processes had
    different counts of objects and neither loaded into the other ('Number of custom checkpoints ...')."""
    two, one, back = tmp_path / "two", tmp_path / "one", tmp_path / "back"
    for d in (two, one, back):
        d.mkdir()
    worker = WORKERS / "accelerate_worker.py"
    torchrun(worker, "--out", str(two), "--steps", "2")
    alone = subprocess.run([sys.executable, str(worker), "--out", str(one), "--steps", "2", "--resume",
                            str(two / "state")], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "holds state for 2 ranks, this run has 1" in alone.stderr, alone.stderr[-3000:]
    torchrun(worker, "--out", str(back), "--steps", "2", "--resume", str(one / "state"))
    for r in range(2):  # from one process's checkpoint: nothing of its own to restore, residuals start empty
        assert not load(back / f"start_state_rank{r}.pt")["residuals"].get("params")


def test_an_accelerate_sync_checkpoint_between_averages_resumes_on_one_process_from_the_ranks_average(tmp_path):
    """accelerate's model file holds rank 0's own model: a run of another size went on from it, not from the ranks'
    average (which the checkpoint holds every part of), as thinwire train and Lightning's strategy do."""
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir(), one.mkdir()
    worker = WORKERS / "accelerate_sync_worker.py"
    torchrun(worker, "--out", str(two), "--steps", "4", "--sync", "local:period=8,warmup=0")
    alone = subprocess.run([sys.executable, str(worker), "--out", str(one), "--first-step", "4", "--steps", "4",
                            "--resume", str(two / "state"), "--sync", "local:period=8,warmup=0"],
                           capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "this run of another size starts from their average" in alone.stderr, alone.stderr[-3000:]
    ranks = [load(two / f"end_rank{r}.pt")["params"] for r in range(2)]
    assert any(not torch.equal(a, b) for a, b in zip(*ranks)), "saved between averages: the ranks' models differ"
    got = load(one / "end_rank0.pt")["params"]
    torch.testing.assert_close(got, [(a + b) / 2 for a, b in zip(*ranks)], rtol=1e-6, atol=1e-7)


def test_a_resume_under_the_same_modes_name_with_other_settings_says_so(caplog):
    """Classic and streaming DiLoCo are both ``diloco``: a checkpoint of one resumed as the other is refused by its
    state's keys, and the warning says the settings differ (it named the mode it resumed into as 'another')."""
    import logging

    from thinwire.integrations import load_mode_state

    class Mode:
        name, loaded = "diloco", None

        def check_state(self, state):
            if set(state) != {"steps", "syncs", "anchors", "momenta", "inflight"}:
                raise ValueError("keys")

        def load_state_dict(self, state):
            self.loaded = state

    m = Mode()
    with caplog.at_level(logging.WARNING):
        load_mode_state(m, {"sync": {"steps": 3, "anchor": [], "momentum": []}, "sync_name": "diloco"}, "the checkpoint")
    assert m.loaded == {}
    assert "another sync mode's state (diloco with other settings: its state's keys are not this run's)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_mode_state(m, {"sync": {"steps": 3}, "sync_name": "local"}, "the checkpoint")
    assert "another sync mode's state (local); diloco's own starts fresh" in caplog.text


def test_hf_resume_on_more_ranks_says_the_checkpoint_has_fewer_not_that_it_is_foreign(tmp_path, monkeypatch, caplog):
    """Resumed on 3 ranks from a checkpoint of 2, rank 2 was told its file was missing: 'a checkpoint from outside
    output_dir, or saved without thinwire'."""
    import logging

    from thinwire.integrations import transformers as tw_hf

    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    for r in range(2):
        torch.save({"world_size": 2, "state": {}}, folder / f"thinwire_rank{r}.pt")
    monkeypatch.setattr(tw_hf, "world", lambda: (2, 3))
    callback = tw_hf.ThinwireCallback.__new__(tw_hf.ThinwireCallback)
    callback.comm = None
    with caplog.at_level(logging.WARNING):
        callback._restore(tmp_path, 5)
    assert "holds the state of 2 rank(s), this run has 3" in caplog.text and "outside output_dir" not in caplog.text
