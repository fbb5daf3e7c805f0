"""One BERT-base encoder layer (Devlin et al., 2019): self-attention with 12 heads,
post-LayerNorm, a 3072-wide feed-forward with GELU."""

from __future__ import annotations

import math

import torch
from torch import nn


class BertLayer(nn.Module):
    def __init__(self, hidden: int = 768, heads: int = 12, ffn: int = 3072, seq: int = 128):
        super().__init__()
        self.heads, self.head_dim, self.seq = heads, hidden // heads, seq
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, ffn)
        self.output = nn.Linear(ffn, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=1e-12)

    def split_heads(self, x):  # (1, seq, hidden) -> (1, heads, seq, head_dim)
        return x.reshape(1, self.seq, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.split_heads(self.query(x)), self.split_heads(self.key(x)), self.split_heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        context = torch.matmul(torch.softmax(scores, dim=-1), v)
        context = context.permute(0, 2, 1, 3).reshape(1, self.seq, self.heads * self.head_dim)
        x = self.attn_norm(x + self.attn_out(context))
        return self.out_norm(x + self.output(nn.functional.gelu(self.intermediate(x))))
