#!/usr/bin/env python3
"""bench/report.py puts every section into bench/results.md (issue 30, goal 10).

    /usr/bin/python3 tests/python/check_bench_report.py

Runs no benchmark and needs no build: it feeds report.py temporary --out
directories (never bench/out/ or bench/results.md) and checks that
* with every section's files, every section is printed, in SECTIONS order,
  and report.py exits 0;
* a needed file missing, empty or unreadable makes report.py exit 1, naming
  the section and the bench that should have written it, while the section's
  heading still says it is missing;
* a bench's "skipped: <reason>" section is printed as skipped, and the exit
  status stays 0;
* a file in --out that no section reads makes it exit 1;
* bench/run.sh writes exactly the files that SECTIONS needs or reads.

Not collected by pytest (the name): registered with ctest in
tests/python/CMakeLists.txt as `bench_report`.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT = os.path.join(REPO, "bench", "report.py")
RUN_SH = os.path.join(REPO, "bench", "run.sh")

TIMES = {"p50_us": 25.0, "p99_us": 40.0}
# The smallest results each JSON-built section can be made from.
FIXTURES = {
    "compile.json": {"benchmarks": []},
    "exec.json": {"benchmarks": []},
    "fairness.json": {"timeout_ms": 5000, "idle_median_ms": 12.0,
                      "modes": [{"name": "long lane", "samples": 3, "median_ms": 14.0,
                                 "worst_ms": 20.0}]},
    "call.json": {"config": {}, "call_overhead": [], "data_path": [], "machine": {},
                  "total_s": 1, "crash_recovery": {"samples": 3, "median_ms": 15.0,
                                                   "max_ms": 17.0}},
    "py.json": {
        "torch_compile": {"cold_s": {"median": 10.0}, "opjit_daemon_cold_ms": {"median": 50}},
        "autograd": {"sizes": []},
        "fast_path": {
            "tiny": {"opjit_fast": TIMES, "opjit_grpc": TIMES, "socketpair_pingpong": TIMES},
            "shm": {label: {"fast": dict(TIMES, kernel_p50_us=20.0), "grpc": TIMES}
                    for label in ("1MiB", "64MiB")}}},
}


def sections():
    out = subprocess.run([sys.executable, "-B", REPORT, "--list"], check=True,
                         capture_output=True, text=True, timeout=30).stdout
    return json.loads(out)


def headings(markdown):
    return [line[3:] for line in markdown.splitlines() if line.startswith("## ")]


def section_text(markdown, title):
    """The lines of one "## " section."""
    lines = markdown.splitlines()
    start = lines.index("## " + title)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
               len(lines))
    return "\n".join(lines[start:end])


class ReportTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sections = sections()
        cls.titles = [s["title"] for s in cls.sections]

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="opjit-bench-report-")
        self.out = self._tmp.name
        for sec in self.sections:
            for name in sec["needs"] + sec["reads"]:
                path = os.path.join(self.out, name)
                if os.path.exists(path):
                    continue
                with open(path, "w") as f:
                    if name.endswith(".json"):
                        json.dump(FIXTURES.get(name, {}), f)
                    else:
                        f.write(f"| {name} | table |\n|---|---|\n| MARK-{name} | 1 |\n")

    def tearDown(self):
        self._tmp.cleanup()

    def write(self, name, text):
        with open(os.path.join(self.out, name), "w") as f:
            f.write(text)

    def report(self):
        p = subprocess.run([sys.executable, "-B", REPORT, "--out", self.out], cwd=self.out,
                           capture_output=True, text=True, timeout=30)
        return p.returncode, p.stdout, p.stderr

    def test_every_section_in_order(self):
        rc, out, err = self.report()
        self.assertEqual(rc, 0, err)
        self.assertEqual(headings(out), self.titles + ["Failures"])
        self.assertNotIn("Missing", out)
        self.assertNotIn("Skipped", out)
        for sec in self.sections:
            for name in sec["needs"]:
                if name.endswith(".md"):
                    self.assertIn(f"MARK-{name}", section_text(out, sec["title"]))

    def test_fast_path_section_has_cpp_and_python_tables(self):
        fast = next(s for s in self.sections if s["key"] == "fast")
        self.assertIn("fast.md", fast["needs"])
        self.write("fast.md", "### Fast path (C++ client), 2 cores\n\n| tiny | 1.4 |\n")
        rc, out, err = self.report()
        self.assertEqual(rc, 0, err)
        text = section_text(out, fast["title"])
        self.assertIn("### Fast path (C++ client), 2 cores", text)
        self.assertIn("### Fast path (Python client)", text)
        self.assertIn("socketpair ping-pong 25.0 µs", text)

    def test_prepared_python_rows_when_py_bench_has_them(self):
        py = json.loads(json.dumps(FIXTURES["py.json"]))
        py["fast_path"]["tiny"]["opjit_fast_pure"] = TIMES
        py["fast_path"]["prepared"] = {
            "opjit_prepared": {"p50_us": 1.6, "p99_us": 9.0},
            "opjit_prepared_pure": {"p50_us": 9.5, "p99_us": 30.0},
            "opjit_op_shm": TIMES, "opjit_op_shm_pure": TIMES,
            "torch_library_op": {"p50_us": 2.0, "p99_us": 4.0},
            "torch_autograd_function": {"p50_us": 3.0, "p99_us": 5.0}}
        self.write("py.json", json.dumps(py))
        rc, out, err = self.report()
        self.assertEqual(rc, 0, err)
        self.assertIn("| `Op.prepare`'d call, input in shm | 1.6 µs | 9.5 µs | 2.0 µs | 3.0 µs "
                      "| 0.80× | ≤ 1× |", out)
        py["fast_path"]["prepared"] = {"error": "boom"}
        self.write("py.json", json.dumps(py))
        rc, out, err = self.report()
        self.assertEqual(rc, 0, err)  # a failed measurement is listed, not missing
        self.assertIn("- **fast_path (Python), prepared**: boom", section_text(out, "Failures"))

    def check_missing(self, key, name, why):
        sec = next(s for s in self.sections if s["key"] == key)
        rc, out, err = self.report()
        self.assertEqual(rc, 1, out)
        self.assertIn(sec["title"], err)
        self.assertIn(sec["bench"], err)
        self.assertIn(f"{name} {why}", err)
        # The section is still there, saying what is missing.
        self.assertEqual(headings(out), self.titles + ["Failures"])
        self.assertIn("**Missing.**", section_text(out, sec["title"]))
        return out, err

    def test_missing_section_fails_naming_it(self):
        os.remove(os.path.join(self.out, "fast.md"))
        self.write("fast.failed", "fast exited with status 1")
        _, err = self.check_missing("fast", "fast.md", "was not written")
        self.assertIn("fast exited with status 1", err)

    def test_empty_section_fails_naming_it(self):
        self.write("auth.md", "")
        self.check_missing("auth", "auth.md", "is empty")

    def test_unreadable_json_fails_every_section_it_makes(self):
        self.write("call.json", "{")
        _, err = self.check_missing("call", "call.json", "is not readable JSON")
        for sec in self.sections:
            if "call.json" in sec["needs"]:
                self.assertIn(sec["title"], err)

    def test_skipped_section_is_reported_as_skipped(self):
        self.write("isolation.md", "skipped: needs root: no namespaces without it.\n")
        sec = next(s for s in self.sections if s["key"] == "isolation")
        rc, out, err = self.report()
        self.assertEqual(rc, 0, err)
        self.assertEqual(headings(out), self.titles + ["Failures"])
        self.assertIn("Skipped on this machine: needs root: no namespaces without it.",
                      section_text(out, sec["title"]))
        self.assertRegex(section_text(out, "Failures"),
                         re.escape(f"**{sec['title']}** ({sec['bench']}): needs root"))

    def test_skipped_json_section(self):
        self.write("fairness.json", json.dumps({"skipped": "no compile workers here"}))
        rc, out, err = self.report()
        self.assertEqual(rc, 0, err)
        self.assertIn("Skipped on this machine: no compile workers here",
                      section_text(out, "A small compile during two template bombs"))

    def test_output_no_section_reads_fails(self):
        self.write("new.md", "| a table nobody reads |\n")
        rc, out, err = self.report()
        self.assertEqual(rc, 1)
        self.assertIn("new.md is read by no section", err)
        self.assertIn("new.md", section_text(out, "Failures"))

    def test_run_sh_writes_exactly_what_the_sections_read(self):
        with open(RUN_SH) as f:
            script = f.read()
        written = set(re.findall(r'"\$OUT/([A-Za-z0-9_.-]+\.(?:json|md))"', script))
        runs = set(re.findall(r"^run ([A-Za-z0-9_]+) ", script, re.M))
        used = {n for s in self.sections for n in s["needs"] + s["reads"]}
        needed = {n for s in self.sections for n in s["needs"]}
        self.assertEqual(written - used, set(), "run.sh writes files no section reads")
        self.assertEqual(needed - written, set(), "sections need files run.sh never writes")
        self.assertEqual({s["run"] for s in self.sections} - runs, set())
        self.assertIn("fast.md", needed)


if __name__ == "__main__":
    unittest.main(verbosity=2)
