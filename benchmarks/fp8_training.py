"""Training with FP8 attention: a small decoder-only transformer (built here from torch modules,
random init) learns multi-query associative recall with bf16 attention and with FP8 attention,
forward and backward, from the same seed; does the FP8 loss curve track bf16's?

Attention kinds: ``bf16`` (``flash_attn_func``); ``fp8`` (``flash_attn_func(..., fp8=True)``: the
FP8 forward and backward kernels on Hopper, their recipes in PyTorch on the CPU); ``fp8-recipe``:
the FP8 forward's and an FP8 backward recipe's numerics in PyTorch (``reference_fp8`` /
``reference_fp8_bwd``: e4m3 Q, K, V rotated, P, dS and dO in e4m3), which runs anywhere;
``fp8-forward`` / ``fp8-backward`` take one half in FP8 and the other in bf16 (which half costs
the loss). Prints the loss every ``--every`` steps and the final losses (mean of the last 10% of
steps); ``--out`` writes the curves (JSON) and their plot.

    python benchmarks/fp8_training.py [--steps 300] [--kinds bf16 fp8 fp8-recipe] [--device cpu]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

import cute_flash
from cute_flash.reference import attention_ref
from cute_flash.reference_fp8 import attention_fp8_ref, quantize_qkv_ref
from cute_flash.reference_fp8_bwd import BF16_RECIPE, Fp8BwdRecipe, attention_fp8_bwd_ref


class RecipeAttention(torch.autograd.Function):
    """Causal attention with a recipe's numerics (PyTorch): the FP8 forward (``fp8_fwd``) or the
    bf16 one, and the backward ``recipe``, which recomputes its own forward's O and LSE (for the
    mixed kinds: the gradients of the other half's attention at the same inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, fp8_fwd: bool, recipe: Fp8BwdRecipe):
        ctx.save_for_backward(q, k, v)
        ctx.recipe = recipe
        if fp8_fwd:
            qkv8 = quantize_qkv_ref(q, k, v, rotate_qk=recipe.rotate_qk, seed=recipe.seed)
            out, _ = attention_fp8_ref(*qkv8, causal=True)
        else:
            out, _ = attention_ref(q, k, v, causal=True)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        grads = attention_fp8_bwd_ref(q, k, v, dout, causal=True, recipe=ctx.recipe)
        return (*(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)), None, None)


# Which half of FP8 attention a run takes: (FP8 forward, backward recipe). The diagnostic kinds
# pair one FP8 half with the bf16 other half.
RECIPE_KINDS = {
    "fp8-recipe": (True, Fp8BwdRecipe(block_m=64, block_n=64)),
    "fp8-forward": (True, replace(BF16_RECIPE, block_m=64, block_n=64)),
    "fp8-backward": (False, Fp8BwdRecipe(block_m=64, block_n=64)),
}


def _parse(val: str, kind: type):
    if kind is bool:
        return val.lower() in ("1", "true")
    return int(val) if kind is int else val


def attention_fn(kind: str):
    """``kind``: bf16 or a ``RECIPE_KINDS`` name, which may end in ``:field=value,...`` overriding
    its backward recipe's fields (``fp8-backward:ds=fp32,do=fp32``: which operand costs the loss)."""
    if kind == "bf16":
        return lambda q, k, v: cute_flash.flash_attn_func(q, k, v, causal=True)
    if kind == "fp8":
        return lambda q, k, v: cute_flash.flash_attn_func(q, k, v, causal=True, fp8=True)
    name, _, fields = kind.partition(":")
    if name not in RECIPE_KINDS:
        raise ValueError(f"unknown attention kind {kind!r}")
    fp8_fwd, recipe = RECIPE_KINDS[name]
    if fields:
        pairs = dict(f.split("=") for f in fields.split(","))
        kinds = {key: type(getattr(recipe, key)) for key in pairs}
        recipe = replace(recipe, **{key: _parse(val, kinds[key]) for key, val in pairs.items()})
    return lambda q, k, v: RecipeAttention.apply(q, k, v, fp8_fwd, recipe)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attend) -> None:
        super().__init__()
        self.heads, self.attend = heads, attend
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, dim // self.heads).unbind(2)
        att = self.attend(*(t.bfloat16().contiguous() for t in (q, k, v)))
        x = x + self.proj(att.float().reshape(b, n, dim))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, seqlen: int, dim: int, heads: int, layers: int, attend) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seqlen, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, attend) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def recall_batch(batch: int, pairs: int, keys: int, values: int, gen: torch.Generator, device: str):
    """Multi-query associative recall: ``pairs`` (key, value) pairs with distinct keys, then every
    key again in a random order, each followed by its value. Targets: those values (-100 elsewhere)."""
    k = torch.stack([torch.randperm(keys, generator=gen)[:pairs] for _ in range(batch)])
    v = torch.randint(keys, keys + values, (batch, pairs), generator=gen)
    order = torch.stack([torch.randperm(pairs, generator=gen) for _ in range(batch)])
    kq, vq = k.gather(1, order), v.gather(1, order)
    tokens = torch.cat([torch.stack([k, v], 2).flatten(1), torch.stack([kq, vq], 2).flatten(1)], 1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * pairs::2] = vq  # (the position of each query key predicts its value)
    return tokens.to(device), targets.to(device)


def train(kind: str, *, steps: int, seed: int = 0, device: str = "cpu", batch: int = 32, pairs: int = 16,
          dim: int = 256, heads: int = 4, layers: int = 2, lr: float = 1e-3) -> list[float]:
    """Per-step training losses of the recall task with attention ``kind``; the same seed gives
    the same initial weights and batches whatever the kind."""
    torch.manual_seed(seed)
    keys, values = 64, 64
    model = Decoder(keys + values, 4 * pairs, dim, heads, layers, attention_fn(kind)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens, targets = recall_batch(batch, pairs, keys, values, gen, device)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def final_loss(losses: list[float]) -> float:
    tail = losses[-max(len(losses) // 10, 1):]
    return sum(tail) / len(tail)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kinds", nargs="+", default=["bf16", "fp8-recipe"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    curves = {kind: train(kind, steps=args.steps, seed=args.seed, device=args.device) for kind in args.kinds}
    for step in range(0, args.steps, args.every):
        print(f"step {step}: " + "  ".join(f"{k} {c[step]:.4f}" for k, c in curves.items()), flush=True)
    finals = {k: final_loss(c) for k, c in curves.items()}
    print("final (last 10%): " + "  ".join(f"{k} {v:.4f}" for k, v in finals.items()))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_training.json").write_text(json.dumps(curves))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for kind, c in curves.items():
            ax.plot(c, label=kind, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("associative recall, 2 layers, d_model 256, 4 heads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "fp8_training.png", dpi=120)


if __name__ == "__main__":
    main()
