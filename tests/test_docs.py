"""The documentation, run as a reader runs it: every marked block of the tutorial and the how-to guides, in
the order of its page, against a real server (the ``dsn`` and ``schema`` fixtures), each command a real
process in a directory of the page's own.

A block is marked by an HTML comment just before it, which the rendered page does not show:

- ``<!-- test: file NAME -->``: the block is saved as NAME in the page's directory;
- ``<!-- test: run -->``: the Python block runs as a script there (``python _block_N.py``), and must exit 0;
- ``<!-- test: shell [pid=P] [id=P] [after=P] [exit=N] -->``: the shell block runs in bash (``-e``), its
  ``<PID>`` being the process id of the background process P, its ``<ID>`` the first workflow id P printed,
  after P has printed a few words (``after=``); it must exit N (default 0);
- ``<!-- test: background NAME -->``: the block's one command starts in the background, as NAME;
- ``<!-- test: output [NAME] -->``: every line of the text block is in the output of NAME, once it has
  exited (or of the last command run): whitespace runs match any whitespace, ``...`` matches anything;
- ``<!-- test: interrupt NAME -->`` (no block): SIGINT to NAME, which must then exit 0;
- ``<!-- test: skip (why) -->``: the block is not run, for the reason given.

In the tutorial every block but the output shown is marked (each command it gives runs); the guides mark the
blocks that stand alone. The commands find ``pgflow`` and ``python`` in this interpreter's environment, and
the server through ``PGFLOW_DSN`` / ``PGFLOW_SCHEMA`` (``PGFLOW_TEST_DSN`` for the pytest plugin)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .helpers import ONE_SERVER

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["tutorial.md", *sorted(str(p.relative_to(DOCS)) for p in (DOCS / "guides").glob("*.md"))]
TIMEOUT = 120.0  # seconds any one command or background process may take
MARK = re.compile(r"<!--\s*test:\s*(?P<what>\w+)\s*(?P<args>[^>]*?)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)\s*$",
                   re.S | re.M)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass
class Block:
    line: int
    info: str  # the fence's info string: python, sh, text, ...
    body: str
    mark: str | None = None  # what the comment before it says to do, None: not marked
    args: dict[str, str] = field(default_factory=dict)
    name: str | None = None  # file NAME, background NAME, output NAME, interrupt NAME


def blocks(page: str) -> list[Block]:
    """The page's fenced blocks and its marks, in order; a mark applies to the fence that follows it
    (``interrupt`` stands alone, as a block with no body)."""
    text = (DOCS / page).read_text(encoding="utf-8")
    found: list[Block] = []
    pending: tuple[str, str, int] | None = None
    events = sorted([(m.start(), "mark", m) for m in MARK.finditer(text)]
                    + [(m.start(), "fence", m) for m in FENCE.finditer(text)], key=lambda e: e[0])
    for start, kind, match in events:
        line = text.count("\n", 0, start) + 1
        if kind == "mark":
            what, args = match.group("what"), match.group("args")
            if what == "interrupt":
                found.append(_marked(Block(line, "", ""), what, args))
            else:
                assert pending is None, f"{page}:{pending and pending[2]}: a mark with no block after it"
                pending = (what, args, line)
            continue
        block = Block(line, match.group("info").strip().split(" ")[0], _dedent(match.group("body"),
                                                                               match.group("indent")))
        if pending is not None:
            block = _marked(block, pending[0], pending[1])
            pending = None
        found.append(block)
    assert pending is None, f"{page}:{pending and pending[2]}: a mark with no block after it"
    return found


def _dedent(body: str, indent: str) -> str:
    return "".join(line[len(indent):] if line.startswith(indent) else line for line in body.splitlines(True))


def _marked(block: Block, what: str, args: str) -> Block:
    block.mark = what
    if what == "skip":
        assert args.startswith("("), f"line {block.line}: a skip says why, in parentheses"
        return block
    for word in shlex.split(args):
        if "=" in word:
            key, value = word.split("=", 1)
            block.args[key] = value
        else:
            block.name = word
    return block


class Reader:
    """Follows one page: its directory, environment, background processes and the last output."""

    def __init__(self, page: str, directory: Path, dsn: str, schema: str) -> None:
        self.page = page
        self.dir = directory
        bin_dir = str(Path(sys.executable).parent)
        self.env = {key: value for key, value in os.environ.items()
                    if not key.startswith(("PGFLOW_", "PYTEST_", "VIRTUAL_ENV"))}
        self.env.update(PGFLOW_DSN=dsn, PGFLOW_SCHEMA=schema, PGFLOW_TEST_DSN=dsn,
                        PGFLOW_HOME=str(directory / ".pgflow-unused"), PATH=bin_dir + os.pathsep + self.env["PATH"],
                        VIRTUAL_ENV=str(Path(sys.executable).parent.parent), NO_COLOR="1", COLUMNS="200")
        self.background: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self.last_output = ""
        self.count = 0

    def where(self, block: Block) -> str:
        return f"docs/{self.page}:{block.line}"

    def output_of(self, name: str) -> str:
        return self.background[name][1].read_text(encoding="utf-8", errors="replace")

    def wait_exit(self, name: str) -> int:
        process = self.background[name][0]
        try:
            return process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not exit within {TIMEOUT} s:\n{self.output_of(name)}") from None

    def do(self, block: Block) -> None:
        if block.mark in (None, "skip"):
            return
        handler = getattr(self, f"_{block.mark}", None)
        assert handler is not None, f"{self.where(block)}: unknown mark {block.mark!r}"
        handler(block)

    def _file(self, block: Block) -> None:
        assert block.name, f"{self.where(block)}: file needs a NAME"
        path = self.dir / block.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.body, encoding="utf-8")

    def _run(self, block: Block) -> None:
        assert block.info in ("python", "py"), f"{self.where(block)}: run is for Python blocks"
        self.count += 1
        script = self.dir / f"_block_{self.count}.py"
        script.write_text(block.body, encoding="utf-8")
        self._foreground(block, [sys.executable, script.name])

    def _shell(self, block: Block) -> None:
        body = block.body
        if "after" in block.args:
            self._wait_for_words(block.args["after"])
        if "pid" in block.args:
            body = body.replace("<PID>", str(self.background[block.args["pid"]][0].pid))
        if "id" in block.args:
            found = UUID.search(self.output_of(block.args["id"]))
            assert found, f"{self.where(block)}: {block.args['id']} printed no workflow id"
            body = body.replace("<ID>", found.group(0))
        self._foreground(block, ["bash", "-e", "-c", body], expect=int(block.args.get("exit", "0")))

    def _foreground(self, block: Block, command: list[str], expect: int = 0) -> None:
        try:
            done = subprocess.run(command, cwd=self.dir, env=self.env, capture_output=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{self.where(block)}: still running after {TIMEOUT} s: {command}\n"
                                 f"{exc.stdout!r}\n{exc.stderr!r}") from None
        self.last_output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        assert done.returncode == expect, (f"{self.where(block)}: exit {done.returncode}, expected {expect}:\n"
                                           f"{block.body}\n--- output:\n{self.last_output}")

    def _background(self, block: Block) -> None:
        assert block.name and block.name not in self.background, f"{self.where(block)}: background needs a new NAME"
        [command] = [line for line in block.body.splitlines() if line.strip() and not line.startswith("#")]
        log = self.dir / f"_{block.name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(shlex.split(command), cwd=self.dir, env=self.env, stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.background[block.name] = (process, log)
        if command.split()[:2] == ["pgflow", "worker"]:
            self._wait_for(block.name, "started:", block)

    def _wait_for(self, name: str, text: str, block: Block) -> None:
        deadline = time.monotonic() + TIMEOUT
        while text not in self.output_of(name):
            process = self.background[name][0]
            assert process.poll() is None, f"{self.where(block)}: {name} exited:\n{self.output_of(name)}"
            assert time.monotonic() < deadline, f"{self.where(block)}: no {text!r} from {name}:\n{self.output_of(name)}"
            time.sleep(0.1)

    def _wait_for_words(self, name: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while len(self.output_of(name).split("\n", 1)[-1].split()) < 4:
            assert time.monotonic() < deadline, f"{name} printed too little:\n{self.output_of(name)}"
            time.sleep(0.1)

    def _output(self, block: Block) -> None:
        if block.name:
            code = self.wait_exit(block.name)
            output = self.output_of(block.name)
            assert code == 0, f"{self.where(block)}: {block.name} exited {code}:\n{output}"
        else:
            output = self.last_output
        for expected in filter(str.strip, block.body.splitlines()):
            pattern = r"\s+".join(".*".join(map(re.escape, token.split("..."))) for token in expected.split())
            assert re.search(pattern, output), f"{self.where(block)}: not in the output: {expected!r}\n{output}"

    def _interrupt(self, block: Block) -> None:
        assert block.name in self.background, f"{self.where(block)}: no background process {block.name!r}"
        self.background[block.name][0].send_signal(signal.SIGINT)
        code = self.wait_exit(block.name)
        assert code == 0, f"{self.where(block)}: {block.name} exited {code}:\n{self.output_of(block.name)}"

    def close(self) -> None:
        for process, _ in self.background.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_every_page_names_real_marks() -> None:
    """Without a server: each page parses, every mark is one the reader knows, and the tutorial marks every
    block it gives to run (the blocks left unmarked are the output it shows)."""
    known = {"file", "run", "shell", "background", "output", "interrupt", "skip"}
    marked = 0
    for page in PAGES:
        for block in blocks(page):
            assert block.mark in known | {None}, f"docs/{page}:{block.line}: unknown mark {block.mark!r}"
            marked += block.mark not in (None, "skip")
            if page == "tutorial.md" and block.mark is None:
                assert block.info == "text", f"docs/{page}:{block.line}: a tutorial block that does not run"
    assert marked >= 20, f"only {marked} marked blocks in the tutorial and guides"


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md"])
def test_the_pages_outside_the_site_link_to_files_that_exist(page: str) -> None:
    """``make docs`` checks the site's links; these pages are read on the repository's host, where a relative
    link (a doc page, a plot, a result file) must name a file of the tree."""
    path = DOCS.parent / page
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8"))
    local = [t.split("#")[0] for t in targets if "://" not in t and not t.startswith(("#", "mailto:"))]
    missing = [t for t in local if t and not (path.parent / t).exists()]
    assert local, f"{page} links to nothing in the tree"
    assert missing == [], f"{page} links to files that do not exist: {missing}"


def test_the_changelog_names_every_migration() -> None:
    """CHANGELOG.md lists the migrations, one line each: a new one gets its line."""
    changelog = (DOCS.parent / "CHANGELOG.md").read_text(encoding="utf-8")
    sql = DOCS.parent / "pgflow" / "_core" / "engine" / "sql"
    missing = [path.stem for path in sorted(sql.glob("*.sql")) if f"`{path.stem}`" not in changelog]
    assert missing == [], f"migrations without their line in CHANGELOG.md's Migrations: {missing}"


@ONE_SERVER  # the docs as a reader runs them: what they call is tested on both servers by its own tests
@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_as_written(page: str, dsn: str, schema: str, tmp_path: Path) -> None:
    page_blocks = blocks(page)
    if not any(b.mark not in (None, "skip") for b in page_blocks):
        pytest.skip(f"docs/{page} marks no block to run")
    reader = Reader(page, tmp_path, dsn, schema)
    try:
        for block in page_blocks:
            reader.do(block)
    finally:
        reader.close()
