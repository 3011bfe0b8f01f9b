"""A Transformer encoder: 4 layers, d_model 256, 4 heads, feed-forward 1024, batch_first."""
from __future__ import annotations

from torch import nn


class TransformerEncoderModel(nn.Module):
    """Embeddings in (batch, 128, 256) → 4 encoder layers → mean-pooled 10-way head."""

    def __init__(self, d_model: int = 256, heads: int = 4, ff: int = 1024, layers: int = 4,
                 num_classes: int = 10) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))
