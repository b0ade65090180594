"""The peers thinwire is measured against, run inside the same training loop.

``--compression torch:SPEC`` trains with PyTorch's own DDP communication instead of thinwire's hook:

* ``torch:none``: plain DDP, no hook (its built-in fp32 all-reduce);
* ``torch:fp16``: ``default_hooks.fp16_compress_hook``;
* ``torch:bf16``: ``default_hooks.bf16_compress_hook``. ``register_comm_hook`` refuses this function by
  name unless CUDA and NCCL are present; the hook itself runs on gloo, and registered through the
  counting wrapper below it does;
* ``torch:powersgd:rank=R``: ``powerSGD_hook`` with error feedback and warm start, starting at the
  second step (the earliest PyTorch allows). On gloo it aborts with a collective size mismatch when
  DDP has more than one bucket, so the trainer gives this peer a single bucket.
* ``torch:localsgd:period=H,warmup=W``: PyTorch's post-local SGD, as its documentation pairs them:
  ``post_localSGD_hook`` with ``PostLocalSGDState(start_localSGD_iter=W)`` (gradients all-reduced for
  the first W steps, then not across hosts) and ``PeriodicModelAverager(period=H, warmup_steps=W)``
  averaging the parameters in fp32 after every H-th optimizer step (:class:`PeerLocalSGD`). The
  hook's intra-node all-reduce after the warm-up is off (``post_local_gradient_allreduce=False``):
  thinwire runs one worker per host, where that group holds one rank and would move nothing.

Bytes on the wire cannot be counted inside PyTorch's hooks, so they are computed per bucket from
the same ring formula thinwire counts with (:mod:`thinwire.compress.wire`) and, for
PowerSGD, from PyTorch's own rule of which tensors it compresses.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plsgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.model_averaging import averagers
from torch.nn.parallel import DistributedDataParallel

from thinwire.commspec import TorchSpec
from thinwire.compress.sync import SyncMode
from thinwire.compress.wire import ring_allreduce_bytes

class _Counter:
    def __init__(self, world: int) -> None:
        self.world, self.bytes_sent, self.calls = world, 0, 0


class _Policy:
    def __init__(self, spec: str) -> None:
        self.spec = spec

    def describe(self) -> str:
        return self.spec


class PeerComm:
    """PyTorch's hook (or none) behind the interface the trainer uses for thinwire's ``CommState``."""

    def __init__(self, model: DistributedDataParallel, spec: TorchSpec) -> None:
        self.name, self.rank = spec.hook, spec.rank
        self.policy = _Policy(spec.text)
        self.wire = _Counter(dist.get_world_size())
        self.psgd_state = None
        self.step = 0
        if self.name == "fp16":
            model.register_comm_hook(None, self._counting(default_hooks.fp16_compress_hook, 2))
        elif self.name == "bf16":
            model.register_comm_hook(None, self._counting(default_hooks.bf16_compress_hook, 2))
        elif self.name == "powersgd":
            self.psgd_state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=self.rank,
                                                 start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            model.register_comm_hook(self.psgd_state, self._counting_psgd())
        elif self.name == "localsgd":
            self.local_state = plsgd.PostLocalSGDState(process_group=None, subgroup=None,
                                                       start_localSGD_iter=spec.warmup,
                                                       post_local_gradient_allreduce=False)
            model.register_comm_hook(self.local_state, self._counting_localsgd())
        self._params = [p for p in model.module.parameters() if p.requires_grad]
        self._param_index = {id(p): i for i, p in enumerate(model.module.parameters())}
        self._psgd_layouts: dict[int, tuple] = {}  # bucket index -> (parameter index, shape) its memory was made with
        self._psgd_parts = None
        self._psgd_seen: dict[int, int] = {}  # bucket index -> the PowerSGD iteration its memory was last used at

    def _counting(self, hook, bytes_per_value: int):
        def counted(state, bucket):
            self.wire.bytes_sent += ring_allreduce_bytes(bucket.buffer().numel() * bytes_per_value, self.wire.world)
            self.wire.calls += 1
            return hook(state, bucket)

        return counted

    def _counting_psgd(self):
        def counted(state, bucket):
            self._psgd_regroup(state, bucket)

            self.wire.bytes_sent += self._psgd_bytes(state, bucket)
            self.wire.calls += 1
            return psgd.powerSGD_hook(state, bucket)

        return counted

    def _counting_localsgd(self):
        def counted(state, bucket):
            if state.iter < state.start_localSGD_iter:  # the warm-up's fp32 all-reduce
                self.wire.bytes_sent += ring_allreduce_bytes(bucket.buffer().numel() * 4, self.wire.world)
                self.wire.calls += 1
            return plsgd.post_localSGD_hook(state, bucket)

        return counted

    def _psgd_regroup(self, state, bucket) -> None:
        """PowerSGD's memory (error feedback, warm-start Q) is kept per bucket, in the bucket's order of parameters.
        DDP builds its buckets again after its first iteration (in the order gradients became ready), and a resumed
        process starts from its first layout: a bucket whose parameters are not the ones its memory was made with
        gets each parameter's part of the memory, from wherever it was (as thinwire's own hook regroups its
        residuals), so a resume goes on as the run that was never stopped."""
        index, step = bucket.index(), state.iter
        layout = tuple((self._param_index.get(id(p), -1), tuple(p.shape)) for p in bucket.parameters())
        if self._psgd_layouts.get(index) == layout or index not in state.error_dict:
            self._psgd_layouts[index], self._psgd_seen[index] = layout, step
            return
        if self._psgd_parts is None or self._psgd_parts[0] != step:  # every bucket's memory by parameter, once a step
            self._psgd_parts = (step, self._psgd_by_param(state))
        parts = self._psgd_parts[1]
        if not all(pi in parts for pi, _ in layout):  # memory of another model: start afresh, as PyTorch's first step
            for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                memory.pop(index, None)
        else:
            state.error_dict[index] = torch.cat([parts[pi][0] for pi, _ in layout])
            qs = [parts[pi][1] for pi, _ in layout if parts[pi][1] is not None]
            state.q_memory_dict[index] = torch.cat(qs) if qs else state.error_dict[index].new_empty(0)
            state.p_memory_dict[index] = state.error_dict[index].new_empty(
                sum(self._psgd_rank(shape, state)[1] for _, shape in layout))
        mine = {pi for pi, _ in layout}
        for other, theirs in list(self._psgd_layouts.items()):  # their memory of these parameters is old now
            if other != index and theirs is not None and mine & {pi for pi, _ in theirs}:
                self._psgd_layouts[other] = None
        self._psgd_layouts[index], self._psgd_seen[index] = layout, step

    def _psgd_by_param(self, state) -> dict[int, tuple]:
        """Parameter index -> (its error feedback, its warm-start Q or None) from every bucket's memory."""
        out = {}  # the memory last used wins: a bucket of another layout's is left over, not updated
        for index, layout in sorted(self._psgd_layouts.items(), key=lambda kv: self._psgd_seen.get(kv[0], -1)):
            if index not in state.error_dict or layout is None:
                continue
            e_at = q_at = 0
            for pi, shape in layout:
                n = math.prod(shape)
                q_size = self._psgd_rank(shape, state)[2]
                q = state.q_memory_dict[index][q_at: q_at + q_size].clone() if q_size else None
                out[pi] = (state.error_dict[index][e_at: e_at + n].clone(), q)
                e_at, q_at = e_at + n, q_at + q_size
        return out

    @staticmethod
    def _psgd_rank(shape: tuple, state) -> tuple[bool, int, int]:
        """As PowerSGD's hook decides for a gradient of ``shape``: compressed, its P's and its Q's sizes."""
        n = shape[0] if shape else 1
        m = math.prod(shape) // n if shape else 1
        r = min(n, m, state.matrix_approximation_rank)
        if not psgd._should_compress(n, m, r, state.min_compression_rate)[0]:
            return False, 0, 0
        return True, n * r, m * r

    def _psgd_bytes(self, state, bucket) -> int:
        if state.iter < state.start_powerSGD_iter:
            return ring_allreduce_bytes(bucket.buffer().numel() * 4, self.wire.world)
        floats = 0
        for t in bucket.gradients():
            m = t.view(t.shape[0], -1) if t.ndim > 1 else None
            if m is None:
                floats += t.numel()
                continue
            n_rows, n_cols = m.shape
            r = min(n_rows, n_cols, state.matrix_approximation_rank)
            compress, _, _ = psgd._should_compress(n_rows, n_cols, r, state.min_compression_rate)
            floats += (n_rows + n_cols) * r if compress else t.numel()
        return ring_allreduce_bytes(floats * 4, self.wire.world)

    def count_step_without_hook(self) -> None:
        """Plain DDP: its built-in all-reduce sends every gradient in fp32 each step."""
        if self.name == "none":
            numel = sum(p.numel() for p in self._params)
            self.wire.bytes_sent += ring_allreduce_bytes(numel * 4, self.wire.world)

    def stats(self) -> dict:
        return {"bytes_sent": self.wire.bytes_sent, "policy": self.policy.spec, "counted": "by formula"}

    def state_dict(self) -> dict:
        if self.name == "localsgd":
            return {"localsgd_iter": self.local_state.iter}
        if self.name == "powersgd":  # its iteration (the fp32 start), error feedback, warm-start P and Q, generator
            st = self.psgd_state
            _, keys, pos, has_gauss, cached = st.rng.get_state()
            return {"psgd_iter": st.iter, "psgd_error": dict(st.error_dict), "psgd_p": dict(st.p_memory_dict),
                    "psgd_q": dict(st.q_memory_dict),
                    # a bucket whose memory another layout took over has none (its memory is regrouped on load)
                    "psgd_layouts": {i: [[pi, list(shape)] for pi, shape in layout]
                                     for i, layout in self._psgd_layouts.items() if layout is not None},
                    "psgd_rng": [torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]}
        return {}

    def load_state_dict(self, sd: dict) -> None:
        if self.name == "localsgd":
            self.local_state.iter = int(sd.get("localsgd_iter", 0))
        if self.name == "powersgd" and "psgd_iter" in sd:  # a checkpoint before it was saved starts afresh
            st = self.psgd_state
            st.iter = int(sd["psgd_iter"])
            st.error_dict, st.p_memory_dict, st.q_memory_dict = (dict(sd["psgd_error"]), dict(sd["psgd_p"]),
                                                                 dict(sd["psgd_q"]))
            self._psgd_layouts = {int(i): tuple((int(pi), tuple(int(d) for d in shape)) for pi, shape in layout)
                                  for i, layout in sd.get("psgd_layouts", {}).items()}
            keys, pos, has_gauss, cached = sd["psgd_rng"]
            st.rng.set_state(("MT19937", keys.numpy().astype("uint32"), int(pos), int(has_gauss), float(cached)))

    def close(self) -> None:
        pass


class PeerLocalSGD(SyncMode):
    """PyTorch's ``PeriodicModelAverager`` after every optimizer step, behind the trainer's sync-mode
    interface; the ranks' parameters differ between averages, so each rank's are checkpointed."""

    name = "torch:localsgd"
    diverges = True
    state_keys = ("averager_step",)

    def __init__(self, model: DistributedDataParallel, comm: PeerComm, spec: TorchSpec) -> None:
        super().__init__(model, comm, spec)
        self.averager = averagers.PeriodicModelAverager(period=spec.period, warmup_steps=spec.warmup)
        self._params = comm._params

    def after_step(self) -> None:
        a = self.averager
        if a.step >= a.warmup_steps and (a.step - a.warmup_steps) % a.period == 0:  # its own rule
            numel = sum(p.numel() for p in self._params)
            self.comm.wire.bytes_sent += ring_allreduce_bytes(numel * 4, self.comm.wire.world)
            self.comm.wire.calls += 1
        a.average_parameters(self._params)

    def steps_to_agreement(self) -> int | None:
        """The averager averages at its call W, W+H, W+2H, ... (the hook's fp32 all-reduce keeps the ranks
        equal before): after k calls the ranks agree where ``k - 1 - W`` is at most 0 or a multiple of H."""
        a = self.averager
        local = a.step - 1 - a.warmup_steps
        return 0 if local <= 0 else -local % a.period

    def state_dict(self) -> dict:
        return {"averager_step": self.averager.step}

    def load_state_dict(self, sd: dict) -> None:
        self.check_state(sd)
        self.averager.step = int(sd.get("averager_step", 0))
