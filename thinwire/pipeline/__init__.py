"""Split training: a model too large (or too slow) for one host cut into stages on different ranks and
run by ``torch.distributed.pipelining``'s schedules (GPipe, 1F1B); several pipeline replicas average
their gradients through any thinwire codec and sync mode.

* :mod:`.stages`: the model's layer list, a contiguous split of it, parameters shared across stages;
* :mod:`.layout`: stages x replicas, each stage's layers and the micro-batch count for a world size;
* :mod:`.runner`: one rank's stage and schedule, the shared parameters' gradient sums, global clipping.

``thinwire train --pipeline 1f1b:stages=4`` runs it (:mod:`thinwire.train.pipelined`).
"""
