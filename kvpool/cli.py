"""The `kvpool` command line: `generate` text with a model, `serve` the OpenAI-compatible API, and `bench`
the cache, its memory, the engine and a server."""

from __future__ import annotations

import argparse
import ctypes.util
import logging
import os
import sys
from typing import Any


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    from kvpool.core.eviction import policy_names
    from kvpool.core.host_pool import host_policy_names

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--kv-cache-memory", default="1GiB", help="KV cache size: bytes, or e.g. 2GiB, 512MiB")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    g.add_argument("--hash-algo", default="sha256", choices=["sha256", "xxh3_128"])
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--swap-space", default="0", help="host KV tier size (e.g. 4GiB); 0 disables it")
    g.add_argument("--eviction-policy", default="lru", choices=policy_names(),
                   help="device tier eviction policy (see kvpool bench policy)")
    g.add_argument("--host-eviction", default="lru", choices=host_policy_names(), help="host tier eviction policy")
    g.add_argument("--write-through", action="store_true",
                   help="copy every newly full block to the host tier, not only when evicted")
    g.add_argument("--state-retention-tokens", type=int, default=512,
                   help="state models: keep the state every this many prompt tokens (0: only at the end)")
    g.add_argument("--kv-store", default=None, metavar="URL",
                   help="store tier below the host tier: file:///dir or redis://host:port (needs --swap-space)")
    g.add_argument("--kv-store-deadline", type=float, default=2.0,
                   help="seconds a request waits for its store reads before computing the blocks itself")
    g.add_argument("--no-hybrid-allocator", action="store_true",
                   help="keep every layer's blocks as full attention does (the uniform allocator, to compare)")
    g.add_argument("--no-native-kernels", action="store_true",
                   help="decode attention through torch ops, not kvpool's compiled CPU kernel")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (see --lora-modules)")
    g.add_argument("--max-loras", type=int, default=1, help="LoRA adapters that run at once (in one batch)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank accepted")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return dict(model=a.model, dtype=a.dtype, device=a.device, kv_cache_memory=a.kv_cache_memory,
                block_size=a.block_size, enable_prefix_caching=not a.no_prefix_caching,
                hash_algo=a.hash_algo, max_num_batched_tokens=a.max_num_batched_tokens,
                max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, swap_space=a.swap_space,
                host_eviction=a.host_eviction, write_through=a.write_through, kv_store=a.kv_store,
                kv_store_deadline_s=a.kv_store_deadline, state_retention_tokens=a.state_retention_tokens,
                eviction_policy=a.eviction_policy,
                hybrid_allocator=not a.no_hybrid_allocator, native_kernels=not a.no_native_kernels,
                enable_lora=a.enable_lora or bool(getattr(a, "lora_modules", None)), max_loras=a.max_loras,
                max_lora_rank=a.max_lora_rank)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="kvpool: an LLM engine built around its KV cache")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = p.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for a prompt")
    gen.add_argument("prompt", nargs="+", help="the prompt (several: one completion each)")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_engine_arguments(gen)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (completions, chat, metrics)")
    from kvpool.server import options as serve_options

    serve_options.add_arguments(srv)
    add_engine_arguments(srv)

    from kvpool.router import cli as router_cli

    router_cli.add_arguments(sub.add_parser("router", help="a cache-aware OpenAI-compatible front door for N replicas"))

    sub.add_parser("build-kernels", help="compile kvpool's CPU kernels for this machine (else done at first use)")

    from kvpool.omni import cli as omni_cli

    omni_cli.add_arguments(sub.add_parser("omni", help="the thinker -> talker pipeline: text, then codes"))

    bench = sub.add_parser("bench", help="benchmarks (each prints a table, and JSON with --json)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from kvpool.bench import manager, memory, multiturn, policy, prefix

    manager.add_arguments(bsub.add_parser("manager", help="replay a trace through the cache manager alone"))
    policy.add_arguments(bsub.add_parser("policy", help="eviction policies vs the offline optimum"))
    memory.add_arguments(bsub.add_parser("memory", help="KV memory of hybrid models: uniform vs kvpool's allocator"))
    bp = bsub.add_parser("prefix", help="shared-prefix workload: kvpool with/without caching vs transformers")
    prefix.add_arguments(bp)
    add_engine_arguments(bp)
    bm = bsub.add_parser("multiturn", help="multi-turn chats: device-only vs device + host tier, and the ceiling")
    multiturn.add_arguments(bm)
    add_engine_arguments(bm)
    from kvpool.bench import serve as bench_serve

    bench_serve.add_arguments(bsub.add_parser("serve", help="load-test an OpenAI-compatible server on this machine"))

    from kvpool.bench import cluster as bench_cluster

    bench_cluster.add_arguments(bsub.add_parser("cluster", help="two replicas + router on loopback: routing policies"))

    from kvpool.bench import store as bench_store

    bench_store.add_arguments(bsub.add_parser("store", help="the store tier's backends: throughput, round trips"))

    from kvpool.bench import omni as bench_omni

    bench_omni.add_arguments(bsub.add_parser("omni", help="the two-stage pipeline with stage-output caching on/off"))
    return p


def cmd_generate(a: argparse.Namespace) -> None:
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                            seed=a.seed, stop=a.stop)
    llm = LLM(**engine_kwargs(a))
    chat = not a.raw and getattr(llm.tokenizer, "chat_template", None)
    if chat:
        outs = llm.chat([[{"role": "user", "content": q}] for q in a.prompt], params, use_tqdm=False)
    else:
        outs = llm.generate(a.prompt, params, use_tqdm=False)
    for q, o in zip(a.prompt, outs, strict=True):
        if len(a.prompt) > 1:
            print(f"### {q}")
        print(o.text)


def _preload_tcmalloc() -> None:
    """Restart this command with tcmalloc preloaded when the system has it (`KVPOOL_MALLOC=system` opts out).

    PyTorch on the CPU allocates and frees many large short-lived tensors per step; glibc's malloc hands
    them back to the kernel and faults them in again. tcmalloc keeps them: engine steps ran ~9% faster
    here (see docs/benchmarks.md). vLLM's CPU build asks its users for the same preload. It can only
    take effect at process start, hence the re-exec; `LLM` in a user's own process runs as it is.
    """
    if sys.platform != "linux" or os.environ.get("KVPOOL_MALLOC", "tcmalloc") != "tcmalloc":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        return  # already in place (or preloading it failed: ld.so warned and ignored it; don't loop)
    lib = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if lib is None:
        return
    env = dict(os.environ, LD_PRELOAD=f"{lib}:{preload}" if preload else lib)
    os.execve(sys.executable, [sys.executable, "-m", "kvpool.cli", *sys.argv[1:]], env)


def _tcmalloc_mapped() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "tcmalloc" in f.read()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        _preload_tcmalloc()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        allocator = "tcmalloc" if _tcmalloc_mapped() else "the system's malloc"
        logging.getLogger("kvpool.cli").debug("allocator: %s", allocator)
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "serve":
            from kvpool.server import serve

            serve.run(args, engine_kwargs(args))

        elif args.command == "router":
            from kvpool.router import app as router_app

            router_app.run(args)
        elif args.command == "build-kernels":
            from kvpool.runner import kernels

            print(kernels.build())
        elif args.command == "omni":
            from kvpool.omni import cli as omni_cli

            omni_cli.run(args)
        elif args.command == "bench" and args.bench == "cluster":
            from kvpool.bench import cluster as bench_cluster

            bench_cluster.run(args)
        elif args.command == "bench" and args.bench == "store":
            from kvpool.bench import store as bench_store

            bench_store.run(args)
        elif args.command == "bench" and args.bench == "omni":
            from kvpool.bench import omni as bench_omni

            bench_omni.run(args)
        elif args.command == "bench" and args.bench == "manager":
            from kvpool.bench import manager

            manager.run(args)
        elif args.command == "bench" and args.bench == "policy":
            from kvpool.bench import policy

            policy.run(args)
        elif args.command == "bench" and args.bench == "memory":
            from kvpool.bench import memory

            memory.run(args)
        elif args.command == "bench" and args.bench == "multiturn":
            from kvpool.bench import multiturn

            multiturn.run(args, engine_kwargs(args))
        elif args.command == "bench" and args.bench == "prefix":
            from kvpool.bench import prefix

            prefix.run(args, engine_kwargs(args))
        elif args.command == "bench" and args.bench == "serve":
            from kvpool.bench import serve as bench_serve

            bench_serve.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvpool: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
