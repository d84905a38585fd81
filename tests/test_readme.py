"""README.md renders as written: every section heading of the source is a heading once a CommonMark
parser (markdown-it-py, the parser of the test extra) has read it, so no heading is swallowed by a code
block that a fence left open (a closing ``` with text after it opens nothing and closes nothing)."""

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "benchmarks/README.md"]


def source_headings(text: str) -> list[str]:
    """The `#` headings as the author meant them: outside the code blocks that a line starting with ```
    opens and the next such line closes (whatever follows the backticks)."""
    headings, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            m = re.match(r"(#{1,6}) +(.+?) *#* *$", line)
            if m:
                headings.append(m.group(2))
    return headings


def rendered_headings(text: str) -> list[str]:
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    return [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_section_heading_renders_as_a_heading(doc):
    text = (ROOT / doc).read_text()
    written = source_headings(text)
    assert len(written) >= 2, f"{doc}: found no headings to check"
    rendered = rendered_headings(text)
    swallowed = [h for h in written if h not in rendered]
    assert not swallowed, f"{doc}: these headings render inside a code block (a fence left open above them?): {swallowed}"
    assert rendered == written


def test_an_unclosed_fence_is_caught():
    # The check itself: a closing fence with text after it leaves the block open on CommonMark.
    text = "# Title\n\n```bash\nrun\n``` trailing words\n\n## Next section\n"
    assert "Next section" in source_headings(text)
    assert "Next section" not in rendered_headings(text)
