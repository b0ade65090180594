"""The Hugging Face Trainer with thinwire: the digits classifier on 2 CPU processes, gradients int8
on the wire, residuals saved beside the Trainer's checkpoints.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --codec int8

Needs ``pip install 'thinwire[transformers]'``. thinwire adds one line after building the Trainer.
"""

import argparse
import os
import sys

import torch
from sklearn.datasets import load_digits
from torch import nn
from transformers import Trainer, TrainingArguments

from thinwire.integrations.transformers import attach


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, pixels, labels=None):
        logits = self.net(pixels)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8", help="thinwire codec spec (thinwire codecs lists them)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="runs/hf_trainer", help="the Trainer's output_dir")
    args = ap.parse_args()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    data = [{"pixels": torch.tensor(a / 16.0, dtype=torch.float32), "labels": int(b)} for a, b in zip(x, y)]
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=32,
                              learning_rate=3e-3, use_cpu=not torch.cuda.is_available(), save_steps=args.steps,
                              report_to=[], logging_steps=max(1, args.steps // 5), disable_tqdm=True,
                              ddp_find_unused_parameters=False)
    trainer = Trainer(model=Classifier(), args=targs, train_dataset=data[:1500], eval_dataset=data[1500:],
                      compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(1) == p.label_ids).mean())})
    hook = attach(trainer, args.codec)                                    # <- thinwire
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero() and hook.comm is not None:
        s = hook.comm.stats()
        print(f"val accuracy {metrics['eval_accuracy']:.3f}; {s['bytes_sent'] / 1e6:.2f} MB sent for "
              f"{s['bytes_raw'] / 1e6:.2f} MB of gradients ({args.codec}); world {trainer.args.world_size}")
    trainer.accelerator.wait_for_everyone()  # leave together: gloo torn down while a peer still talks can abort
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's C++ static destructors, which can abort a finished run at exit ("terminate called ...")
