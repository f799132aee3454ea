"""Build the tiny random-init test model: python scripts/make_tiny_model.py DIR [--template llama3].

The same as `arl make-tiny-model` (needs the package installed, e.g. `pip install -e .`).
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write the checkpoint and tokenizer into")
    parser.add_argument("--template", choices=("qwen", "llama3"), default="qwen", help="chat format")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (a multiple of 8)")
    parser.add_argument("--seed", type=int, default=0, help="weight-init seed (the tokenizer does not depend on it)")
    parser.add_argument("--vocab-size", type=int, default=512, help="vocabulary size, added tokens included")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty directory")
    args = parser.parse_args(argv)

    from pipeline.demo.tiny_model import make_tiny_model  # heavy imports after --help

    out = make_tiny_model(
        args.out_dir,
        template=args.template,
        num_layers=args.layers,
        hidden_size=args.hidden,
        seed=args.seed,
        vocab_size=args.vocab_size,
        overwrite=args.overwrite,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
