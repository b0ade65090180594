"""Lightning worker for tests/test_frameworks.py (torchrun --nproc-per-node 2):
trains ``--steps`` steps with ThinwireStrategy (``--sync`` a sync mode), saves step 0's averaged gradient, the hook's state
after training and (``--resume CKPT``) the state right after a resume, under ``--out``."""

import argparse
import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

from thinwire.integrations.lightning import ThinwireStrategy  # noqa: E402


class Module(pl.LightningModule):
    def __init__(self, out):
        super().__init__()
        self.net, self.out = common.make_net(), out

    def training_step(self, idx, i):
        x, y = common.batch(self.global_rank, self.global_step)
        return common.loss_fn(self.net, x, y)

    def on_after_backward(self):
        if self.global_step == 0:
            torch.save(common.grads(self.net), f"{self.out}/grads_rank{self.global_rank}.pt")

    def on_train_start(self):
        comm = self.trainer.strategy.comm
        torch.save(comm.state_dict(), f"{self.out}/start_state_rank{self.global_rank}.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(1000), batch_size=1)


class TwoOptimizers(Module):
    """--two-optimizers: manual optimization with one optimizer per half of the parameters."""

    def __init__(self, out):
        super().__init__(out)
        self.automatic_optimization = False

    def training_step(self, idx, i):
        loss = super().training_step(idx, i)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        params = list(self.parameters())
        return [torch.optim.SGD(params[:len(params) // 2], lr=0.05), torch.optim.SGD(params[len(params) // 2:], lr=0.05)]


class Validated(Module):
    """--val: validates every 3 steps, saving each rank's own parameters before and those validation sees."""

    def on_train_batch_end(self, outputs, batch, i):
        if self.global_step % 3 == 0:
            torch.save([p.detach().clone() for p in self.parameters()], f"{self.out}/own_rank{self.global_rank}_step{self.global_step}.pt")

    def validation_step(self, idx, i):
        fn = self.trainer.state.fn  # trainer.validate after fit: "validate"
        tag = "" if fn == "fit" else str(getattr(fn, "value", fn))
        torch.save([p.detach().clone() for p in self.parameters()],
                   f"{self.out}/val{tag}_rank{self.global_rank}_step{self.global_step}.pt")
        x, y = common.batch(self.global_rank, 10_000)
        self.log("val_loss", common.loss_fn(self.net, x, y), sync_dist=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(1), batch_size=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--sync", default="allreduce")
    ap.add_argument("--val", action="store_true", help="validate every 3 steps; ModelCheckpoint's default saves then")
    ap.add_argument("--two-optimizers", action="store_true")
    ap.add_argument("--validate-after-fit", action="store_true", help="trainer.validate once fit is done")
    ap.add_argument("--clip", type=float, help="gradient_clip_val")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--save-after-fit", action="store_true", help="trainer.save_checkpoint(OUT/after.ckpt) after fit")
    a = ap.parse_args()
    torch.set_num_threads(1)
    module = (Validated if a.val or a.validate_after_fit else TwoOptimizers if a.two_optimizers else Module)(a.out)
    callbacks = [ModelCheckpoint(dirpath=a.out, save_last=True, every_n_train_steps=a.steps)]
    if a.val:
        callbacks.append(ModelCheckpoint(dirpath=f"{a.out}/val_ckpt", save_top_k=-1))   # at each validation's end
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ThinwireStrategy(a.codec, sync=a.sync), max_steps=a.steps,
                         use_distributed_sampler=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, val_check_interval=3 if a.val else None,
                         limit_val_batches=1 if a.val or a.validate_after_fit else None, num_sanity_val_steps=0,
                         callbacks=callbacks, gradient_clip_val=a.clip, accumulate_grad_batches=a.accumulate)
    trainer.fit(module, ckpt_path=a.resume)
    if a.save_after_fit:
        trainer.save_checkpoint(f"{a.out}/after.ckpt")
    if a.validate_after_fit:
        trainer.validate(module, verbose=False)
    comm = trainer.strategy.comm
    params = [p.detach().clone() for p in module.parameters()]
    torch.save({"state": comm.state_dict(), "stats": comm.stats(), "params": params}, f"{a.out}/end_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's C++ static destructors, which can abort a finished run at exit ("terminate called ...")
