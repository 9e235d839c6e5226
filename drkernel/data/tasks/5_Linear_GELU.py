import torch
import torch.nn as nn


class Model(nn.Module):
    """A linear layer followed by GELU (tanh approximation): a level-2 style fusion."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x), approximate="tanh")


batch_size = 16
in_features = 32
out_features = 24


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
