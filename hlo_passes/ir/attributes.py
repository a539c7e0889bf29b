"""Typed views of raw HLO attribute text: int lists, booleans, strings, pairs."""

from __future__ import annotations

import re

__all__ = [
    "parse_int_list", "format_int_list", "parse_bool", "parse_int", "parse_string",
    "parse_pairs", "format_pairs", "split_top_level",
]

_INT_RE = re.compile(r"-?\d+")


def parse_int_list(text: str) -> list[int]:
    """``"{0,1}"`` or ``"{}"`` -> ``[0, 1]`` / ``[]``."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"expected an integer list such as {{0,1}}, found {text!r}")
    return [int(x) for x in _INT_RE.findall(text)]


def format_int_list(values) -> str:
    """``[0, 1]`` -> ``"{0,1}"``."""
    return "{" + ",".join(str(int(v)) for v in values) + "}"


def parse_bool(text: str) -> bool:
    """``"true"``/``"false"`` -> bool."""
    if text == "true":
        return True
    if text == "false":
        return False
    raise ValueError(f"expected true or false, found {text!r}")


def parse_int(text: str) -> int:
    """``"3"`` -> 3."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, found {text!r}") from None


def parse_string(text: str) -> str:
    """``'"abc\\"d"'`` -> ``'abc"d'`` (C escapes undone); unquoted text is returned as is."""
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        body = text[1:-1]
        if "\\" in body:
            body = body.encode("latin-1", "backslashreplace").decode("unicode_escape")
        return body
    return text


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``"{{0,1},{1,2}}"`` -> ``[(0, 1), (1, 2)]`` (source_target_pairs)."""
    groups = parse_groups(text)
    if any(len(g) != 2 for g in groups):
        raise ValueError(f"expected pairs such as {{{{0,1}},{{1,2}}}}, found {text!r}")
    return [(g[0], g[1]) for g in groups]


def format_pairs(pairs) -> str:
    """``[(0, 1)]`` -> ``"{{0,1}}"``."""
    return "{" + ",".join(f"{{{int(a)},{int(b)}}}" for a, b in pairs) + "}"


def parse_groups(text: str) -> list[list[int]]:
    """``"{{0,1},{2,3}}"`` -> ``[[0, 1], [2, 3]]``; ``"{}"`` -> ``[]``."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"expected a list of groups such as {{{{0,1}},{{2,3}}}}, found {text!r}")
    inner = text[1:-1].strip()
    if not inner:
        return []
    groups = []
    for part in re.findall(r"\{([^{}]*)\}", inner):
        groups.append([int(x) for x in _INT_RE.findall(part)])
    if re.sub(r"\{[^{}]*\}", "", inner).replace(",", "").strip():
        raise ValueError(f"expected a list of groups, found {text!r}")
    return groups


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Splits on ``sep`` outside brackets and quotes, stripping each part."""
    parts, depth, start, quote = [], 0, 0, None
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
        i += 1
    tail = text[start:].strip()
    if tail or parts:
        parts.append(tail)
    return parts
