"""``charlm``: a GPT-style byte-level transformer language model on a real text corpus.

The model follows nanoGPT (Karpathy): token and position embeddings, pre-norm blocks of causal
self-attention (``scaled_dot_product_attention``) and a 4x GELU MLP, a final LayerNorm and a head
tied to the token embedding. 256 byte values, no tokenizer. Parameters ~ ``12 * layers * width^2 +
256 * width + context * width``: widen it to make a run communication-bound, lengthen the context
or batch to make it compute-bound.

Validation reports the loss in nats and bits per byte; ``summary.json`` also records the corpus's
unigram (byte-frequency) entropy, the bits per byte of the best model that ignores context.

A concept-drift workload: ``--set model.drift_step=S`` switches training and validation to another
corpus from step S on, one of the same length (so shards, samplers and the validation subset keep
their meaning): ``model.drift=rot13`` (default) the same files ROT13-encoded, every letter shifted 13
places, so every keyword and identifier is a new word in an unchanged structure; ``model.drift=swapcase``
upper and lower case exchanged. The validation curve shows how fast training recovers.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F

from thinwire.config import check
from thinwire.workloads.base import Workload
from thinwire.workloads.corpus import load_corpus


@dataclasses.dataclass(kw_only=True)
class CharLMConfig:
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 128
    dropout: float = 0.0
    max_bytes: int = 4_000_000
    drift_step: int = 0        # > 0: from this step on, train and validation switch to the drifted corpus
    drift: str = "rot13"       # rot13: letters shifted 13 places; swapcase: upper and lower case exchanged

    def __post_init__(self) -> None:
        check(1 <= self.layers <= 256, "model.layers", self.layers, "an integer in [1, 256]")
        check(8 <= self.width <= 65536, "model.width", self.width, "an integer in [8, 65536]")
        check(self.heads >= 1 and self.width % self.heads == 0, "model.heads", self.heads,
              f"a divisor of model.width ({self.width})", "Pick heads so that width / heads is an integer.")
        check(2 <= self.context <= 65536, "model.context", self.context, "an integer in [2, 65536]")
        check(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "a number in [0, 1)")
        check(self.max_bytes >= 1024, "model.max_bytes", self.max_bytes, "an integer >= 1024")
        check(self.drift_step >= 0, "model.drift_step", self.drift_step, "an integer >= 0 (0: no drift)")
        check(self.drift in DRIFTS, "model.drift", self.drift, " or ".join(DRIFTS))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads, cfg.dropout) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, 256, bias=False)
        self.head.weight = self.tok.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Embed(nn.Module):
    """The first pipeline layer: token plus position embedding (the same tensors as the model's)."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """The last pipeline layer: final LayerNorm and the (tied) output projection."""

    def __init__(self, ln: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln, self.head = ln, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


def layers(model: CharGPT) -> list[tuple[str, nn.Module]]:
    """The model's pipeline layer list: the embedding, each block, the head (charlm's natural stage
    boundaries). The head's weight is the embedding's: pipelined, the two stages holding it sum its gradient."""
    return ([("embed", Embed(model.tok, model.pos))] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
            + [("head", Head(model.ln, model.head))])


class Windows:
    """Every window of ``context + 1`` bytes of a corpus: input = first ``context``, target = shifted."""

    def __init__(self, data: torch.Tensor, context: int) -> None:
        self.data, self.context = data, context

    def __len__(self) -> int:
        return len(self.data) - self.context

    def __getitem__(self, i: int):
        w = self.data[i : i + self.context + 1].long()
        return w[:-1], w[1:]

    def batch(self, indices: list[int]):
        idx = torch.as_tensor(indices, dtype=torch.long)[:, None] + torch.arange(self.context + 1)
        w = self.data[idx].long()
        return w[:, :-1], w[:, 1:]


class EvenlySpaced:
    """A fixed validation subset: ``n`` windows spread evenly over the validation bytes."""

    def __init__(self, windows: Windows, n: int) -> None:
        self.windows, step = windows, max(1, len(windows) // n)
        self.starts = list(range(0, len(windows), step))[:n]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        return self.windows[self.starts[i]]

    def batch(self, indices: list[int]):
        return self.windows.batch([self.starts[i] for i in indices])


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


DRIFTS = ("rot13", "swapcase")


def drift_table(kind: str) -> torch.Tensor:
    """A byte -> byte map (256 entries) of a drift: ROT13 or case exchange of ASCII letters."""
    table = torch.arange(256, dtype=torch.uint8)
    for lo, hi in ((ord("a"), ord("z")), (ord("A"), ord("Z"))):
        letters = torch.arange(lo, hi + 1)
        table[letters] = ((letters - lo + 13) % 26 + lo if kind == "rot13" else letters ^ 0x20).to(torch.uint8)
    return table


def build(cfg: CharLMConfig, data: str | None = None) -> Workload:
    train, val, info = load_corpus(data, cfg.max_bytes, min_bytes=2 * (cfg.context + 1) * 10)
    model = CharGPT(cfg)
    info["parameters"] = sum(p.numel() for p in model.parameters())

    def sets(tr: torch.Tensor, va: torch.Tensor) -> tuple[Windows, EvenlySpaced]:
        windows = Windows(va, cfg.context)
        return Windows(tr, cfg.context), EvenlySpaced(windows, min(len(windows), 512))

    plain, data_at = sets(train, val), None
    if cfg.drift_step > 0:
        table = drift_table(cfg.drift)
        drifted = sets(table[train.long()], table[val.long()])
        data_at = lambda step: drifted if step >= cfg.drift_step else plain  # noqa: E731
        info["drift"] = {"step": cfg.drift_step, "kind": cfg.drift}
    return Workload(
        model=model,
        train=plain[0],
        val=plain[1],
        data_at=data_at,
        loss=lm_loss,
        task="lm",
        info=info,
        lr=3e-3, batch_size=32, steps=600, layers=layers,
    )
