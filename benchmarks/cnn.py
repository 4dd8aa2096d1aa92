"""A small CNN in plain torch (convolution, BatchNorm, ReLU, max-pooling, a linear
head) with SGD: the tensor engine's second real workload in the tests
(``test_tensor_real``, ``test_tensor_dynamo``). The same code runs locally and
under ``mesh.activate()``."""

from __future__ import annotations

import torch
from torch import nn


def make(batch: int = 16):
    """``(model, optimizer, inputs, labels)``, the same for a seed: made on the active
    mesh under ``mesh.activate()``, locally outside it."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return net, opt, torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))
