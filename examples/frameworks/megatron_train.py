"""A Megatron-Core training loop (a tiny GPT, tensor and pipeline parallel 1) whose checkpoints
are Megatron's distributed checkpoints (`megatron.core.dist_checkpointing.save/load`), started
as torchrun would start it:

    srun dlrover-run --nnodes=1 --nproc-per-node=1 examples/frameworks/megatron_train.py --out DIR

--flash saves through dlrover-hpc's `DirectoryCheckpointer`: Megatron's own save runs into a
scratch directory, its files (the DCP shards, `common.pt`, `metadata.json`) go into shared
memory and the agent writes them to DIR/flash/iter_<step>/ in the background; a memory save
every step, storage every --save-steps.  Without it the script saves with Megatron alone to
DIR/own/iter_<step>.  --kill-at-step N SIGKILLs rank 0 once, before step N+1 of the first run.
Each run appends where it began and ended to DIR/runs.jsonl.  On a CUDA GPU with NCCL; on the
CPU with gloo (--cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

SEQ, VOCAB = 32, 128


def newest(directory: str) -> str | None:
    steps = [
        int(m.group(1))
        for name in (os.listdir(directory) if os.path.isdir(directory) else [])
        if (m := re.fullmatch(r"iter_(\d+)", name))
    ]
    return os.path.join(directory, f"iter_{max(steps)}") if steps else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--flash", action="store_true")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=-1)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cpu") if a.cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if not a.cpu:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("gloo" if a.cpu else "nccl")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    if not a.cpu:
        model_parallel_cuda_manual_seed(0)  # Megatron's tensor-parallel RNG states
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    own_dir = os.path.join(a.out, "own")
    if a.flash:
        from dlrover_hpc.trainer.flash_checkpoint.capture import DirectoryCheckpointer

        flash = DirectoryCheckpointer(os.path.join(a.out, "flash"))
        resume = flash.last_checkpoint()
    else:
        resume = newest(own_dir)
    step = 0
    if resume:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, resume)
        result = model.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"checkpoint {resume}: missing {missing}, unexpected {result}")
        extra = torch.load(os.path.join(resume, "extra.pt"), weights_only=False)
        optimizer.load_state_dict(extra["optimizer"])
        step = extra["step"]

    def save(directory: str) -> None:
        dist_checkpointing.save({"model": model.sharded_state_dict()}, directory)
        torch.save({"optimizer": optimizer.state_dict(), "step": step}, f"{directory}/extra.pt")

    def note(**fields: object) -> None:
        with open(os.path.join(a.out, "runs.jsonl"), "a") as f:
            f.write(json.dumps({"restart": restart, **fields}) + "\n")

    note(event="begin", step=step)
    g = torch.Generator().manual_seed(step)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1)
    while step < a.max_steps:
        if restart == 0 and step == a.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g).to(device)
        loss = model(tokens, position_ids, mask, labels=tokens.roll(-1, dims=1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        name = f"iter_{step}"
        if a.flash:
            kind = "disk" if step % a.save_steps == 0 else "memory"
            flash.save(step, os.path.join(a.out, "flash", name), save, kind)
        elif step % a.save_steps == 0:
            os.makedirs(os.path.join(own_dir, name), exist_ok=True)
            save(os.path.join(own_dir, name))
    note(event="end", step=step, loss=float(loss))
    if a.flash:
        flash.wait_latest_checkpoint()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
