"""thinwire in Hugging Face accelerate: attach the hook to the model ``accelerator.prepare`` returned.

    accelerator = Accelerator(cpu=True)            # or on GPUs: Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    comm = thinwire.integrations.accelerate.attach(accelerator, model, "int8")
    ...the usual accelerate loop (accelerator.backward(loss); optimizer.step())...
    accelerator.save_state("ckpt")                  # every rank's residuals saved with it
    accelerator.wait_for_everyone()                 # then end_training(): ranks leave together

Launch as usual (``accelerate launch --multi_gpu ...`` or ``torchrun ...``). The hook's state is
registered with ``accelerator.register_for_checkpointing``, so ``save_state`` / ``load_state`` carry
every rank's error-feedback residuals. Sync modes work in an accelerate loop as in any DDP loop:
``thinwire.sync(model, "local:period=8", codec="int8")`` (see ``examples/accelerate_train.py``).
End with ``accelerator.wait_for_everyone()`` before ``end_training()``: the hook has its own gloo group,
and a rank that tears gloo down while a peer is still writing its checkpoint can abort
("terminate called without an active exception"; about 1 run in 10 on 2 CPU processes without it).
Install with ``pip install 'thinwire[accelerate]'``.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from thinwire.api import attach as _attach
from thinwire.integrations import gather_states, log, need, rank_state

need("accelerate", "accelerate")


class RankStates:
    """The hook's state for ``accelerator.register_for_checkpointing``: ``state_dict`` gathers every
    rank's (accelerate calls it on every rank and writes rank 0's), ``load_state_dict`` keeps this
    rank's."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def state_dict(self) -> dict:
        return gather_states({"comm": self.comm.state_dict()})

    def load_state_dict(self, sd: dict) -> None:
        mine = rank_state(sd, "the accelerate checkpoint")
        if mine is not None:
            self.comm.load_state_dict(mine["comm"])


def attach(accelerator, model, codec: str = "int8", **kwargs):
    """thinwire's hook on ``model`` (as returned by ``accelerator.prepare``), its state registered for
    checkpointing; keywords as in :func:`thinwire.attach`. Returns the ``CommState``, or ``None`` when
    the accelerator runs one process (accelerate then does not wrap the model: nothing is averaged)."""
    if not isinstance(model, DistributedDataParallel):
        if accelerator.num_processes == 1:
            log.info("thinwire: one process, the model is not wrapped in DDP: nothing to attach")
            return None
        raise TypeError(f"thinwire.integrations.accelerate.attach needs the model accelerator.prepare returned "
                        f"(a DistributedDataParallel), got {type(model).__name__}; only DDP is supported "
                        "(not FSDP or DeepSpeed, which average gradients their own way)")
    comm = _attach(model, codec, **kwargs)
    accelerator.register_for_checkpointing(RankStates(comm))
    return comm
