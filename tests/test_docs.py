"""What a person who clones the project reads speaks of the software: no numbers of the
project's own issue tracker ("issue 16") in user-facing text or code, and no references
to notes outside the repository."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACES = ("megatron_grpo", "bridge", "tools", "configs", "examples", "scripts", "docs",
          "README.md")
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".txt")
TRACKER = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)
OUTSIDE = re.compile(r"\.\./shared|\bDESIGN\.md\b|\bSTYLE\.md\b")


def _files():
    for place in PLACES:
        path = os.path.join(ROOT, place)
        if os.path.isfile(path):
            yield path
            continue
        for folder, _, names in os.walk(path):
            for name in names:
                if name.endswith(SUFFIXES):
                    yield os.path.join(folder, name)


def test_no_tracker_numbers_and_no_notes_outside_the_repository():
    found = []
    for path in _files():
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if TRACKER.search(line) or OUTSIDE.search(line):
                    found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
