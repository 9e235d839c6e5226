import torch
import torch.nn as nn


class Model(nn.Module):
    """out = (a + b) * scale, with the scale a constructor argument."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a + b) * self.scale


n = 1000
scale = 0.75


def get_inputs():
    return [torch.rand(n), torch.rand(n)]


def get_init_inputs():
    return [scale]
