"""thinwire in PyTorch Lightning: a DDP strategy whose gradients travel through a thinwire codec.

    from thinwire.integrations.lightning import ThinwireStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ThinwireStrategy("int8"))
    trainer.fit(model)            # gradients averaged int8 on the wire, with error feedback
    trainer.strategy.comm.stats() # bytes sent, per-codec counts

Why a strategy and not ``DDPStrategy(ddp_comm_hook=...)``: Lightning registers a communication hook
only on CUDA (its ``_register_ddp_hooks``), so on CPU (gloo) the hook would be silently ignored; and
thinwire's hook needs its process group and the wrapped model, which exist only after setup. Every
rank's residuals are saved into Lightning's checkpoint (key ``"thinwire"``) and restored with
``trainer.fit(model, ckpt_path=...)``. Install with ``pip install 'thinwire[lightning]'``.
"""

from __future__ import annotations

from typing import Any

from thinwire.api import attach
from thinwire.commspec import parse_comm_spec
from thinwire.integrations import gather_states, load_rank_state, need

pl = need("pytorch_lightning", "lightning")
from pytorch_lightning.strategies import DDPStrategy  # noqa: E402


class ThinwireStrategy(DDPStrategy):
    """``DDPStrategy`` with thinwire's hook attached: ``codec`` is any ``--compression`` form
    (``"int8"``, ``"topk:ratio=0.01"``, ``"auto"``; see ``thinwire codecs``); ``error_feedback``,
    ``warmup_steps``, ``min_compress_bytes`` and ``timeout_s`` as in :func:`thinwire.attach`; every
    other keyword goes to ``DDPStrategy`` (``find_unused_parameters``, ``static_graph``, ...)."""

    strategy_name = "thinwire"

    def __init__(self, codec: str = "int8", *, error_feedback: bool = True, warmup_steps: int = 0,
                 min_compress_bytes: int = 4096, timeout_s: float | None = None, **ddp_kwargs: Any) -> None:
        for key in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if key in ddp_kwargs:
                raise ValueError(f"ThinwireStrategy: {key}= is Lightning's own hook setting; thinwire's hook "
                                 "replaces it (pass codec= instead, or use DDPStrategy for PyTorch's hooks)")
        super().__init__(**ddp_kwargs)
        self.codec = parse_comm_spec(codec) if isinstance(codec, str) else codec  # bad specs fail here, before launch
        self._attach_kwargs = dict(error_feedback=error_feedback, warmup_steps=warmup_steps,
                                   min_compress_bytes=min_compress_bytes, timeout_s=timeout_s)
        self.comm = None        # the CommState, once the model is wrapped
        self._restored = None   # hook state read from a checkpoint before the hook exists

    def _register_ddp_hooks(self) -> None:
        # not DDPStrategy's: that one registers hooks on CUDA only
        self.comm = attach(self.model, self.codec, **self._attach_kwargs)
        if self._restored is not None:
            load_rank_state(self.comm, self._restored, "the checkpoint")
            self._restored = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        # Lightning calls this on every rank (rank 0 writes): gather every rank's residuals first
        if self.comm is not None:
            checkpoint["thinwire"] = gather_states(self.comm)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        saved = checkpoint.get("thinwire")
        if saved is None:
            return
        if self.comm is not None:
            load_rank_state(self.comm, saved, "the checkpoint")
        else:  # restored before setup (Lightning's default order): applied once the hook is attached
            self._restored = saved

    def teardown(self) -> None:
        if self.comm is not None:
            self.comm.close()
        super().teardown()
