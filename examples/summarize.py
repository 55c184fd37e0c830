"""Summarise a local text file, section by section, as a durable pgflow workflow.

Serve it with a worker, from the repository root:

    pgflow worker examples.summarize:app --concurrency 4

and start it from any process that reaches the same database:

    from examples.summarize import summarize
    handle = summarize.start("examples/data/crash-recovery.md")
    print(handle.result(timeout=60))

Each step's output is recorded when it returns. If the worker dies halfway, the next worker to
claim the workflow runs it again from the top, gets the recorded outputs back for the steps that
already finished, and runs only the rest. The "summary" is extractive and deterministic (sentences
scored by word frequency), so the example needs no network and no model.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections import Counter
from pathlib import Path

import msgspec

import pgflow

app = pgflow.App()  # $PGFLOW_DSN, or the embedded PostgreSQL under ./.pgflow

# Seconds each step pretends to work, so that examples/demo.py has progress to show. Set
# SUMMARIZE_DELAY=0 to see how fast the bookkeeping itself is.
DELAY = float(os.environ.get("SUMMARIZE_DELAY", "0.4"))


class Section(msgspec.Struct):
    title: str
    text: str


class Document(msgspec.Struct):
    title: str
    sections: list[Section]


class SectionSummary(msgspec.Struct):
    title: str
    words: int
    sentences: list[str]


class Summary(msgspec.Struct):
    title: str
    source: str
    words: int
    keywords: list[str]
    sections: list[SectionSummary]


# -- steps: their outputs are journaled -------------------------------------------------------------


@app.step(name="load_document", max_attempts=3, backoff=0.2, retry_on=(OSError,))
def load_document(path: str) -> Document:
    """Read a Markdown-ish file and split it at its ``## `` headings.

    A plain ``def``: the worker runs it in a thread. An ``OSError`` (a file share that hiccups)
    is retried up to three runs in all, with backoff; anything else fails the step at once.
    """
    time.sleep(DELAY / 2)
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    title = Path(path).stem
    sections: list[Section] = []
    body: list[str] = []
    heading: str | None = None

    def flush() -> None:
        text = " ".join(line.strip() for line in body if line.strip())
        if text:
            sections.append(Section(heading or title, text))
        body.clear()

    for line in lines:
        if line.startswith("# ") and not sections and heading is None:
            title = line[2:].strip()
        elif line.startswith("## "):
            flush()
            heading = line[3:].strip()
        else:
            body.append(line)
    flush()
    return Document(title, sections)


@app.step(name="summarize_section", max_attempts=2)
async def summarize_section(section: Section, sentences: int = 2) -> SectionSummary:
    """Keep the ``sentences`` sentences whose words are most frequent in the section.

    An ``async def``: it runs on the worker's event loop. In a real application this is where a
    call to a language model would go, which is exactly the kind of slow, costly work whose result
    you want recorded rather than paid for twice.
    """
    chosen = top_sentences(section.text, sentences)
    # Stream the summary word by word, as a language model would send its tokens. If this step ran
    # before and died halfway (its worker crashed), stream_offset says how many words that earlier
    # attempt already sent, and only the rest goes out: readers never see a word twice.
    tokens = " ".join(chosen).split()
    for token in tokens[pgflow.stream_offset("summary"):]:
        await asyncio.sleep(DELAY / 10)
        await pgflow.write_stream_async("summary", token + " ")
    return SectionSummary(section.title, len(section.text.split()), chosen)


# -- the workflow: ordinary code between steps, deterministic given the steps' outputs --------------


@app.workflow(name="summarize")
async def summarize(path: str, sentences_per_section: int = 2) -> Summary:
    document = await load_document(path)
    summaries = []
    for section in document.sections:
        # Written from the workflow body: a replay after a crash skips what was already committed.
        await pgflow.write_stream_async("summary", f"\n\n## {section.title}\n")
        summaries.append(await summarize_section(section, sentences_per_section))
    await pgflow.close_stream_async("summary")
    all_words = [w for section in document.sections for w in words(section.text)]
    return Summary(
        title=document.title,
        source=path,
        words=sum(s.words for s in summaries),
        keywords=keywords(all_words, 6),
        sections=summaries,
    )


# -- plain helpers ----------------------------------------------------------------------------------

STOPWORDS = frozenset(
    """a about after all also an and any are as at be because been before being both but by can could
    did do does each every for from had has have how if in into is it its itself may more most much
    must neither no nor not of on once one only or other our so some such than that the their them
    then there therefore these they this those through to too until up very was we were what when
    where whether which while who whose why will with without would yet""".split()
)


def words(text: str) -> list[str]:
    """The content words of ``text``: lowercase, without stop words and very short words."""
    return [w for w in re.findall(r"[a-z][a-z'-]*", text.lower()) if len(w) > 2 and w not in STOPWORDS]


def split_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def top_sentences(text: str, count: int) -> list[str]:
    """The ``count`` best-scoring sentences, in their original order.

    A sentence scores the summed frequency of its content words, divided by the square root of
    their number, so that neither very long nor very short sentences win by length alone.
    """
    frequency = Counter(words(text))
    candidates = split_sentences(text)

    def score(index: int) -> tuple[float, int]:
        content = words(candidates[index])
        value = sum(frequency[w] for w in content) / math.sqrt(len(content)) if content else 0.0
        return (-value, index)  # ties go to the earlier sentence

    chosen = sorted(sorted(range(len(candidates)), key=score)[:count])
    return [candidates[i] for i in chosen]


def keywords(all_words: list[str], count: int) -> list[str]:
    """The most frequent content words, ties broken alphabetically."""
    return [w for w, _ in sorted(Counter(all_words).items(), key=lambda item: (-item[1], item[0]))[:count]]
