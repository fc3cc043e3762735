"""A Hugging Face Trainer script as its users write it (a tiny GPT-2 from its config and
synthetic tokens, so it runs on CPU without downloads), started as torchrun would start it:

    srun dlrover-run --nnodes=2 --nproc-per-node=2 examples/frameworks/hf_trainer.py --out DIR

--flash swaps `Trainer` for dlrover-hpc's `FlashCkptTrainer` (DLRover's name and import path)
and resumes from `trainer.get_last_checkpoint()`; without it the script resumes from HF's own
newest `checkpoint-<step>` directory.  --kill-at-step N --kill-rank R SIGKILLs that rank once,
before step N+1 of the first run (a fault to recover from).  Each run appends where it began
and ended to DIR/runs.jsonl (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 512, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    """Rank 0 notes where each run began and ended; one rank kills itself once."""

    def __init__(self, out: str, kill_at: int, kill_rank: int) -> None:
        self.out, self.kill_at, self.kill_rank = out, kill_at, kill_rank
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.rank = int(os.environ.get("RANK", "0"))

    def _note(self, **fields: object) -> None:
        if self.rank == 0:
            with open(os.path.join(self.out, "runs.jsonl"), "a") as f:
                f.write(json.dumps({"restart": self.restart, **fields}) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self._note(event="begin", step=state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.restart == 0 and state.global_step == self.kill_at and self.rank == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, args, state, control, **kwargs):
        self._note(event="end", step=state.global_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--flash", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--cuda", action="store_true", help="train on the GPU (default: the CPU)")
    a = p.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=64)
    args = TrainingArguments(
        output_dir=a.out,
        max_steps=a.max_steps,
        save_steps=a.save_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=10,
        report_to=[],
        use_cpu=not a.cuda,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs = dict(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(),
        callbacks=[Record(a.out, a.kill_at_step, a.kill_rank)],
    )
    if a.flash:
        from dlrover_hpc.trainer.flash_checkpoint.hf_trainer import FlashCkptTrainer

        trainer = FlashCkptTrainer(**kwargs)
        last = trainer.get_last_checkpoint()
    else:
        trainer = Trainer(**kwargs)
        last = get_last_checkpoint(a.out) if os.path.isdir(a.out) else None
    trainer.train(resume_from_checkpoint=last or None)


if __name__ == "__main__":
    main()
