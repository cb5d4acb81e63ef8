"""Train a small DIFF V2 model in PyTorch with diffattn.torch, then decode with a KV cache.

The focus task of examples/train_focus.cpp, small: a sequence holds 31 (key,
value) tokens with distinct keys (64 keys, 16 values) and a last query token
carrying one of the keys; the model must output the value stored with that key.
Token embeddings are fixed random vectors (context token = key_emb[key] +
value_emb[value], query = key_emb[key] + query_emb). Model: one
diffattn.torch.MultiheadDiffAttnV2 layer (E 64, 4 DIFF heads from 8 query heads
of 16 on 2 kv heads, causal, rotary) and a linear read-out of its output at the
query token; cross-entropy, torch.optim.AdamW (lr 1e-2). The attention's
forward and backward run in diffattn's fused kernels; everything else is torch.

Then it decodes held-out sequences token by token through the layer's KV cache
and checks that the last token's output equals the whole-sequence forward, and
through an int8 cache, whose answers must agree with the forward's on 95% of
the held-out sequences.

    PYTHONPATH=build/python python3 examples/python/train_focus.py [--quick] [--epochs 8]

Exits non-zero if the loss does not fall, accuracy stays at chance, or the
cached decoding disagrees.
"""

import argparse
import math
import sys
import time

import torch

import diffattn
import diffattn.torch as dt

E, CONTEXT, KEYS, VALUES = 64, 31, 64, 16


def make_embeddings(gen):
    s = 1.0 / math.sqrt(E)
    return (s * torch.randn(KEYS, E, generator=gen), s * torch.randn(VALUES, E, generator=gen),
            s * torch.randn(E, generator=gen))


def make_batch(emb, gen, count):
    key_emb, value_emb, query_emb = emb
    keys = torch.argsort(torch.rand(count, KEYS, generator=gen), dim=1)[:, :CONTEXT]  # distinct
    values = torch.randint(0, VALUES, (count, CONTEXT), generator=gen)
    answer = torch.randint(0, CONTEXT, (count,), generator=gen)
    x = torch.empty(count, CONTEXT + 1, E)
    x[:, :CONTEXT] = key_emb[keys] + value_emb[values]
    rows = torch.arange(count)
    x[:, CONTEXT] = key_emb[keys[rows, answer]] + query_emb
    return x, values[rows, answer]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # (embed_dim, depth, num_heads, num_kv_heads), the reference's signature
        self.attn = dt.MultiheadDiffAttnV2(E, 0, 4, 2, num_threads=1)
        self.readout = torch.nn.Linear(E, VALUES)

    def forward(self, x, cache=None):
        return self.readout(self.attn(x, cache)[:, -1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short schedule (smoke test)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per epoch")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if a.quick:
        a.epochs, a.steps = 3, 150
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(a.seed)
    emb = make_embeddings(gen)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    print(f"diffattn {diffattn.__version__}, kernels: {diffattn.isa()}; "
          f"{sum(p.numel() for p in model.attn.parameters())} attention parameters")
    start = time.time()
    first = last = None
    for epoch in range(a.epochs):
        total = 0.0
        for _ in range(a.steps):
            x, y = make_batch(emb, gen, a.batch)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        mean = total / a.steps
        first = mean if first is None else first
        last = mean
        print(f"epoch {epoch + 1}: loss {mean:.4f} ({time.time() - start:.1f} s)")

    x, y = make_batch(emb, gen, 256)
    with torch.no_grad():
        logits = model(x)
    accuracy = float((logits.argmax(1) == y).float().mean())
    print(f"held-out accuracy {accuracy:.3f} (chance {1 / VALUES:.3f})")

    # Decoding: the same 8 sequences token by token through a KV cache.
    xs = x[:8]
    cache = model.attn.make_cache(batch=8, capacity=CONTEXT + 1)
    with torch.no_grad():
        for t in range(CONTEXT + 1):
            step = model(xs[:, t:t + 1], cache)  # one new token per sequence
    diff = float((step - logits[:8]).abs().max())
    print(f"decoded {cache.size()} tokens per sequence through the cache: "
          f"max |logits - full forward| = {diff:.2e}")

    # The same held-out sequences through an int8 cache (a quarter of float32's
    # bytes): the model's answers should hardly move.
    cache8 = model.attn.make_cache(batch=x.shape[0], capacity=CONTEXT + 1, dtype="int8")
    with torch.no_grad():
        for t in range(CONTEXT + 1):
            step8 = model(x[:, t:t + 1], cache8)
    agree = float((step8.argmax(1) == logits.argmax(1)).float().mean())
    accuracy8 = float((step8.argmax(1) == y).float().mean())
    wide = model.attn.make_cache(batch=x.shape[0], capacity=CONTEXT + 1).bytes()
    print(f"int8 cache ({cache8.bytes()} bytes against {wide} in float32): "
          f"accuracy {accuracy8:.3f}, same answer as the full forward on "
          f"{agree:.1%} of {x.shape[0]} sequences")

    ok = last < 0.7 * first and accuracy > 3.0 / VALUES and diff < 1e-4
    ok = ok and agree >= 0.95
    if not a.quick:
        ok = ok and accuracy > 0.9
    print("all checks passed" if ok else "a check failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
