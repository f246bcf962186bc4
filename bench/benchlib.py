"""Small helpers the Python benchmarks share."""


def emit_table(lines, md_path=None):
    """Prints a Markdown table (its lines) and, given `md_path`, writes it
    there too: the section bench/run.sh hands to bench/report.py."""
    table = "\n".join(lines)
    print(table)
    if md_path:
        with open(md_path, "w") as f:
            f.write(table + "\n")
