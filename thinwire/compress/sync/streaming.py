"""``diloco:period=H,fragments=F,delay=T,alpha=A``: Streaming DiLoCo, fragments synced on a staggered
schedule with their averages in flight during inner steps; ``local:period=H,fragments=F`` streams local SGD's
average the same way (:class:`StreamingLocal`: the outer step of lr 1 without momentum).

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch"
(2025, https://arxiv.org/abs/2501.18512), with the schedule and keys of torchft's ``DiLoCo``
(``sync_every``, ``fragment_sync_delay``, ``fragment_update_alpha``):

1. the parameters are split into F fragments (contiguous in model order, of about equal size), each
   with its own anchor and outer Nesterov momentum (as :mod:`.diloco`);
2. every H/F inner steps the next fragment, round robin, is synced, so each fragment is synced once
   per H steps and the wire carries 1/F of the model at a time (the peak bandwidth falls F-fold);
3. T inner steps before its sync point the fragment's pseudo-gradient (anchor - params) starts
   averaging through the codec with error feedback; the inner steps go on meanwhile;
4. at the sync point the average is awaited, the outer step moves the fragment's anchor, and its
   parameters become ``lerp(anchor, local, A) = anchor + A (local - anchor)``: A = 0 keeps the global
   parameters (and drops the T steps' local progress), 1 the local ones.

``merge=keep`` replaces step 4's mix: the parameters become the new anchor plus this rank's own progress
since its pseudo-gradient left (``local - sent``), the rule of CoCoD-SGD (Shen et al., IJCAI 2019,
https://arxiv.org/abs/1906.12043; overlapped local SGD): nothing of the T steps is dropped, and the ranks'
mean is where the blocking outer step would have put the mean of their sent points, moved on by their mean
progress. Ranks then differ by their last T steps only; ``delay`` defaults to 1 here too (fewer steps
of own progress kept, the closer to the blocking average: charlm, 4 workers, H=4, 4-bit int8, 640 steps
ended 0.3% above blocking local SGD with T=1 and 1.4% with T=3; ``lerp`` with T=3 and A=0.5, 6.5%).
Memory: this rank's sent pseudo-gradient of the fragment in flight (checkpointed with it).

With F = 1 and T = 0 this is :class:`~thinwire.compress.sync.diloco.DiLoCo` exactly. Memory: per
fragment an anchor and a momentum (together two fp32 copies of the parameters, as DiLoCo) and the
average in flight (checkpointed once it lands; a checkpoint waits for it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from thinwire.compress.sync.base import Buckets, StepParts, cpu_list, on_device
from thinwire.compress.sync.diloco import nesterov_step
from thinwire.compress.sync.local import LocalSGD
from thinwire.errors import ConfigError
from thinwire.perf.sync import streaming_step_s


def split_even(numels: list[int], parts: int) -> list[list[int]]:
    """Indices 0..n-1 in order, cut into ``parts`` non-empty runs of about equal total size.

    >>> split_even([4, 4, 4, 4], 2), split_even([10, 1, 1, 1], 2)
    ([[0, 1], [2, 3]], [[0], [1, 2, 3]])
    """
    total, out, acc = sum(numels), [[]], 0
    for i, n in enumerate(numels):
        left = len(numels) - i  # items not yet placed, this one included
        if out[-1] and len(out) < parts and (acc >= total * len(out) / parts or left == parts - len(out)):
            out.append([])
        out[-1].append(i)
        acc += n
    return out


def check_fragments(spec, tensors: int) -> None:
    """Refuse more fragments than the model's trainable parameter tensors (``tensors``): a fragment holds whole ones."""
    if spec.fragments > tensors:
        raise ConfigError("sync.fragments", spec.fragments, f"at most {tensors}, the model's trainable "
                          "parameter tensors", "A fragment holds whole parameter tensors.")


class StreamingDiLoCo(LocalSGD):
    name = "diloco"
    state_keys = ("steps", "syncs", "anchors", "momenta", "inflight", "sent")

    def __init__(self, model, comm, spec, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec, bucket_mb=bucket_mb)
        params = self.buckets.params
        check_fragments(spec, len(params))
        self.lr, self.mu, self.delay, self.alpha = spec.outer_lr, spec.outer_momentum, spec.delay, spec.alpha
        self.keep = spec.merge == "keep"
        self.every = spec.sync_every
        cap = int(bucket_mb * 2**20)
        self.fragments = [Buckets([params[i] for i in g], cap, [self.buckets.indices[i] for i in g])
                          for g in split_even([p.numel() for p in params], spec.fragments)]
        self.first = [sum(len(f.groups) for f in self.fragments[:k]) for k in range(len(self.fragments))]
        self.anchors: list[list[Tensor]] | None = None
        self.momenta: list[list[Tensor] | None] = [None] * len(self.fragments)
        self.syncs = 0                                    # fragment syncs done; the next is syncs % F
        self.inflight: list | None = None                 # the next fragment's averages (futures or tensors)
        self.sent: list[Tensor] | None = None             # keep: this rank's pseudo-gradient in flight

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        return streaming_step_s(compute_s=parts.compute_s, comm_s=parts.comm_s, codec_s=parts.codec_s,
                                period=spec.period, fragments=spec.fragments, delay=spec.delay,
                                codec_steals_compute=parts.codec_steals_compute)

    def before_step(self) -> None:
        if self.steps < self.warmup:
            self.warmup_average()
        elif self.anchors is None:
            self.anchors = [f.flatten(list(f.params)) for f in self.fragments]

    def after_step(self) -> None:
        self.steps += 1
        local = self.steps - self.warmup
        if local <= 0:
            return
        if (local + self.delay) % self.every == 0:
            self.prepare()
        if local % self.every == 0:
            self.perform()

    def steps_to_agreement(self) -> int | None:
        """0 through the warm-up; after it, never known: fragments are mixed into local parameters one at a time."""
        return 0 if self.steps <= self.warmup else None

    def prepare(self) -> None:
        """Start averaging the next fragment's pseudo-gradient; the inner steps go on."""
        k = self.syncs % len(self.fragments)
        frag = self.fragments[k]
        deltas = [a - x for a, x in zip(self.anchors[k], frag.flatten(list(frag.params)))]
        self.sent = [d.clone() for d in deltas] if self.keep else None  # the codec may work on its input in place
        self.inflight = frag.average(self.comm, deltas, first=self.first[k])

    def perform(self) -> None:
        """Wait for the fragment's average, step its anchor, mix global and local parameters."""
        k = self.syncs % len(self.fragments)
        frag, anchor = self.fragments[k], self.anchors[k]
        averaged = self._collect()
        self.inflight = None
        before = [a.clone() for a in anchor] if self.keep else None
        self.momenta[k] = nesterov_step(anchor, averaged, self.momenta[k], lr=self.lr, mu=self.mu)
        local = frag.flatten(list(frag.params))
        with torch.no_grad():
            if self.keep:  # new anchor + (local - sent), where sent = old anchor - own pseudo-gradient
                mixed = [x.add_(a - b).add_(d) for x, a, b, d in zip(local, anchor, before, self.sent)]
                self.sent = None
            else:
                mixed = [a.lerp(x, self.alpha) for a, x in zip(anchor, local)]
            for p, value in zip(frag.params, frag.unflatten(mixed)):
                p.copy_(value)
        self.syncs += 1

    def _collect(self) -> list[Tensor]:
        return [f if isinstance(f, Tensor) else f.wait() for f in self.inflight]

    def flush(self) -> None:
        if self.inflight is not None:
            self.inflight = self._collect()

    def state_dict(self) -> dict:
        self.flush()
        return {**self.saved_by(), "steps": self.steps, "syncs": self.syncs,
                "anchors": [cpu_list(a) for a in self.anchors or []],
                "momenta": [cpu_list(m) for m in self.momenta], "inflight": cpu_list(self.inflight),
                "sent": cpu_list(self.sent)}

    def load_state_dict(self, sd: dict) -> None:
        self.check_state(sd)
        self.steps, self.syncs = int(sd.get("steps", 0)), int(sd.get("syncs", 0))
        flats = [f.flatten(list(f.params)) for f in self.fragments]
        if sd.get("anchors") and len(sd["anchors"]) != len(flats):
            raise ValueError(f"{self.name}: the state holds {len(sd['anchors'])} fragments, this mode {len(flats)}: the "
                             "state of another fragments= (or model); load the state this mode saved, or start it fresh")
        self.anchors = [on_device(a, like) for a, like in zip(sd["anchors"], flats)] if sd.get("anchors") else None
        self.momenta = [on_device(m, like) for m, like in zip(sd.get("momenta") or [None] * len(flats), flats)]
        inflight = sd.get("inflight")
        if inflight is not None:
            k = self.syncs % len(self.fragments)
            inflight = on_device(inflight, flats[k])
        self.inflight = inflight
        sent = sd.get("sent")
        if self.keep and inflight is not None and sent is None:
            raise ValueError(f"{self.name}: the state has an average in flight but not this rank's sent part, which "
                             "merge=keep needs: it was saved with merge=lerp; resume with the merge that saved it")
        self.sent = on_device(sent, flats[self.syncs % len(self.fragments)]) if self.keep and sent is not None else None
        self._own_buffers_on_resume()


class StreamingLocal(StreamingDiLoCo):
    """Local SGD's average streamed (``local:period=H,fragments=F``): a fragment's average travels during
    ``delay`` inner steps, then its parameters become ``lerp(average, local, alpha)``; the outer step is the
    average itself (lr 1, no momentum, so no copy of the parameters for a momentum)."""

    name = "local"
