"""Neural-network layers, parameters and parallel plans over sbpflow tensors.

>>> import sbpflow
>>> net = Sequential(Linear(4, 8), GELU(), Linear(8, 2))
>>> net(sbpflow.randn(3, 4)).shape
torch.Size([3, 2])
"""

from __future__ import annotations

from . import functional, init, parallel, utils
from .attention import LSTM, MultiheadAttention
from .container import ModuleDict, ModuleList, ParameterList, Sequential
from .conv import AdaptiveAvgPool2d, AvgPool2d, Conv1d, Conv2d, ConvTranspose2d, MaxPool2d
from .graph import Graph, GraphConfig
from .layers import (
    GELU,
    Dropout,
    Embedding,
    Flatten,
    Identity,
    LeakyReLU,
    Linear,
    PixelShuffle,
    ReLU,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
    Unflatten,
)
from .loss import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss, NLLLoss
from .module import Buffer, Module, Parameter
from .moe import MoE
from .normalization import BatchNorm1d, BatchNorm2d, GroupNorm, LayerNorm, RMSNorm

__all__ = [
    "Graph", "GraphConfig",
    "GELU", "AdaptiveAvgPool2d", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Conv2d", "CrossEntropyLoss", "Dropout",
    "Embedding", "Flatten", "Identity", "LayerNorm", "Linear", "MSELoss", "MaxPool2d", "MoE", "Module", "ModuleDict",
    "ModuleList", "Parameter", "RMSNorm", "ReLU", "Sequential", "SiLU", "Tanh", "functional", "init", "parallel",
    "utils", "BCEWithLogitsLoss", "Conv1d", "GroupNorm", "LeakyReLU", "NLLLoss", "ParameterList", "Sigmoid", "Softmax",
    "Unflatten", "Buffer", "PixelShuffle", "MultiheadAttention", "ConvTranspose2d", "LSTM",
]
