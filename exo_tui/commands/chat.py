"""``exo-tui chat``: answer one chat message, on this machine or across nodes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="answer one chat message (here, or across node agents)",
        description="Answer one chat message, streaming the text as it comes.",
    )
    p.add_argument("prompt", help="the user's message")
    p.add_argument("--model", default=None, help="a name `exo-tui models` lists (smollm2-135m, llama3.2:1b...) or a path to a .gguf (default smollm2-135m)")
    p.add_argument("--backend", choices=["auto", "mlx", "onnx"], default="auto", help="backend for a local run")
    p.add_argument(
        "--backends",
        default=None,
        help="comma list of backends, one pipeline stage each, layers split evenly (e.g. mlx,onnx,mlx)",
    )
    p.add_argument("--nodes", default=None, help="run across node agents: HOST:PORT,HOST:PORT,...")
    p.add_argument("--local-nodes", type=int, default=0, metavar="N", help="start N node agents on loopback, run, stop them")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    model_s = "default: the model's recommendation, else"
    p.add_argument("--temperature", type=float, default=None, help=f"0 is greedy ({model_s} 0.7)")
    p.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling ({model_s} 1, off)")
    p.add_argument("--top-k", type=int, default=None, help=f"({model_s} 0, off)")
    p.add_argument("--repetition-penalty", type=float, default=None, help=f"({model_s} 1, off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backends.base import BackendError
    from exo_tui.commands._runtime import run_main
    from exo_tui.inference.generate import GenerationError
    from exo_tui.models.gguf_file import ModelFileError

    try:
        return run_main(lambda: _chat(args))
    except (ModelFileError, BackendError, GenerationError, ValueError, ConnectionError, OSError) as exc:
        from exo_tui.paths import storage_error

        message = storage_error(exc) if isinstance(exc, OSError) else None
        print(f"exo-tui chat: {message or exc}", file=sys.stderr)
        return 2


async def _chat(args: argparse.Namespace) -> int:
    from backends import default_backend_name
    from exo_tui.inference.generate import generate
    from exo_tui.inference.request import Request
    from exo_tui.inference.sampling import with_defaults
    from exo_tui.models.model import Model

    model = Model(args.model)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    prompt_ids = model.chat_prompt_ids(messages)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    request = Request(
        prompt_ids=prompt_ids,
        sampling=with_defaults(
            {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
             "repetition_penalty": args.repetition_penalty, "seed": seed},
            model.sampling,
        ),
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )

    if args.nodes or args.local_nodes:
        runner_cm = _cluster_runner(args)
    else:
        names = args.backends.split(",") if args.backends else [
            default_backend_name() if args.backend == "auto" else args.backend
        ]
        runner_cm = _local_runner(model, [n.strip() for n in names])

    pieces: list[str] = []
    finish = None
    async with runner_cm as runner:
        started = time.monotonic()
        request.created_s = started
        async for chunk in generate(runner, model.tokenizer, request, context_length=model.config.context_length):
            if chunk.text:
                pieces.append(chunk.text)
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            if chunk.finish_reason:
                finish = chunk.finish_reason
        served_by = runner.served_by()
    text = "".join(pieces)
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "finish_reason": finish,
                    "prompt_token_ids": request.prompt_ids,
                    "completion_token_ids": request.generated,
                    "prompt_tokens": len(request.prompt_ids),
                    "completion_tokens": len(request.generated),
                    "ttft_s": round(request.ttft_s, 4),
                    "tok_per_s": round(request.decode_tok_per_s, 2),
                    "served_by": list(served_by),
                    "seed": seed,
                    "sampling": request.sampling.to_dict(),
                }
            )
        )
    else:
        sys.stdout.write("\n")
        print(
            f"[{len(request.prompt_ids)} prompt + {len(request.generated)} tokens · "
            f"ttft {request.ttft_s * 1000:.0f} ms · {request.decode_tok_per_s:.1f} tok/s · "
            f"{' → '.join(served_by)}]",
            file=sys.stderr,
        )
    return 0


@contextlib.asynccontextmanager
async def _cluster_runner(args: argparse.Namespace):  # noqa: ANN201
    """A coordinator over the given nodes (or N local node processes), layers split evenly."""
    from exo_tui.cluster.coordinator import Coordinator

    coordinator = Coordinator(
        model=args.model,
        peers=[p.strip() for p in args.nodes.split(",")] if args.nodes else [],
        local_nodes=args.local_nodes,
        local_backends=[b.strip() for b in args.backends.split(",")] if args.backends else None,
        strategy="even",
        persist=False,
    )
    try:
        await coordinator.start()
        if coordinator.plan is None:
            raise ConnectionError("no node could join: see the errors above")
        yield coordinator.pipeline
    finally:
        await coordinator.stop()


@contextlib.asynccontextmanager
async def _local_runner(model, backend_names: list[str]):  # noqa: ANN001, ANN201
    """Load the shards for an in-process run and close them afterwards."""
    from backends import configure_backend
    from exo_tui.config import load_config
    from exo_tui.inference.local import LocalPipeline, even_split

    node = load_config().node
    for name in set(backend_names):  # the shards run here: this machine's node settings apply
        configure_backend(name, **node.backend_settings(name))
    pipeline = LocalPipeline()
    try:
        await pipeline.load(model.gguf, even_split(model.config.n_layers, backend_names))
        yield pipeline
    finally:
        await pipeline.close()
