"""Griffe extension for the API reference (used by mkdocs.yml only; the source is unchanged).

offrl's docstrings are plain text with Markdown code spans, rendered with
`docstring_style: null`.  Three of their conventions would render wrongly as
Markdown, so this rewrites them before rendering:

- a numpydoc-like section whose entries are `name : what it is` lines under
  an underlined heading (`Parameters` / `----------`) becomes a bold title
  and a bullet list, instead of one run-on paragraph;
- a subscript in prose (`results[policy][estimator]`) becomes a code span,
  instead of a Markdown reference link to a target that does not exist;
- reStructuredText's literal-block marker (a paragraph ending in `::` before
  an indented block) becomes a plain colon; the block is Markdown code already.

Lines inside code blocks (fenced, or indented by four spaces) are left alone.

Modules show exactly their `__all__` (`filters: public`).  Inside a class
it hides what a reader of the API has no use for: names starting with an
underscore (hooks, dunder methods; the constructor's signature is shown on
the class) and attributes without a docstring (hyper-parameters stored by
`__init__`, which the signature lists).  Properties and methods stay.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_UNDERLINE = re.compile(r"^-{3,}\s*$")
_NAME = r"[A-Za-z_*][\w*]*"
_ITEM = re.compile(rf"^(?P<names>{_NAME}(?:\s*,\s*{_NAME})*)\s+:\s*(?P<text>.*)$")
_SUBSCRIPT = re.compile(r"(?<![\w`.\]])([A-Za-z_][\w.]*(?:\[[^\[\]`\n]*\])+)")
_CODE_SPAN = re.compile(r"(`+[^`]*`+)")


def _section(title: str, lines: list[str], start: int) -> tuple[list[str], int]:
    """Markdown for the section whose entries begin at `lines[start]`, and the index after it."""
    out = [f"**{title}**", ""]
    items: list[str] = []
    i = start
    while i < len(lines):
        line = lines[i]
        match = _ITEM.match(line)
        if match:
            names = ", ".join(f"`{name.strip()}`" for name in match["names"].split(","))
            items.append(f"- {names}: {match['text'].strip()}".rstrip())
        elif line.startswith(" ") and line.strip() and items:
            items[-1] += " " + line.strip()
        elif not line.strip() and i + 1 < len(lines) and _ITEM.match(lines[i + 1]):
            pass  # a blank line between entries
        else:
            break
        i += 1
    if not items:  # not a list of `name : text` entries: keep the body as it is
        return out, start
    return out + items, i


def _next_is_code(lines: list[str], start: int) -> bool:
    """Whether the first non-blank line from `start` on is indented as a code block."""
    for line in lines[start:]:
        if line.strip():
            return line.startswith("    ")
    return False


def _inline(line: str) -> str:
    parts = _CODE_SPAN.split(line)
    return "".join(part if k % 2 else _SUBSCRIPT.sub(r"`\1`", part) for k, part in enumerate(parts))


def plain_to_markdown(text: str) -> str:
    """The Markdown that shows `text` (a cleaned docstring) as its author wrote it."""
    lines = text.splitlines()
    out: list[str] = []
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if fenced or line.startswith("    ") or line.lstrip().startswith(("```", "~~~")):
            out.append(line)
            i += 1
            continue
        if line.endswith("::") and _next_is_code(lines, i + 1):
            line = line[:-1]
        title = line.strip()
        if title and not line.startswith(" ") and i + 1 < len(lines) and _UNDERLINE.match(lines[i + 1]):
            section, i = _section(title, lines, i + 2)
            out += section
            continue
        out.append(_inline(line))
        i += 1
    return "\n".join(out)


def _convert(obj: Any) -> None:
    docstring = getattr(obj, "docstring", None)
    if docstring is not None:
        docstring.value = plain_to_markdown(docstring.value)
    parent = getattr(obj, "parent", None)
    if parent is not None and parent.is_class:
        undocumented_field = obj.is_attribute and "property" not in obj.labels and not obj.docstring
        if obj.name.startswith("_") or undocumented_field:
            obj.public = False


class OffrlDocs(griffe.Extension):
    """Rewrite every loaded object's docstring with `plain_to_markdown` and hide class-internal names."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[int] = set()

        def walk(obj: Any) -> None:
            if obj.is_alias or id(obj) in seen:
                return
            seen.add(id(obj))
            _convert(obj)
            for member in obj.members.values():
                walk(member)

        walk(pkg)
