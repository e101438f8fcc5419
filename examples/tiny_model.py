"""examples/train_tiny.py's model and data: a small decoder-only transformer (TinyLM), the
seeded initialization its --meta-init materializes (seeded_init), and synthetic token sequences
from a fixed random bigram Markov chain (bigram_chain, batch)."""
import math
import zlib

import torch
import torch.utils.checkpoint


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        # No bias (as LLaMA): a key bias has an exactly zero gradient (softmax ignores a constant
        # per row), and Adam would turn its rounding noise into full-size steps.
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, d, layers, heads, seq, checkpoint_activations="", tie=False):
        super().__init__()
        self.checkpoint_activations = checkpoint_activations  # "", "reentrant", "non-reentrant"
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.layers = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight  # one parameter, used by both

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            if self.checkpoint_activations:
                # The block's activations are recomputed in backward, its unit gathered.
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, use_reentrant=self.checkpoint_activations == "reentrant")
            else:
                x = layer(x)
        return self.head(self.ln(x))


def seeded_init(model, seed):
    """init(name, tensor) for --meta-init: each tensor from its own generator (seeded by the run's
    seed and the tensor's name), with the distribution torch gives its module (Linear weights
    and biases U(±1/sqrt(fan_in)), embeddings N(0, 1), LayerNorm ones and zeros). A rank can
    build one tensor at a time, and the reference builds the same values."""
    kinds = {}
    for mname, m in model.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            fqn = f"{mname}.{pname}" if mname else pname
            if isinstance(m, torch.nn.Linear):
                kinds.setdefault(fqn, ("uniform", 1.0 / math.sqrt(m.in_features)))
            elif isinstance(m, torch.nn.Embedding):
                kinds.setdefault(fqn, ("normal", 1.0))
            elif isinstance(m, torch.nn.LayerNorm):
                kinds.setdefault(fqn, ("ones" if pname == "weight" else "zeros", 0.0))

    def init(name, tensor):
        kind, bound = kinds[name]
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if kind == "uniform":
            return torch.rand(tensor.shape, generator=g) * (2 * bound) - bound
        if kind == "normal":
            return torch.randn(tensor.shape, generator=g)
        return torch.ones(tensor.shape) if kind == "ones" else torch.zeros(tensor.shape)
    return init


def bigram_chain(vocab, seed):
    g = torch.Generator().manual_seed(seed + 7919)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    return logits.softmax(-1)


def batch(chain, seed, step, rows, seq):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.empty(rows, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, chain.shape[0], (rows,), generator=g)
    for t in range(seq):
        x[:, t + 1] = torch.multinomial(chain[x[:, t]], 1, generator=g).squeeze(1)
    return x[:, :-1], x[:, 1:]
