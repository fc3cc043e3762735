"""Writes a synthetic text for DLRover's nanogpt `prepare.py` (dlrover-hpc, not DLRover).

DLRover's nanogpt example trains on `data.txt` (shipped in its repository) turned into
`train.bin`, `val.bin` and `meta.pkl` by `prepare.py`.  This writes a text of pseudo-random
words (a fixed seed) to use in its place:

    python examples/dlrover/make_nanogpt_text.py --out /tmp/nanogpt/input.txt
    python examples/dlrover/nanogpt/prepare.py --src_data_path /tmp/nanogpt/input.txt \\
        --output_dir /tmp/nanogpt/data
"""

from __future__ import annotations

import argparse
import os
import random

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "at"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the text file to write")
    parser.add_argument("--chars", type=int, default=200_000, help="about this many characters")
    args = parser.parse_args()
    rng = random.Random(0)
    lines, size = [], 0
    while size < args.chars:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
        lines.append(line)
        size += len(line) + 1
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {size} characters to {args.out}")


if __name__ == "__main__":
    main()
