"""thinwire in PyTorch Lightning: a DDP strategy whose gradients travel through a thinwire codec, or
whose averaging follows a thinwire sync mode (local SGD, DiLoCo, delayed).

    from thinwire.integrations.lightning import ThinwireStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ThinwireStrategy("int8"))
    trainer.fit(model)            # gradients averaged int8 on the wire, with error feedback
    trainer.strategy.comm.stats() # bytes sent, per-codec counts

    ThinwireStrategy("int8", sync="diloco:period=100")   # inner steps local, outer Nesterov every 100

Why a strategy and not ``DDPStrategy(ddp_comm_hook=...)``: Lightning registers a communication hook
only on CUDA (its ``_register_ddp_hooks``), so on CPU (gloo) the hook would be silently ignored; and
thinwire's hook needs its process group and the wrapped model, which exist only after setup. Every
rank's state is saved into Lightning's checkpoint (key ``"thinwire"``): the residuals, the sync mode's
state and, for modes whose ranks diverge between averages (local SGD, DiLoCo, gossip, dynamic), every
rank's parameters and optimizer state; ``trainer.fit(model, ckpt_path=...)`` restores them. With such a
mode, validation evaluates the ranks' average (:meth:`~thinwire.compress.sync.base.SyncMode.consensus`,
as ``thinwire train`` does), and a checkpoint written during validation (``ModelCheckpoint``'s default,
at validation's end) holds that average as Lightning's ``state_dict`` and each rank's own parameters
under ``"thinwire"``, so the resume stays exact. Install with ``pip install 'thinwire[lightning]'``.
"""

from __future__ import annotations

from typing import Any

from thinwire.api import attach, sync
from thinwire.commspec import check_sync_pairing
from thinwire.compress.hook import MIN_COMPRESS_BYTES
from thinwire.integrations import (check_hook_kwargs, gather_states, hook_codec, load_mode_state, load_own_model,
                                   log, mode_record, need, rank_state)
from thinwire.syncspec import parse_sync_spec

pl = need("pytorch_lightning", "lightning")
from pytorch_lightning.strategies import DDPStrategy  # noqa: E402


def check_ddp_kwargs(kwargs: dict) -> None:
    """The keywords left for ``DDPStrategy``, which hands what it does not take itself to
    ``DistributedDataParallel`` only at setup, in every process: a typo would surface there."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    known = {n for f in (DDPStrategy.__init__, DistributedDataParallel.__init__)
             for n in inspect.signature(f).parameters if n not in ("self", "kwargs", "module")}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"ThinwireStrategy: unknown keyword {unknown[0]!r}: neither thinwire's (codec, sync, "
                        "error_feedback, warmup_steps, min_compress_bytes, nonfinite, timeout_s) nor DDPStrategy's or "
                        f"DistributedDataParallel's ({', '.join(sorted(known))})")


class ThinwireStrategy(DDPStrategy):
    """``DDPStrategy`` with thinwire's averaging: ``codec`` is any ``--compression`` form (``"int8"``,
    ``"topk:ratio=0.01"``, ``"auto"``; see ``thinwire codecs``); ``sync`` a ``--sync`` form
    (``"allreduce"``, the default, ``"delayed"``, ``"local:period=8"``, ``"diloco:period=100"``);
    ``error_feedback``, ``warmup_steps``, ``min_compress_bytes``, ``nonfinite`` and ``timeout_s`` as in
    :func:`thinwire.attach`; every other keyword goes to ``DDPStrategy`` and from it to
    ``DistributedDataParallel`` (``find_unused_parameters``, ``static_graph`` with ``allreduce``, ...). A sync
    mode supports one optimizer. On one process nothing is attached (nothing to average; ``comm`` stays None)."""

    strategy_name = "thinwire"

    def __init__(self, codec: str = "int8", *, sync: str = "allreduce", error_feedback: bool = True,
                 warmup_steps: int = 0, min_compress_bytes: int = MIN_COMPRESS_BYTES, nonfinite: str = "skip",
                 timeout_s: float | None = None, **ddp_kwargs: Any) -> None:
        from thinwire.syncspec import SyncSpec

        for key in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if key in ddp_kwargs:
                raise ValueError(f"ThinwireStrategy: {key}= is Lightning's own hook setting; thinwire's hook "
                                 "replaces it (pass codec= or sync= instead, or use DDPStrategy for PyTorch's hooks)")
        check_ddp_kwargs(ddp_kwargs)
        # bad specs fail here, before any process starts
        self.codec = hook_codec(codec, "ThinwireStrategy")
        check_hook_kwargs(dict(error_feedback=error_feedback, warmup_steps=warmup_steps,
                               min_compress_bytes=min_compress_bytes, nonfinite=nonfinite, timeout_s=timeout_s),
                          "ThinwireStrategy")
        if not isinstance(sync, (str, SyncSpec)):
            raise TypeError(f"ThinwireStrategy: sync must be a sync spec string such as 'allreduce', 'delayed' or "
                            f"'local:period=8' (see thinwire.syncspec), got {sync!r}")
        self.sync_spec = parse_sync_spec(sync) if isinstance(sync, str) else sync
        self.sync_spec = check_sync_pairing(self.sync_spec, self.codec, error_feedback=error_feedback is not False)
        if self.sync_spec.mode != "allreduce" and ddp_kwargs.get("static_graph"):
            raise ValueError(f"ThinwireStrategy: static_graph=True runs with sync='allreduce' only; "
                             f"sync={self.sync_spec.mode!r} skips DDP's all-reduce on its steps (no_sync), which a "
                             "static graph does not allow. Drop static_graph, or use sync='allreduce'")
        super().__init__(**ddp_kwargs)
        self._kwargs = dict(error_feedback=error_feedback, warmup_steps=warmup_steps)
        self._hook_kwargs = dict(min_compress_bytes=min_compress_bytes, nonfinite=nonfinite, timeout_s=timeout_s)
        self.comm = None        # the CommState, once the model is wrapped
        self.mode = None        # the SyncMode, when sync is not allreduce
        self._restored = None   # this rank's state read from a checkpoint before the hook exists
        self._consensus = None  # during validation with a mode whose ranks diverge: the context, entered
        self._own_after_fit: dict = {}  # after fit (every rank holds the average): this rank's own, for a checkpoint

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self.sync_spec.mode != "allreduce" and len(self.optimizers) > 1:
            # the mode's before_step/after_step would run once per optimizer's step: averaging twice per batch
            raise ValueError(f"ThinwireStrategy: sync={self.sync_spec.mode} runs one optimizer, and "
                             f"configure_optimizers returned {len(self.optimizers)}; put every parameter group in one "
                             "optimizer (torch.optim takes a list of groups, each with its own lr), or use "
                             "sync='allreduce'")

    def _register_ddp_hooks(self) -> None:
        # not DDPStrategy's: that one registers hooks on CUDA only
        if self.world_size == 1:  # nothing to average: a codec would only change the gradients (as accelerate, HF)
            log.info("thinwire: one process: nothing to average, no hook attached")
            return
        if self.sync_spec.mode == "allreduce":
            self.comm = attach(self.model, self.codec, **self._kwargs, **self._hook_kwargs)
        else:
            self.mode = sync(self.model, self.sync_spec, codec=self.codec, **self._kwargs, **self._hook_kwargs)
            self.comm = self.mode.comm
        if self._restored is not None:
            self._apply(*self._restored)

    # -- the step, for a sync mode ---------------------------------------------------------------
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        if self.mode is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        mode = self.mode

        def forward_backward_then_set_gradients():
            out = closure()          # Lightning's closure: training_step and backward
            mode.before_step()       # e.g. delayed's averaged gradient, local SGD's warm-up average
            return out

        mode.optimizer = optimizer   # before the closure's forward: delayed predicts with it (a resumed run's first step too)
        with mode.no_sync():         # DDP's backward must not all-reduce: the mode averages itself
            out = super().optimizer_step(optimizer, forward_backward_then_set_gradients, model, **kwargs)
        mode.after_step()            # e.g. the periodic parameter average
        return out

    def _clip(self) -> float | None:
        """The gradient norm Lightning clips to (``gradient_clip_val``, by norm, its default), else None."""
        trainer = getattr(self.lightning_module, "trainer", None)
        algorithm = getattr(getattr(trainer, "gradient_clip_algorithm", None), "value", None)
        if trainer is not None and trainer.gradient_clip_val and algorithm in (None, "norm"):
            return float(trainer.gradient_clip_val)
        return None

    def on_train_start(self) -> None:
        super().on_train_start()
        self._own_after_fit = {}  # a fit again goes on from the average every rank holds
        if self.mode is not None:  # before the first forward (a resumed run's, an accumulated micro-batch's, which
            self.mode.optimizer = self.optimizers[0]  # run outside optimizer_step): delayed predicts each step's
            self.mode.clip = self._clip()             # weights with the optimizer, clipping as Lightning does

    def on_train_end(self) -> None:
        """Where the ranks' models differ the trained model is their average: every rank ends holding it, so what
        follows fit (``trainer.validate``, ``test``, ``predict``, before which Lightning sends rank 0's parameters
        to every rank) uses it, not rank 0's own."""
        if self.mode is not None and self.mode.buffers_diverge:
            with self.mode.consensus() as own:
                average = {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}
                self._own_after_fit = dict(own)  # what a checkpoint saved after fit keeps as this rank's own
            self.lightning_module.load_state_dict(average)
        super().on_train_end()

    # -- validation: the ranks' average -----------------------------------------------------------
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.mode is not None and self.mode.buffers_diverge and self._consensus is None:
            self._consensus = self.mode.consensus()
            self._consensus.__enter__()  # the mode holds this rank's own tensors meanwhile (own_inside)

    def on_validation_end(self) -> None:
        if self._consensus is not None:
            consensus, self._consensus = self._consensus, None
            consensus.__exit__(None, None, None)
        super().on_validation_end()

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        # Lightning calls this on every rank (rank 0 writes): gather every rank's state first
        if self.comm is not None:
            mine: dict[str, Any] = {}
            if self.mode is not None:
                mine.update(mode_record(self.mode))  # first: it waits for averages in flight
                if self.mode.buffers_diverge:  # ranks' parameters (or BatchNorm's statistics) differ between averages
                    own = self.mode.own_inside or self._own_after_fit  # in validation's consensus or after fit: its own
                    mine["model"] = {k: own.get(id(v), v).detach().clone()
                                     for k, v in self.lightning_module.state_dict(keep_vars=True).items()}
                    if self._consensus is None:  # outside validation: the checkpoint's model is the ranks' average too
                        with self.mode.consensus():
                            checkpoint["state_dict"] = {k: v.detach().clone()
                                                        for k, v in self.lightning_module.state_dict().items()}
                if self.mode.diverges:  # and their optimizer states
                    mine["optimizers"] = [o.state_dict() for o in self.optimizers]
            mine["comm"] = self.comm.state_dict()
            checkpoint["thinwire"] = gather_states(mine)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        saved = checkpoint.get("thinwire")
        mine = rank_state(saved, "the checkpoint")
        if mine is None:
            return
        if self.comm is not None:
            self._apply(saved, mine)
        else:  # restored before setup (Lightning's default order): applied once the hook is attached
            self._restored = (saved, mine)

    def _apply(self, saved: dict, mine: dict) -> None:
        if "model" in mine:  # after DDP's constructor broadcast rank 0's parameters
            load_own_model(self.mode, self.lightning_module, saved, mine, "the checkpoint's model (the ranks' average)")
        if self.mode is not None:
            load_mode_state(self.mode, mine, "the checkpoint")
        self.comm.load_state_dict(mine["comm"])

    def load_optimizer_state_dict(self, checkpoint) -> None:
        mine = rank_state(checkpoint.get("thinwire"), "the checkpoint", warn=False)  # said at the model's load
        if mine is None or "optimizers" not in mine or not (self.mode is not None and self.mode.diverges):
            return super().load_optimizer_state_dict(checkpoint)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": mine["optimizers"]})

    def teardown(self) -> None:
        if self.mode is not None:
            self.mode.close()
        elif self.comm is not None:
            self.comm.close()
        super().teardown()
