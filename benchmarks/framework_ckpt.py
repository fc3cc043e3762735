"""Blocking time of a checkpoint save per framework: the framework's own save against our
flash save (to memory; and to memory then storage, persisted in the background), the same
model and state in the same run, one process (no agent: the persist runs on a thread of this
process), for HF's Trainer, Lightning, accelerate and DeepSpeed (ZeRO stage 1).  Prints one
JSON line: seconds per save (median of --repeat) and the ratio own / flash.

    python benchmarks/framework_ckpt.py [--dim 512] [--layers 8] [--repeat 5] [--dir DIR] [--cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

os.environ.setdefault("DLROVER_HPC_LOG_LEVEL", "WARNING")


def median_s(fn: Callable[[int], Any], repeat: int) -> float:
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i + 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf(args: argparse.Namespace, root: str) -> dict[str, float]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from dlrover_hpc.checkpoint.api import StorageType
    from dlrover_hpc.trainer.flash_checkpoint.hf_trainer import FlashCkptTrainer

    config = GPT2Config(n_layer=args.layers, n_head=8, n_embd=args.dim, vocab_size=8192)
    ids = torch.randint(0, 8192, (64, 32))
    data = [{"input_ids": r, "labels": r} for r in ids]
    out = {}
    for name, cls in (("own", Trainer), ("flash", FlashCkptTrainer)):
        targs = TrainingArguments(
            output_dir=os.path.join(root, f"hf-{name}"), max_steps=1, report_to=[],
            use_cpu=not args.cuda, disable_tqdm=True, save_strategy="no",
            per_device_train_batch_size=4,
        )  # fmt: skip
        trainer = cls(model=GPT2LMHeadModel(config), args=targs, train_dataset=data)
        trainer.train()  # optimizer state exists
        if name == "own":
            out["own_s"] = median_s(
                lambda i, t=trainer: t._save_checkpoint(t.model, None), args.repeat
            )
        else:

            def save(i: int, kind: StorageType, t: Any = trainer) -> None:
                t.state.global_step = i
                t.flash_save(kind)

            out["flash_memory_s"] = median_s(
                lambda i: save(100 + i, StorageType.MEMORY), args.repeat
            )
            out["flash_disk_s"] = median_s(lambda i: save(200 + i, StorageType.DISK), args.repeat)
            trainer.wait_latest_checkpoint(600)
            trainer.flash_checkpointer.close()
    return out


def lightning(args: argparse.Namespace, root: str) -> dict[str, float]:
    import lightning.pytorch as L

    from dlrover_hpc.checkpoint.api import StorageType
    from dlrover_hpc.trainer.flash_checkpoint.lightning_ckpt import FlashCheckpoint

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = [torch.nn.Linear(args.dim * 2, args.dim * 2) for _ in range(args.layers * 3)]
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    flash = FlashCheckpoint(os.path.join(root, "pl-flash"), memory_every_n_steps=0)
    trainer = L.Trainer(
        accelerator="gpu" if args.cuda else "cpu", devices=1, max_steps=1, callbacks=[flash],
        logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(8, args.dim * 2))
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4))
    out = {
        "own_s": median_s(
            lambda i: trainer.save_checkpoint(os.path.join(root, f"pl-own-{i}.ckpt")), args.repeat
        )
    }
    out["flash_memory_s"] = median_s(lambda i: flash.save(trainer, StorageType.MEMORY), args.repeat)
    out["flash_disk_s"] = median_s(lambda i: flash.save(trainer, StorageType.DISK), args.repeat)
    flash.checkpointer.wait_latest_checkpoint(600)
    flash.checkpointer.close()
    return out


def _mlp(args: argparse.Namespace) -> torch.nn.Module:
    width = args.dim * 2
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(args.layers * 3)])


def accelerate(args: argparse.Namespace, root: str) -> dict[str, float]:
    from accelerate import Accelerator

    from dlrover_hpc.trainer.flash_checkpoint.capture import DirectoryCheckpointer

    acc = Accelerator(cpu=not args.cuda)
    model = _mlp(args)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    acc.backward(model(torch.randn(4, args.dim * 2, device=acc.device)).square().mean())
    opt.step()
    flash = DirectoryCheckpointer(os.path.join(root, "ac-flash"))

    def save(i: int, kind: str) -> None:
        flash.save(i, os.path.join(root, "ac-flash", f"checkpoint-{i}"), acc.save_state, kind)

    out = {"own_s": median_s(lambda i: acc.save_state(os.path.join(root, f"ac-{i}")), args.repeat)}
    out["flash_memory_s"] = median_s(lambda i: save(100 + i, "memory"), args.repeat)
    out["flash_disk_s"] = median_s(lambda i: save(200 + i, "disk"), args.repeat)
    flash.wait_latest_checkpoint(600)
    flash.checkpointer.close()
    return out


def deepspeed(args: argparse.Namespace, root: str) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                 "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    import deepspeed as ds

    from dlrover_hpc.trainer.flash_checkpoint.deepspeed import (
        DeepSpeedCheckpointer,
        StorageType,
    )

    model = _mlp(args)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(4, args.dim * 2, device=engine.device)
    engine.backward(engine(x).square().mean())
    engine.step()
    flash = DeepSpeedCheckpointer(engine, os.path.join(root, "ds-flash"))
    own_dir = os.path.join(root, "ds-own")
    out = {"own_s": median_s(lambda i: engine.save_checkpoint(own_dir, tag=f"t{i}"), args.repeat)}
    for kind in (StorageType.MEMORY, StorageType.DISK):
        out[f"flash_{kind.value}_s"] = median_s(
            lambda i, k=kind: flash.save_checkpoint(
                flash.checkpoint_dir, f"{k.value}{i}", None, True, k
            ),
            args.repeat,
        )
    flash.wait_latest_checkpoint(600)
    flash.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default="")
    p.add_argument("--cuda", action="store_true", help="the model and its state on the GPU")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir or None) as root:
        result: dict[str, Any] = {
            "benchmark": "framework_ckpt",
            "device": torch.cuda.get_device_name() if args.cuda else "cpu",
            "dim": args.dim,
            "layers": args.layers,
        }
        frameworks = (
            ("hf_trainer", hf),
            ("lightning", lightning),
            ("accelerate", accelerate),
            ("deepspeed", deepspeed),
        )
        for name, fn in frameworks:
            r = fn(args, root)
            r["own_over_flash_memory"] = round(r["own_s"] / r["flash_memory_s"], 2)
            result[name] = {k: round(v, 4) for k, v in r.items()}
        print(json.dumps(result))


if __name__ == "__main__":
    main()
