"""The `specgate` command line: one subcommand per job, each delegating to the module that owns it."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specgate", description="Tree speculative decoding gateway")
    sub = parser.add_subparsers(dest="command", required=True)

    from gateway import serve_cmd
    serve_cmd.add_arguments(sub.add_parser("serve", help="serve the OpenAI-compatible REST (and gRPC) API, one process"))

    from gateway import generate_cmd
    generate_cmd.add_arguments(sub.add_parser("generate", help="generate completions for a JSONL file of prompts"))

    model = sub.add_parser("model", help="model cache commands").add_subparsers(dest="model_command", required=True)
    from workers.loader import add_model_path_arguments
    add_model_path_arguments(model.add_parser("path", help="print the cached model directory (fetching it if needed)"))

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from loadtest import bench_engine
    bench_engine.add_arguments(bench.add_parser("engine", help="specgate vs transformers on one workload"))
    from loadtest import bench_drafters
    bench_drafters.add_arguments(bench.add_parser(
        "drafters", help="tokens per step of several drafters (and their merges) on one mixed workload"))
    from loadtest import bench_gateway
    bench_gateway.add_arguments(bench.add_parser(
        "gateway", help="added latency and requests/s of the HTTP gateway over the step loop (fake worker)"))
    from scheduler import bench_profile
    bench_profile.add_arguments(bench.add_parser(
        "profile", help="measure step time vs batch size and tree tokens on the real verifier"))
    from scheduler import bench_plan
    bench_plan.add_arguments(bench.add_parser("plan", help="time one scheduling decision with many queued requests"))
    from loadtest import bench_ray
    bench_ray.add_arguments(bench.add_parser(
        "ray", help="tokens/s of the Ray Serve deployment vs the embedded gateway, and its step overhead"))

    from loadtest import loadgen
    loadgen.add_arguments(sub.add_parser(
        "loadtest", help="open-loop multi-tenant load against a running gateway "
                         "(`specgate loadtest compare --help`: one server per policy)"))
    from loadtest import soak
    soak.add_arguments(sub.add_parser("soak", help="mixed load for N minutes: RSS, fds, Redis memory, latency drift"))

    from scheduler import sim
    sim.add_arguments(sub.add_parser("sim", help="discrete-event simulation of the scheduling policies"))

    from scheduler import plan_cmd
    plan_cmd.add_arguments(sub.add_parser(
        "plan", help="the throughput model's predicted speed-up per drafter x tree shape x batch x context"))

    draft = sub.add_parser("draft", help="draft model commands").add_subparsers(dest="draft_command", required=True)
    from workers import draft_build
    draft_build.add_arguments(draft.add_parser(
        "build", help="prune a SPIRe-style draft from the target (a few blocks, sink + window attention)"))
    from workers import distill
    distill.add_arguments(sub.add_parser("distill", help="train a draft against the target on the target's own text"))
    return parser


def build_loadtest_compare_parser() -> argparse.ArgumentParser:
    """`specgate loadtest compare`: its own parser, since `specgate loadtest` itself takes --url."""
    from loadtest import compare
    parser = argparse.ArgumentParser(prog="specgate loadtest compare",
                                     description="the same open-loop load against one server per policy")
    compare.add_arguments(parser)
    parser.set_defaults(command="loadtest-compare")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["loadtest", "compare"]:
        args = build_loadtest_compare_parser().parse_args(argv[2:])
    else:
        args = build_parser().parse_args(argv)
    from workers.loader import ModelLoadError
    try:
        return int(_dispatch(args) or 0)
    except (ValueError, FileNotFoundError, ModelLoadError) as exc:
        print(f"specgate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from gateway import serve_cmd
        return serve_cmd.run(args)
    if args.command == "generate":
        from gateway import generate_cmd
        return generate_cmd.run(args)
    if args.command == "model":
        from workers.loader import model_path_cli
        return model_path_cli(args)
    if args.command == "bench" and args.bench_command == "engine":
        from loadtest import bench_engine
        return bench_engine.run(args)
    if args.command == "bench" and args.bench_command == "drafters":
        from loadtest import bench_drafters
        return bench_drafters.run(args)
    if args.command == "bench" and args.bench_command == "gateway":
        from loadtest import bench_gateway
        return bench_gateway.run(args)
    if args.command == "bench" and args.bench_command == "profile":
        from scheduler import bench_profile
        return bench_profile.run(args)
    if args.command == "bench" and args.bench_command == "ray":
        from loadtest import bench_ray
        return bench_ray.run(args)
    if args.command == "bench" and args.bench_command == "plan":
        from scheduler import bench_plan
        return bench_plan.run(args)
    if args.command == "loadtest":
        from loadtest import loadgen
        return loadgen.run(args)
    if args.command == "loadtest-compare":
        from loadtest import compare
        return compare.run(args)
    if args.command == "soak":
        from loadtest import soak
        return soak.run(args)
    if args.command == "sim":
        from scheduler import sim
        return sim.run(args)
    if args.command == "plan":
        from scheduler import plan_cmd
        return plan_cmd.run(args)
    if args.command == "draft" and args.draft_command == "build":
        from workers import draft_build
        return draft_build.run(args)
    if args.command == "distill":
        from workers import distill
        return distill.run(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
