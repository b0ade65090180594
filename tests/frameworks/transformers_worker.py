"""Hugging Face Trainer worker for tests/test_frameworks.py (torchrun --nproc-per-node 2): trains
``--steps`` steps with thinwire's callback, checkpointing at the last step; saves step 0's averaged
gradient, the hook's state at the end and (``--resume``) right after training begins."""

import argparse
import os
import sys

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

from thinwire.integrations.transformers import attach  # noqa: E402


class Model(nn.Module):
    """Each call takes this rank's batch for the Trainer's current step (the Trainer's sampler only
    decides how many calls there are), so the test knows every rank's data."""

    def __init__(self):
        super().__init__()
        self.net, self.step = common.make_net(), 0

    def forward(self, idx, labels=None):
        x, y = common.batch(int(os.environ["RANK"]), self.step)
        return {"loss": common.loss_fn(self.net, x, y)}


class Record(TrainerCallback):
    def __init__(self, model, hook, out):
        self.model, self.hook, self.out = model, hook, out
        self.rank = int(os.environ["RANK"])

    def on_train_begin(self, args, state, control, **kw):
        self.model.step = state.global_step
        torch.save(self.hook.comm.state_dict(), f"{self.out}/start_state_rank{self.rank}.pt")

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if state.global_step == 0:
            torch.save(common.grads(self.model.net), f"{self.out}/grads_rank{self.rank}.pt")

    def on_step_end(self, args, state, control, **kw):
        self.model.step = state.global_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = Model()
    args = TrainingArguments(output_dir=f"{a.out}/run", max_steps=a.steps, per_device_train_batch_size=1,
                             learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", use_cpu=True,
                             save_strategy="steps", save_steps=6, report_to=[], logging_steps=1000,
                             disable_tqdm=True, ddp_backend="gloo")
    data = [{"idx": torch.tensor(i)} for i in range(1000)]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    hook = attach(trainer, a.codec)
    trainer.add_callback(Record(model, hook, a.out))
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    rank = int(os.environ["RANK"])
    torch.save({"state": hook.comm.state_dict(), "stats": hook.comm.stats()}, f"{a.out}/end_rank{rank}.pt")
    trainer.accelerator.wait_for_everyone()  # leave together: gloo torn down while a peer still talks aborts
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's C++ static destructors, which can abort a finished run at exit ("terminate called ...")
