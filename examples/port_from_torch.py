"""Models written for torch, run by sbpflow with only their imports changed, trained data parallel (dp2) and data
x tensor parallel (dp2 x tp2) to the numbers torch gives on one device.

    python examples/port_from_torch.py            # ResNet and ViT, 3 steps each layout, virtual ranks
    python examples/port_from_torch.py --steps 5

``RESNET`` is torchvision's ResNet written the way torchvision writes it (BasicBlock, kaiming init, inplace ReLU,
``torch.flatten``); ``VIT`` a small vision transformer written for torch (patch conv, class token, position
embedding, nn.MultiheadAttention, trunc_normal_ init). :func:`port` swaps the import lines for sbpflow's and
executes the same text. Both frameworks start from the same weights (torch's state dict loaded into sbpflow's
model) and train on the same batches; the losses and the final weights are compared.
"""

from __future__ import annotations

import argparse
import types
from typing import Any

import numpy as np
import torch as real_torch

import sbpflow
from sbpflow import sbp
from sbpflow.nn.parallel import ColwiseParallel, RowwiseParallel, apply_plan

IMPORTS = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
PORTED = "import sbpflow as torch\nimport sbpflow.nn as nn\nimport sbpflow.nn.functional as F\n"

RESNET = IMPORTS + '''
def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(1, 1), widths=(8, 16), num_classes=10):
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(widths[0], layers[0])
        self.layer2 = self._make_layer(widths[1], layers[1], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[1] * BasicBlock.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)
'''

VIT = IMPORTS + '''
class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=2):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image=8, patch=4, dim=16, depth=2, heads=2, num_classes=10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        n = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])
'''


def port(source: str, ported: bool) -> types.SimpleNamespace:
    """The model file executed as written (torch) or with its three import lines swapped for sbpflow's."""
    if not source.startswith(IMPORTS):
        raise ValueError("the model source must start with the torch imports it is ported from")
    namespace: dict[str, Any] = {}
    exec(PORTED + source[len(IMPORTS):] if ported else source, namespace)  # noqa: S102 (our own model text)
    return types.SimpleNamespace(**namespace)


def batches(steps: int, image: int, seed: int = 0) -> list[tuple[real_torch.Tensor, real_torch.Tensor]]:
    g = real_torch.Generator().manual_seed(seed)
    return [(real_torch.randn(8, 3, image, image, generator=g), real_torch.randint(0, 10, (8,), generator=g))
            for _ in range(steps)]


def train_torch(model: Any, data: list[Any], lr: float) -> list[float]:
    opt = real_torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in data:
        loss = real_torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_sbpflow(model: Any, data: list[Any], lr: float, placement: sbpflow.Placement) -> list[float]:
    opt = sbpflow.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    batch = (sbp.split(0),) + (sbp.broadcast,) * (placement.ndim - 1)  # the data axis is mesh axis 0
    losses = []
    for x, y in data:
        logits = model(sbpflow.tensor(x, placement=placement, sbp=batch))
        loss = sbpflow.nn.functional.cross_entropy(logits, sbpflow.tensor(y, placement=placement, sbp=batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


TP_PLANS = {  # tensor parallel on mesh axis 1: Megatron's column then row split of each pair of layers
    "ResNet": {"layer*.0.conv1": ColwiseParallel(), "layer*.0.conv2": RowwiseParallel()},
    "ViT": {"blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()},
}


def run(name: str, layout: str, steps: int, lr: float = 0.05) -> tuple[list[float], list[float], float, Any]:
    """(sbpflow's losses, torch's losses, the largest weight or buffer difference after training, sbpflow's model)
    for one model and layout."""
    source, cls, image = {"ResNet": (RESNET, "ResNet", 16), "ViT": (VIT, "ViT", 8)}[name]
    real_torch.manual_seed(0)
    theirs = getattr(port(source, ported=False), cls)()
    ours = getattr(port(source, ported=True), cls)()
    ours.load_state_dict(theirs.state_dict())
    if layout == "dp2":
        placement = sbpflow.placement("cpu", [0, 1])
        ours.to_global(placement)
    else:  # "dp2xtp2"
        placement = sbpflow.placement("cpu", [[0, 1], [2, 3]])
        apply_plan(ours, TP_PLANS[name], placement, mesh_axis=1)
    data = batches(steps, image)
    ours_losses = train_sbpflow(ours, data, lr, placement)
    theirs_losses = train_torch(theirs, data, lr)
    gap = max(float(np.abs(v.numpy() - theirs.state_dict()[k].numpy()).max()) for k, v in ours.state_dict().items())
    return ours_losses, theirs_losses, gap, ours


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    for name in ("ResNet", "ViT"):
        for layout in ("dp2", "dp2xtp2"):
            ours, theirs, gap, _ = run(name, layout, args.steps)
            print(f"{name:6} {layout:8} sbpflow {' '.join(f'{v:.5f}' for v in ours)} | torch "
                  f"{' '.join(f'{v:.5f}' for v in theirs)} | max weight gap {gap:.1e}")


if __name__ == "__main__":
    main()
