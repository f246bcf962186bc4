#!/usr/bin/env python3
"""Function length limits of issue 28: no function in server/main.cc over 80
lines, none in server/ over 150. Prints each offender (file:line, name,
length) and exits 1 if there is one.

A function is an outermost brace block whose head (the text since the last
';', '{' or '}' at that depth) ends like a signature: ')' then optional
qualifiers, a trailing return type or a constructor's initializer list.
Blocks inside a function (lambdas, loops) count toward it. Comments, string
and character literals (raw strings too) are blanked before scanning.
"""

import os
import re
import sys

LIMITS = [("server/main.cc", 80), ("server/", 150)]
HEAD = re.compile(r"\)\s*(const|override|final|noexcept(\([^)]*\))?|mutable|->\s*[\w:<>,\s*&]+|"
                  r"ABSL_\w+(\([^)]*\))?|\s)*(:\s*[\s\S]*)?$")
NOT_FUNC = re.compile(r"\b(if|for|while|switch|catch|return|else|do)\s*\(?[^;{}]*$|=\s*[^;{}]*$")


def blank(src):
    """The source with comments and literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i)); i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j])); i = j
        elif c == "R" and src.startswith('R"', i) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', src[i:])
            if not m:
                out.append(c); i += 1; continue
            end = ")" + m.group(1) + '"'
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", src[i:j])); i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j = min(n, j + 1)
            out.append(re.sub(r"[^\n]", " ", src[i:j])); i = j
        else:
            out.append(c); i += 1
    return "".join(out)


def functions(path):
    """(first line, name, length in lines) of each outermost function body."""
    text = blank(open(path, encoding="utf-8", errors="replace").read())
    found, depth, in_func, start_depth, head_start = [], 0, False, 0, 0
    func_line, func_name = 0, ""
    for i, c in enumerate(text):
        if c == "{":
            head = text[head_start:i].strip()
            if not in_func and head and HEAD.search(head) and not NOT_FUNC.search(head.split("(")[0] + "("):
                in_func, start_depth = True, depth
                func_line = text.count("\n", 0, i) + 1
                m = re.search(r"([\w:~]+)\s*\(", head)
                func_name = m.group(1) if m else "?"
            depth += 1
            head_start = i + 1
        elif c == "}":
            depth -= 1
            head_start = i + 1
            if in_func and depth == start_depth:
                in_func = False
                end_line = text.count("\n", 0, i) + 1
                found.append((func_line, func_name, end_line - func_line + 1))
        elif c == ";":
            head_start = i + 1
    return found


def main(root):
    bad = 0
    for d, _, files in os.walk(os.path.join(root, "server")):
        for f in sorted(files):
            if not f.endswith((".cc", ".h")):
                continue
            path = os.path.join(d, f)
            rel = os.path.relpath(path, root)
            limit = next(l for prefix, l in LIMITS if rel.startswith(prefix))
            for line, name, length in functions(path):
                if length > limit:
                    print("%s:%d: %s is %d lines (limit %d)" % (rel, line, name, length, limit))
                    bad += 1
    if bad:
        print("%d function(s) over the limit (issue 28: main.cc 80, server/ 150)" % bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")))
