"""The `nostall` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from nostall.engine.args import EngineArgs
from nostall.errors import NostallError


def _generate(args: argparse.Namespace) -> int:
    from nostall.llm import LLM
    from nostall.sampling_params import SamplingParams

    if not args.verbose:
        logging.getLogger("nostall").setLevel(logging.WARNING)
    engine_args = EngineArgs.from_cli_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    kwargs = dict(vars(engine_args))
    llm = LLM(kwargs.pop("model"), **kwargs)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nostall", description="nostall LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    gen.add_argument("--model", required=True, help="Hugging Face model directory or .gguf file")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    gen.add_argument("-v", "--verbose", action="store_true", help="print engine logs")
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (NostallError, ValueError, OSError) as e:
        print(f"nostall {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
