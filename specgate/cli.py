"""The `specgate` command line: a table of subcommands, each delegating to the module that owns it.

Every module named here offers `add_arguments(parser)` and `run(args) -> int` (or the functions a
row names); the parser and
the dispatch are both built from `COMMANDS`, so a command is added in one place. The CLI sits at
the top of the import graph (it imports the serving packages, the tools and the load tester;
nothing imports it), and imports a command's module only when that command runs or its parser
is built.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]     # ("bench", "engine") is `specgate bench engine`
    module: str
    help: str
    add: str = "add_arguments"  # the module's functions: add(parser), run(args) -> exit code
    run: str = "run"


COMMANDS: tuple[Command, ...] = (
    Command(("serve",), "gateway.cli.serve",
            "serve the OpenAI-compatible REST (and gRPC) API, one process"),
    Command(("generate",), "tools.generate", "generate completions for a JSONL file of prompts"),
    Command(("model", "path"), "workers.model.loader",
            "print the cached model directory (fetching it if needed)",
            add="add_model_path_arguments", run="model_path_cli"),
    Command(("bench", "engine"), "tools.bench_engine", "specgate vs transformers on one workload"),
    Command(("bench", "drafters"), "tools.bench_drafters",
            "tokens per step of several drafters (and their merges) on one mixed workload"),
    Command(("bench", "gateway"), "tools.bench_gateway",
            "added latency and requests/s of the HTTP gateway over the step loop (fake worker)"),
    Command(("bench", "front"), "tools.bench_front",
            "does one client's 2 MB prompt stall /health and other tenants? (real model)"),
    Command(("bench", "refusals"), "tools.bench_refusals",
            "CPU per refused request (rpm, concurrency, tpm; gRPC rpm) and the loop's lag, "
            "early refusals on/off"),
    Command(("bench", "stall"), "tools.bench_stall",
            "do running streams stall while a long prompt is prefilled? chunked vs whole (real model)"),
    Command(("bench", "kv"), "tools.bench_kv",
            "many requests without max_tokens under a KV budget: RSS, waits, preemptions (real model)"),
    Command(("bench", "lengths"), "tools.bench_lengths",
            "length predictor on the target's hidden states vs tenant records, offline"),
    Command(("bench", "profile"), "tools.bench_profile",
            "measure step time vs batch size and tree tokens on the real verifier"),
    Command(("bench", "plan"), "tools.bench_plan",
            "time one scheduling decision with many queued requests"),
    Command(("bench", "scheduler"), "tools.bench_scheduler",
            "plan + update per step vs waiting and running requests over many KV homes (no model)"),
    Command(("bench", "ray"), "tools.bench_ray",
            "tokens/s of the Ray Serve deployment vs the embedded gateway, and its step overhead"),
    Command(("bench", "structured"), "tools.bench_structured",
            "JSON-schema outputs: validity, exactness and tokens/s of grammar, n-gram and merged drafts vs plain"),
    Command(("bench", "grammar-engines"), "tools.bench_grammar_engines",
            "per-token mask cost of xgrammar vs llguidance on the default tokenizer"),
    Command(("bench", "resume"), "tools.bench_resume",
            "kill -9 the gateway mid-stream, restart it, resume: is the text whole and each event once?"),
    Command(("loadtest",), "loadtest.loadgen",
            "open-loop multi-tenant load against a running gateway "
            "(`specgate loadtest compare --help`: one server per policy)"),
    Command(("loadtest", "compare"), "loadtest.compare",
            "the same open-loop load against one server per policy"),
    Command(("loadtest", "hostile"), "loadtest.hostile",
            "an adversarial load test: one tenant attacks in 7 patterns beside another's steady chat"),
    Command(("soak",), "loadtest.soak",
            "mixed load for N minutes: RSS, fds, Redis memory, latency drift"),
    Command(("sim",), "tools.sim", "discrete-event simulation of the scheduling policies"),
    Command(("plan",), "tools.plan_cmd",
            "the throughput model's predicted speed-up per drafter x tree shape x batch x context"),
    Command(("draft", "build"), "tools.draft_build",
            "prune a SPIRe-style draft from the target (a few blocks, sink + window attention)"),
    Command(("draft", "train"), "tools.spire_train",
            "train a draft SPIRe's way: mixed loss, k-step training, feedback memory over the target's activations"),
    Command(("draft", "head"), "tools.draft_head",
            "restrict a draft's unembedding to the target's most frequent tokens (FR-Spec): a cheaper draft"),
    Command(("distill",), "tools.distill",
            "train a draft against the target on the target's own text"),
    Command(("docs",), "specgate.docs",
            "write docs/benchmarks.md from results/*.json and docs/cli.md from these commands"),
)

_GROUPS = {"model": "model cache commands", "bench": "benchmarks", "draft": "draft model commands"}


def _module(cmd: Command) -> ModuleType:
    return importlib.import_module(cmd.module)


def _under_a_command(cmd: Command) -> bool:
    """Whether the row's first word is itself a command (`loadtest compare` beside `loadtest`,
    which takes --url): such a row gets a parser of its own."""
    return len(cmd.words) > 1 and any(c.words == cmd.words[:1] for c in COMMANDS)


def _standalone(argv: list[str]) -> Command | None:
    return next((c for c in COMMANDS
                 if _under_a_command(c) and argv[:len(c.words)] == list(c.words)), None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specgate", description="Tree speculative decoding gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for i, cmd in enumerate(COMMANDS):
        if len(cmd.words) == 1:
            p = sub.add_parser(cmd.words[0], help=cmd.help)
        elif _under_a_command(cmd):
            continue                                  # parsed on its own (`_standalone`)
        else:
            group = cmd.words[0]
            if group not in groups:
                groups[group] = sub.add_parser(group, help=_GROUPS[group]).add_subparsers(
                    dest=f"{group}_command", required=True)
            p = groups[group].add_parser(cmd.words[1], help=cmd.help)
        getattr(_module(cmd), cmd.add)(p)
        p.set_defaults(command_index=i)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    cmd = _standalone(argv)
    if cmd is None:
        return build_parser().parse_args(argv)
    parser = argparse.ArgumentParser(prog="specgate " + " ".join(cmd.words), description=cmd.help)
    getattr(_module(cmd), cmd.add)(parser)
    parser.set_defaults(command_index=COMMANDS.index(cmd))
    return parser.parse_args(argv[len(cmd.words):])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    from workers.model.loader import ModelLoadError
    try:
        cmd = COMMANDS[args.command_index]
        return int(getattr(_module(cmd), cmd.run)(args) or 0)
    except (ValueError, FileNotFoundError, ModelLoadError) as exc:
        print(f"specgate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
