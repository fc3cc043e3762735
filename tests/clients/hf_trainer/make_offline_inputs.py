"""Create the offline inputs for the vendored, unmodified ``run_clm.py``.

NOT an upstream file: written for dlrover-hpc so that run_clm.py needs neither
the Hugging Face Hub nor any download.  It writes into OUT_DIR:

  train.txt      a small deterministic English-like text corpus
  tokenizer/     a word-level fast tokenizer trained on train.txt
                 (loadable with AutoTokenizer.from_pretrained(OUT_DIR/tokenizer))

Usage: python make_offline_inputs.py OUT_DIR
Deterministic: the same OUT_DIR content on every run.
"""

import os
import random
import sys

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

WORDS = (
    "the a one two some every small large quick slow red blue green model data node rank worker agent "
    "master checkpoint step loss gradient batch epoch restart trains reads writes saves loads sends "
    "waits runs fails recovers and or but then while after before on in with from to"
).split()


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(1234)
    lines = []
    for _ in range(400):
        n = rng.randint(6, 14)
        lines.append(" ".join(rng.choice(WORDS) for _ in range(n)) + " .")
    train_file = os.path.join(out_dir, "train.txt")
    with open(train_file, "w") as f:
        f.write("\n".join(lines) + "\n")

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[EOS]"])
    tok.train([train_file], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="[EOS]",
        bos_token="[EOS]",
        model_max_length=64,
    )
    fast.save_pretrained(os.path.join(out_dir, "tokenizer"))
    print(f"wrote {train_file} and {os.path.join(out_dir, 'tokenizer')} (vocab {len(fast)})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_offline_inputs.py OUT_DIR")
    main(sys.argv[1])
