"""The `kvpool` command line: `kvpool bench manager ...` (more subcommands join as layers land)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool", description="kvpool: an LLM engine built around its KV cache")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks (each prints a table, and JSON with --json)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from kvpool.bench import manager

    manager.add_arguments(bsub.add_parser("manager", help="replay a trace through the cache manager alone"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench" and args.bench == "manager":
            from kvpool.bench import manager

            manager.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvpool: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
