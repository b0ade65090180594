"""``gossip:topology=T``: decentralized SGD, each rank averaging parameters with its neighbours only.

D-PSGD (Lian et al., NeurIPS 2017, https://arxiv.org/abs/1705.09056): after every local optimizer
step each rank replaces its parameters by the average of its own and those its neighbours sent,
``x_i <- (x_i + sum_{j in N_in(i)} x_j) / (1 + |N_in(i)|)``. No global collective: a slow or far
host delays only its neighbours, and each step sends ``degree`` copies of the parameters instead of an
all-reduce's ``2 (p-1)/p``. The ranks' models differ between steps (they agree in expectation); the
trainer checkpoints every rank's parameters and optimizer state, as for local SGD.

Topologies (each gives a doubly stochastic mixing matrix, so the average of the ranks' parameters is
what plain SGD on the average would do, and every rank converges to it):

* ``ring``: the two ring neighbours ``r +- 1`` (one when p = 2); weights ``1/3``.
* ``torus``: a 2-D torus of ``rows x cols`` ranks (rows the largest divisor of p up to sqrt(p)), up to
  four neighbours; weights ``1/(degree + 1)`` (uniform degree, so doubly stochastic).
* ``exp2`` (the default): the one-peer exponential graph of Stochastic Gradient Push (Assran et al.,
  ICML 2019, https://arxiv.org/abs/1811.10792): at step t rank r sends to ``r + 2^k`` and receives
  from ``r - 2^k`` (mod p), ``k = t mod ceil(log2 p)``; weights ``1/2``. One peer per step, and
  after ``log2 p`` steps information from every rank has reached every rank. Each rank receives from
  exactly one, so the matrix is doubly stochastic and push-sum weights stay 1 (they are not needed).
* ``random``: a random perfect matching of the ranks per step (the same on every rank, seeded by
  the step); pairs average, an odd rank out keeps its parameters.

Communication happens after the optimizer step and blocks (point-to-point through
``torch.distributed``'s ``batch_isend_irecv``, in the mode's own process group). With ``overlap=1`` a
round is started after step t and waited for after step t+1, its transfer hidden behind that step's
compute, as Stochastic Gradient Push's overlap variant (OSGP, one step stale): step t+1's parameters
get the round's correction ``x_i <- x_i + w sum_j (x_j^t - x_i^t)`` (CHOCO: its move toward the
neighbours' public copies, updated with what arrived). The corrections cancel over the ranks, so the mean
is the same as without overlap; a round in flight at a checkpoint is saved with it and mixed in after
the resumed step, as it would have been.

**Compressed gossip** (any lossy codec but PowerSGD): CHOCO-SGD (Koloskova, Stich and Jaggi, ICML 2019,
https://arxiv.org/abs/1902.00340, Algorithm 1). Each rank keeps a public copy ``h_j`` of its own and
each neighbour's parameters, identical on every rank that holds it. After the optimizer step a rank
sends ``q_i = Q(x_i - h_i)`` (the codec's round trip of the change since its public copy) to its
neighbours, every holder adds the received ``q_j`` to ``h_j``, and the rank moves toward its
neighbours' public copies: ``x_i <- x_i + gamma * w * sum_j (h_j - h_i)`` (``w`` the topology's uniform
weight). What the codec drops stays in ``x_i - h_i`` and is sent later: the public copy is the error
feedback. With an exact codec and ``gamma = 1`` this is D-PSGD's average. ``gamma`` must suit the codec:
1 (auto) for the dense quantizers fp16, bf16, int8 and bfp; a sparsifier or sign needs a smaller,
explicit step (the paper tunes it per codec). Memory: ``1 + degree`` copies of the parameters in fp32.

The paper's graph is fixed (``ring``, ``torus``). On ``exp2``, whose peer changes every step, thinwire
keeps one public copy per edge instead of one per rank: rank i holds ``h_{i->j}`` for each rank j it
sends to and ``h_{k->i}`` for each rank k it hears from (``2 ceil(log2 p)`` copies), sends
``Q(x_i - h_{i->j})`` on the step it talks to j, and moves ``x_i <- x_i + gamma / 2 (h_{k->i} - h_{i->j})``.
Both ends of an edge update its copy alike, and each step's edges form a permutation, so the terms cancel
over the ranks: the ranks' mean moves only by the optimizer, as with a fixed graph. An edge's error
feedback waits ``log2 p`` steps for its next turn. With an exact codec and ``gamma = 1`` it is D-PSGD on
exp2 exactly. ``random`` may pair any two ranks, and is refused with a lossy codec.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch import Tensor

from thinwire.compress.codecs import Meta
from thinwire.compress.codecs.base import checked_decoded, checked_payload
from thinwire.compress.codecs.common import all_finite
from thinwire.compress.sync.base import Buckets, StepParts, SyncMode, cpu_list, on_device
from thinwire.compress.wire import pack, unpack
from thinwire.errors import ConfigError
from thinwire.perf.sync import gossip_step_s

TOPOLOGIES = ("ring", "torus", "exp2", "random")


def torus_shape(p: int) -> tuple[int, int]:
    rows = max(d for d in range(1, math.isqrt(p) + 1) if p % d == 0)
    return rows, p // rows


def neighbours(topology: str, rank: int, world: int, step: int) -> tuple[list[int], list[int]]:
    """(ranks ``rank`` sends to, ranks it receives from) at ``step``; identical answers on every rank."""
    if world == 1:
        return [], []
    if topology == "ring":
        peers = sorted({(rank - 1) % world, (rank + 1) % world} - {rank})
        return peers, peers
    if topology == "torus":
        rows, cols = torus_shape(world)
        r, c = divmod(rank, cols)
        peers = sorted({((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))}
                       - {rank})
        return peers, peers
    if topology == "exp2":
        k = step % max(1, math.ceil(math.log2(world)))
        hop = 2**k
        return [(rank + hop) % world], [(rank - hop) % world]
    if topology == "random":
        perm = torch.randperm(world, generator=torch.Generator().manual_seed(1_000_003 * step + 17)).tolist()
        where = perm.index(rank)
        partner = perm[where ^ 1] if (where ^ 1) < world else None
        return ([partner], [partner]) if partner is not None else ([], [])
    raise ValueError(f"unknown topology {topology!r}; one of {', '.join(TOPOLOGIES)}")


def check_topology(topology: str, world: int) -> None:
    """Refuse a topology this world size cannot form (a torus needs two rows and two columns)."""
    if topology == "torus" and torus_shape(world)[0] < 2:
        hosts = f"{world} host{'s' if world != 1 else ''}"
        raise ConfigError("sync.topology", topology, f"ring, exp2 or random with {hosts}",
                          f"A torus needs a world size with two factors >= 2 (4, 6, 8, 9, ...); {hosts} "
                          f"would form a ring{'' if world > 1 else ' of one'}.")


def check_compressible(topology: str) -> None:
    """Compressed gossip keeps a public copy per peer, which a random pairing (any two ranks) would not bound."""
    if topology not in ("ring", "torus", "exp2"):
        raise ConfigError("sync.topology", topology, "ring, torus or exp2 with a lossy codec",
                          "Compressed gossip (CHOCO-SGD) keeps a public copy of each peer's parameters; a random "
                          "pairing may pair any two ranks (p - 1 copies each); or use --compression none.")


def degree(topology: str, world: int) -> int:
    """Parameter copies a rank sends per step (the most over ranks and steps)."""
    return max(len(neighbours(topology, r, world, s)[0]) for r in range(world) for s in range(max(1, world)))


class Gossip(SyncMode):
    name = "gossip"
    state_keys = ("steps", "public", "round", "topology", "world")
    diverges = True

    def __init__(self, model, comm, spec, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec)
        self.topology = spec.topology
        check_topology(self.topology, comm.wire.world)
        self.buckets = Buckets.trainable(model, int(bucket_mb * 2**20))
        self.steps = 0
        self.codecs = [comm.policy.codec_for(b, sum(n for _, n in self.buckets.layout(b)), 0)
                       for b in range(len(self.buckets.groups))]
        self.choco = any(not c.lossless for c in self.codecs)
        self.gamma = spec.gamma or 1.0
        # CHOCO: public copies (flat buckets) by key, see public_keys: a rank's own and its neighbours' on a
        # fixed graph, one per edge on exp2
        self.public: dict[str, list[Tensor]] = {}
        self.per_edge = self.topology == "exp2"
        self.overlap = bool(getattr(spec, "overlap", 0))
        self.pending: Round | None = None  # the round in flight (overlap: until the next step's after_step)
        if self.choco:
            check_compressible(self.topology)
            self.start_public()

    def public_keys(self, send_to: list[int], recv_from: list[int]) -> tuple[str, list[str]]:
        """(the key of the copy this rank sends against, the keys of the copies it hears into): its own rank
        and its neighbours' on a fixed graph; ``to:j`` and ``from:k`` per edge on exp2 (one peer each way)."""
        if self.per_edge:
            return f"to:{send_to[0]}", [f"from:{r}" for r in recv_from]
        return str(self.comm.wire.rank), [str(r) for r in recv_from]

    def start_public(self) -> None:
        """CHOCO's public copies, zero as in the paper (consistent on every rank whatever the weights):
        the first rounds send the parameters themselves, quantized."""
        wire = self.comm.wire
        rounds = max(1, math.ceil(math.log2(wire.world))) if self.per_edge else 1
        keys = set()
        for step in range(rounds):
            send_to, recv_from = neighbours(self.topology, wire.rank, wire.world, step)
            if send_to or recv_from:   # one rank alone has no peer
                own, heard = self.public_keys(send_to, recv_from)
                keys |= {own, *heard}
        zeros = self.buckets.flatten([None] * len(self.buckets.params))
        self.public = {k: [t.clone() for t in zeros] for k in sorted(keys)}

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        return gossip_step_s(compute_s=parts.compute_s, allreduce_comm_s=parts.comm_s, hosts=parts.hosts,
                             degree=degree(spec.topology, max(2, parts.hosts)), overlap=bool(spec.overlap))

    @classmethod
    def bytes_per_step(cls, spec, bytes_per_average: int, hosts: int = 2) -> float:
        """``degree`` copies of the parameters, from one all-reduce's bytes (``2 (p-1)/p`` of them)."""
        p = max(2, hosts)
        return bytes_per_average * p / (2 * (p - 1)) * degree(spec.topology, p)

    def no_sync(self):
        return self.model.no_sync()

    def after_step(self) -> None:
        """One gossip round after the optimizer step. Blocking: send and mix now. ``overlap``: first mix
        in what the previous step's round brought (it travelled during this step's compute), then start
        this step's round."""
        wire = self.comm.wire
        send_to, recv_from = neighbours(self.topology, wire.rank, wire.world, self.steps)
        self.steps += 1
        if self.overlap:
            self._land()
        if send_to or recv_from:
            self.pending = self._send(send_to, recv_from)
        if not self.overlap:
            self._land()

    def _send(self, send_to: list[int], recv_from: list[int]) -> Round:
        """Start one round: the parameters (D-PSGD), or ``Q(x - h_own)`` (CHOCO, its own copy moved now)."""
        me = self.comm.wire.rank
        own, heard = self.public_keys(send_to, recv_from) if self.choco else ("", [])
        parts = []
        for b, (flat, codec) in enumerate(zip(self.buckets.flatten(list(self.buckets.params)), self.codecs)):
            self.comm.bytes_raw += flat.numel() * flat.element_size()
            self.comm.counts[codec.name if self.choco else "fp32"] += 1  # as the hook counts its buckets
            if not self.choco:
                parts.append([flat, self.comm.wire.start_exchange(flat, send_to, recv_from)])
                continue
            meta = Meta(numel=flat.numel(), seed=self.steps * 1009 + b, rank=me)
            t0 = time.perf_counter()
            change = flat - self.public[own][b]
            payload = checked_payload(codec, codec.compress(change, meta), meta.numel)
            self.comm.compress_s += time.perf_counter() - t0
            wait = self.comm.wire.start_exchange(pack(payload), send_to, recv_from)
            t0 = time.perf_counter()
            decoded = checked_decoded(codec, codec.decompress(payload, meta), meta.numel)
            if not all_finite(decoded) and all_finite(change):
                raise FloatingPointError(f"gossip: codec {codec.name} decoded bucket {b} at step {self.steps} to "
                                         "non-finite values though this rank's parameters were finite: its compress or "
                                         "decompress is wrong")
            self.public[own][b] += decoded
            self.comm.compress_s += time.perf_counter() - t0
            parts.append([(payload, meta), wait])
        return Round(recv_from, own, heard, parts)

    def flush(self) -> None:
        """Wait for a round in flight and decode what it brought, without mixing it in (that waits for
        the step it belongs to, so a checkpoint or a validation does not change the training)."""
        if self.pending is not None:
            self._realize(self.pending)

    def _realize(self, r: Round) -> None:
        for b, part in enumerate(r.parts):
            if not callable(part[1]):
                continue
            got = part[1]()
            if self.choco:
                (payload, meta), codec = part[0], self.codecs[b]
                t0 = time.perf_counter()
                got = [codec.decompress(unpack(buf, payload), Meta(numel=meta.numel, seed=meta.seed, rank=src))
                       for src, buf in zip(r.recv_from, got)]
                self.comm.compress_s += time.perf_counter() - t0
                part[0] = None
            part[1] = got

    def _land(self) -> None:
        """Mix the round in flight into the parameters: D-PSGD's average with the neighbours' (with
        ``overlap``, the average's correction ``w (x_j - x_i)`` of the sent parameters added to the ones
        the step since has moved); CHOCO's move toward the neighbours' public copies."""
        r, self.pending = self.pending, None
        if r is None:
            return
        self._realize(r)
        w, n = 1.0 / (1 + len(r.recv_from)), len(r.recv_from)
        mixed = []
        for b, (flat, (sent, got)) in enumerate(zip(self.buckets.flatten(list(self.buckets.params)), r.parts)):
            if self.choco:
                for key, delta in zip(r.heard, got):
                    self.public[key][b] += delta
                pull = sum(self.public[k][b] for k in r.heard) - n * self.public[r.own][b]
                mixed.append(flat + self.gamma * w * pull)
            elif self.overlap:
                mixed.append(flat + w * (sum(got) - n * sent))
            else:
                mixed.append(torch.stack([sent, *got]).mean(0))
        with torch.no_grad():
            for p, x in zip(self.buckets.params, self.buckets.unflatten(mixed)):
                p.copy_(x)

    def state_dict(self) -> dict:
        self.flush()
        r = self.pending
        return {**self.saved_by(), "steps": self.steps, "topology": self.topology,
                "world": self.comm.wire.world,
                **({"public": {k: cpu_list(t) for k, t in self.public.items()}} if self.choco else {}),
                **({"round": {"recv_from": r.recv_from, "own": r.own, "heard": r.heard,
                              "sent": [cpu_list([s]) if s is not None else None for s, _ in r.parts],
                              "got": [cpu_list(g) for _, g in r.parts]}} if r is not None else {})}

    def load_state_dict(self, sd: dict) -> None:
        self.check_state(sd)
        saved = (sd.get("topology", self.topology), sd.get("world", self.comm.wire.world))  # older states: as now
        if saved != (self.topology, self.comm.wire.world):
            raise ValueError(f"gossip: the state was saved with topology={saved[0]} on {saved[1]} ranks, and this mode "
                             f"runs topology={self.topology} on {self.comm.wire.world}: each rank's state is for its "
                             "neighbours there; resume with the same topology and ranks, or start the mode fresh "
                             "from the ranks' averaged model (mode.consensus())")
        self.steps = int(sd.get("steps", 0))
        like = self.buckets.flatten(list(self.buckets.params))
        if self.choco and "public" in sd:
            self.start_public()  # the copies this rank keeps on this group: a state of another world size keeps others
            if set(map(str, sd["public"])) != set(self.public):
                raise ValueError(f"gossip: the state holds public copies {sorted(map(str, sd['public']))[:6]}, where rank "
                                 f"{self.comm.wire.rank} of {self.comm.wire.world} keeps {sorted(self.public)[:6]}: a state "
                                 "saved on another number of ranks or topology (each rank's is its own, for its neighbours); start "
                                 "the mode fresh, from the ranks' averaged model (mode.consensus())")
            self.public = {str(k): on_device(t, like) for k, t in sd["public"].items()}
        self.pending = None
        if sd.get("round") is not None:
            r = sd["round"]
            parts = [[on_device(s, [f])[0] if s is not None else None, on_device(g, [f] * len(g))]
                     for s, g, f in zip(r["sent"], r["got"], like)]
            self.pending = Round(list(r["recv_from"]), str(r["own"]), list(r["heard"]), parts)
        self._own_buffers_on_resume()


@dataclasses.dataclass
class Round:
    """A gossip round started: whom it hears from, CHOCO's copy keys, and per bucket ``[sent, received]``:
    D-PSGD's sent parameters (CHOCO: its payload and meta until decoded, then None) and a call that waits
    for the received tensors (after :meth:`Gossip.flush`, the tensors themselves, decoded for CHOCO)."""

    recv_from: list[int]
    own: str
    heard: list[str]
    parts: list[list]
