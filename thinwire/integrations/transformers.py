"""thinwire in the Hugging Face ``Trainer``: a callback that attaches the hook once the Trainer has
wrapped the model in DDP, and keeps every rank's residuals beside the Trainer's own checkpoints.

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds)
    thinwire.integrations.transformers.attach(trainer, "int8")
    trainer.train()                                 # or trainer.train(resume_from_checkpoint=True)

Launch as the Trainer is launched for DDP (``torchrun --nproc-per-node N train.py``). At each save,
every rank writes its hook state to ``checkpoint-STEP/thinwire_rank{R}.pt`` (atomically), next to the
Trainer's ``rng_state_{R}.pth``; a run resumed from a checkpoint under ``output_dir`` reads it back. The
Trainer's loop owns the optimizer step, so sync modes (local SGD, DiLoCo) are not offered here; use
accelerate or a plain DDP loop for them. Install with ``pip install 'thinwire[transformers]'``.

End the script with ``trainer.accelerator.wait_for_everyone()`` then ``trainer.accelerator.end_training()``:
the hook has its own gloo group, and a rank that exits (tearing gloo down) while a peer still talks on
it can abort ("terminate called without an active exception"; seen once in the tests' runs).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from thinwire.api import attach as _attach
from thinwire.integrations import check_hook_kwargs, hook_codec, log, need, to_cpu, world
from thinwire.train.checkpoint import save_atomic

need("transformers", "transformers")
from transformers import TrainerCallback  # noqa: E402


def state_file(output_dir, step: int, rank: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}" / f"thinwire_rank{rank}.pt"


class ThinwireCallback(TrainerCallback):
    """Attaches thinwire's hook to ``trainer.model_wrapped`` when training begins; ``comm`` is the
    ``CommState`` from then on (``None`` on one process, where the Trainer does not wrap the model)."""

    def __init__(self, trainer, codec: str = "int8", **attach_kwargs) -> None:
        self.trainer = trainer
        self.codec = hook_codec(codec, "thinwire.integrations.transformers")  # bad specs fail here
        check_hook_kwargs(attach_kwargs, "thinwire.integrations.transformers.attach")
        self.attach_kwargs = attach_kwargs
        self.comm = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            if world()[1] == 1:
                log.info("thinwire: one process, the Trainer did not wrap the model in DDP: nothing to attach")
                return
            raise TypeError(f"thinwire needs the Trainer to wrap the model in DistributedDataParallel, got "
                            f"{type(model).__name__}; FSDP, DeepSpeed and DataParallel are not supported")
        existing = getattr(model, "_thinwire_state", None)  # a second train() on the same wrapped model
        self.comm = existing if existing is not None else _attach(model, self.codec, **self.attach_kwargs)
        if state.global_step > 0:
            self._restore(args.output_dir, state.global_step)

    def _restore(self, output_dir, step: int) -> None:
        rank, size = world()
        path = state_file(output_dir, step, rank)
        if not path.exists():
            others = sorted(path.parent.glob("thinwire_rank*.pt"))
            if others:  # a run of fewer ranks saved it: this rank has none of its own
                log.warning("thinwire: %s holds the state of %d rank(s), this run has %d; error-feedback residuals start "
                            "empty", path.parent, len(others), size)
            else:
                log.warning("thinwire: resumed at step %d but %s does not exist (a checkpoint from outside output_dir, "
                            "or saved without thinwire); error-feedback residuals start empty", step, path)
            return
        saved = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain containers
        if saved["world_size"] != size:
            log.warning("thinwire: %s was saved by a run of %d ranks, this one has %d; residuals start empty",
                        path, saved["world_size"], size)
            return
        self.comm.load_state_dict(saved["state"])

    def on_save(self, args, state, control, **kwargs):
        if self.comm is None:
            return
        rank, size = world()
        path = state_file(args.output_dir, state.global_step, rank)
        if path.parent.is_dir():  # the Trainer's checkpoint folder (shared or per node): ours beside its files
            save_atomic({"world_size": size, "state": to_cpu(self.comm.state_dict())}, path)


def attach(trainer, codec: str = "int8", **kwargs) -> ThinwireCallback:
    """Add thinwire's callback to ``trainer`` (keywords as in :func:`thinwire.attach`); the returned
    callback's ``comm`` holds the hook's state and ``stats()`` once training has begun."""
    callback = ThinwireCallback(trainer, codec, **kwargs)
    trainer.add_callback(callback)
    return callback
