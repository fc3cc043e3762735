"""A synthetic MNIST for `cnn_train.py` where torchvision is missing (dlrover-hpc, not DLRover).

`cnn_train.py` falls back to this module when `import torchvision` fails.  `datasets.MNIST`
gives 28x28 one-channel images whose label (0-9) is a bright block at a place of its own over
noise, so the CNN learns; every item is made from a seed, nothing is downloaded.  Sizes come
from SYNTHETIC_MNIST_TRAIN and SYNTHETIC_MNIST_TEST (defaults 12800 and 1000: 200 steps of
batch 32 on each of two ranks).  `transforms.ToTensor()` passes tensors through.
`datasets.ImageFolder` needs torchvision: install it for `--training_data` folders.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
from torch.utils.data import Dataset


class _SyntheticMNIST(Dataset[tuple[torch.Tensor, int]]):
    def __init__(
        self,
        root: str = "",
        train: bool = True,
        transform: Any = None,
        target_transform: Any = None,
        download: bool = False,
    ) -> None:
        name = "SYNTHETIC_MNIST_TRAIN" if train else "SYNTHETIC_MNIST_TEST"
        self.size = int(os.environ.get(name, 12800 if train else 1000))
        self.seed = 0 if train else 1 << 30
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed + index)
        label = int(torch.randint(0, 10, (1,), generator=gen))
        image = torch.rand(1, 28, 28, generator=gen) * 0.3
        row, col = divmod(label, 5)
        image[0, 2 + row * 13 : 13 + row * 13, 1 + col * 5 : 6 + col * 5] += 0.7
        if self.transform is not None:
            image = self.transform(image)
        target: Any = label if self.target_transform is None else self.target_transform(label)
        return image, target


class _ToTensor:
    def __call__(self, image: Any) -> torch.Tensor:
        return image if isinstance(image, torch.Tensor) else torch.as_tensor(image)


def _image_folder(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("datasets.ImageFolder needs torchvision; install it, or drop --*_data")


datasets = types.SimpleNamespace(MNIST=_SyntheticMNIST, ImageFolder=_image_folder)
transforms = types.SimpleNamespace(ToTensor=_ToTensor)
