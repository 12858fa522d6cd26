#!/usr/bin/env python3
"""Turns the HTML of Debian's python3.11-doc into plain text for the fidelity model (docs/fidelity.md).

    apt-get install python3.11-doc
    /usr/bin/python3 bench/fidelity/prepare_data.py            # writes bench/fidelity/data/{train,heldout}.bin

Deterministic: files are read in sorted path order, every HELDOUT_EVERY-th page goes to the held-out split, the rest
to training. Each split is one UTF-8 byte stream, pages separated by a blank line. Only the page body
(<div role="main">) is kept, without scripts, styles or navigation. The outputs are git-ignored (bench/fidelity/data/)
and travel to the device inside the working tree; the training split is capped at MAX_TRAIN_BYTES (a prefix in the
same order), so the folder stays under 20 MB.
"""
import argparse
import html.parser
import os
import re
import sys

DEFAULT_HTML_DIR = "/usr/share/doc/python3.11/html"
DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
HELDOUT_EVERY = 10            # page i (sorted order) is held out when i % HELDOUT_EVERY == HELDOUT_EVERY - 1
MAX_TRAIN_BYTES = 16 << 20    # the data folder must stay small enough to carry to the device
MAX_HELDOUT_BYTES = 3 << 20
BLOCK_TAGS = {"p", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "pre", "tr", "br",
              "table", "ul", "ol", "dl", "blockquote", "hr"}
SKIPPED_TAGS = {"script", "style"}
VOID_TAGS = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source", "wbr"}


class MainTextExtractor(html.parser.HTMLParser):
    """Collects the text inside <div role="main"> (Sphinx's page body); block tags become line breaks."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.main_depth = 0   # div nesting inside the main div; 0 = outside
        self.skip_depth = 0   # inside <script>/<style>
        self.pre_depth = 0
        self.parts = []

    def handle_starttag(self, tag, attrs):
        if tag == "div":
            if self.main_depth:
                self.main_depth += 1
            elif dict(attrs).get("role") == "main":
                self.main_depth = 1
        if tag in SKIPPED_TAGS:
            self.skip_depth += 1
        if tag == "pre":
            self.pre_depth += 1
        if self.main_depth and tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_startendtag(self, tag, attrs):
        if self.main_depth and tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.main_depth and tag in BLOCK_TAGS:
            self.parts.append("\n")
        if tag == "div" and self.main_depth:
            self.main_depth -= 1
        if tag in SKIPPED_TAGS and self.skip_depth:
            self.skip_depth -= 1
        if tag == "pre" and self.pre_depth:
            self.pre_depth -= 1

    def handle_data(self, data):
        if not self.main_depth or self.skip_depth:
            return
        if self.pre_depth:
            self.parts.append(data)
        else:
            self.parts.append(re.sub(r"\s+", " ", data))

    def text(self):
        raw = "".join(self.parts).replace("\u00b6", "")  # Sphinx's pilcrow permalinks
        lines = [line.rstrip() for line in raw.split("\n")]
        text = "\n".join(lines)
        return re.sub(r"\n{3,}", "\n\n", text).strip()


def page_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        extractor = MainTextExtractor()
        extractor.feed(f.read())
        extractor.close()
    return extractor.text()


def html_files(root):
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs.sort()
        for name in files:
            if name.endswith(".html"):
                found.append(os.path.join(directory, name))
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--html-dir", default=DEFAULT_HTML_DIR)
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    files = html_files(args.html_dir)
    if not files:
        sys.exit(f"prepare_data: no .html files under {args.html_dir} (apt-get install python3.11-doc)")
    splits = {"train": bytearray(), "heldout": bytearray()}
    limits = {"train": MAX_TRAIN_BYTES, "heldout": MAX_HELDOUT_BYTES}
    pages = {"train": 0, "heldout": 0}
    for i, path in enumerate(files):
        split = "heldout" if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"
        text = page_text(path)
        if len(text) < 200:  # index stubs, redirects
            continue
        data = text.encode("utf-8") + b"\n\n"
        if len(splits[split]) + len(data) > limits[split]:
            continue
        splits[split] += data
        pages[split] += 1
    os.makedirs(args.out_dir, exist_ok=True)
    for split, data in splits.items():
        with open(os.path.join(args.out_dir, f"{split}.bin"), "wb") as f:
            f.write(data)
        print(f"prepare_data: {split}: {pages[split]} pages, {len(data)} bytes")


if __name__ == "__main__":
    main()
