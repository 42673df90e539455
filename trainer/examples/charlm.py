"""A small character-level transformer language model on a generated text corpus.

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        trainer/examples/charlm.py --max-steps 300 --checkpoint-dir /tmp/ckpt

The corpus is generated deterministically from ``--data-seed`` (sentences from a
small grammar, so there is structure to learn and no file to ship); a sample is
a window of ``--context + 1`` characters, and the per-sample loss is the mean
next-character cross-entropy of the window. Dropout draws from the per-step RNG
that the trainer reseeds, so resumes stay reproducible.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from trainer.examples import common
from trainer.exitcodes import exit_worker

SUBJECTS = ["the cat", "a dog", "my neighbour", "the old sailor", "every student", "a robot"]
VERBS = ["sees", "likes", "builds", "paints", "forgets", "follows", "repairs"]
OBJECTS = ["the moon", "a red kite", "seven boats", "the quiet river", "an idea", "the garden"]
ENDINGS = [".", " today.", " at night.", " again.", " with care."]


def make_corpus(chars: int, seed: int) -> str:
    """About ``chars`` characters of grammatical nonsense, a pure function of ``seed``."""
    rnd = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < chars:
        sentence = f"{rnd.choice(SUBJECTS)} {rnd.choice(VERBS)} {rnd.choice(OBJECTS)}"
        sentence = sentence[0].upper() + sentence[1:] + rnd.choice(ENDINGS) + " "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:chars]


class CharTransformer(nn.Module):
    """Token + position embeddings, a causal pre-norm transformer encoder, a linear head."""

    def __init__(self, vocab: int, context: int, dim: int, layers: int, heads: int,
                 dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, batch_first=True,
                                           norm_first=True)
        # Nested tensors only pay off with padding masks, and warn otherwise.
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def per_sample_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    losses = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return losses.mean(dim=1)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0], batch_size=16, lr=3e-3)
    p.add_argument("--corpus-chars", type=int, default=50_000)
    p.add_argument("--data-seed", type=int, default=7)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    args = common.parse(p, argv)
    text = make_corpus(args.corpus_chars, args.data_seed)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    # Sample i is the window data[i : i + context + 1]: inputs and shifted targets.
    windows = data.unfold(0, args.context + 1, 1)
    model = CharTransformer(len(vocab), args.context, args.dim, args.layers, args.heads,
                            args.dropout).to(common.DTYPES[args.dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return common.train(
        args, model, optimizer, len(windows),
        batch_fn=lambda idx: (windows[idx, :-1], windows[idx, 1:]), loss_fn=per_sample_loss,
    )


if __name__ == "__main__":
    exit_worker(main())
