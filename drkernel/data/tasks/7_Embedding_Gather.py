import torch
import torch.nn as nn


class Model(nn.Module):
    """Look up rows of a learned table by integer ids (integer inputs must stay integers)."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


num_embeddings = 50
dim = 16
num_ids = 64


def get_inputs():
    return [torch.randint(0, num_embeddings, (num_ids,))]


def get_init_inputs():
    return [num_embeddings, dim]
