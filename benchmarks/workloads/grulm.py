"""A benchmark workload of a fourth kind: a recurrent (GRU) byte-level language model.

    thinwire train --workload benchmarks.workloads.grulm:build --nproc 2   # from the repo root

It exists to check the convergence guard on a model that was not used to choose its rule
(``benchmarks/guard_eval.py``): charlm is a transformer, digits a classifier, denoise a convolutional
regression; this one is recurrent (its gradient flows back through ``context`` steps of one weight
matrix, the case where compressed gradients are said to hurt most).

Data (real, always present): the corpus charlm trains on (:func:`thinwire.workloads.corpus.load_corpus`,
the same split), windows of ``context + 1`` bytes, input the first ``context``, target the next byte at
each position; validation on 512 windows spread evenly over the held-out bytes. Model: a byte embedding
of ``width``, ``layers`` GRU layers of ``width`` units, a linear head over 256 bytes. Hyper-parameters are
char-rnn's usual ones (Adam-family optimizer at 2e-3), not tuned here. Options are keyword arguments
(``--set model.width=256``).
"""

from __future__ import annotations

from torch import nn

from thinwire import Workload
from thinwire.config import check
from thinwire.workloads.charlm import CharLMConfig, EvenlySpaced, Windows, lm_loss
from thinwire.workloads.corpus import load_corpus


class GRULM(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.rnn = nn.GRU(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, 256)

    def forward(self, x):
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


def build(width: int = 128, layers: int = 1, context: int = 64) -> Workload:
    check(isinstance(width, int) and 1 <= width <= 4096, "model.width", width, "an integer in 1..4096")
    check(isinstance(layers, int) and 1 <= layers <= 16, "model.layers", layers, "an integer in 1..16")
    check(isinstance(context, int) and 2 <= context <= 4096, "model.context", context, "an integer in 2..4096")
    train, val, info = load_corpus(None, CharLMConfig.max_bytes, min_bytes=2 * (context + 1) * 10)
    windows = Windows(val, context)
    model = GRULM(width, layers)
    info = {**info, "parameters": sum(p.numel() for p in model.parameters()), "model": "GRU", "context": context}
    return Workload(model=model, train=Windows(train, context), val=EvenlySpaced(windows, min(len(windows), 512)),
                    loss=lm_loss, task="lm", info=info, lr=2e-3, batch_size=32, steps=300)
