"""Cache keys from content only, and progress on long compiles (issue 25).

Three daemons share one throwaway Redis cache tier:

- "build": opjitd from the build tree, which finds kernels/include in the
  source tree;
- "usr": the same binaries linked into <tmp>/usr/bin, which find their kernel
  headers at <tmp>/usr/share/opjit/include, as the .deb lays them out;
- "edited": the build tree's opjitd with [compiler] kernel_include_dir naming a
  copy of kernels/include whose opjit/kernel.h has one more line.

A kernel that includes opjit/kernel.h compiled by "build" is a tier hit with
the same key on "usr"; "edited" compiles it anew, under another key.

Then compiles that run a few seconds: the Python client's progress callback
hears from them about once a second, and the daemon logs a registration's
compile once it passes [compiler] slow_log_ms (1 s in these daemons) and when
it ends.
"""

import os
import re
import shutil
import tempfile
import time

import pytest

import opjit
from conftest import REPO, TempDaemon, opjitd_binary, wait_for
from services import REDIS, Redis

BINARIES = ("opjitd", "opjit-exec-worker", "opjit-compile-worker", "opjit-gpu-sandbox")

SOURCE = r"""
#include <opjit/kernel.h>
extern "C" int Scale(int nparam, void** params, int* ndims, int64_t** shapes,
                     const char** dtypes, void* stream, void* extra) {
  opjit::KernelArgs args(nparam, params, ndims, shapes, dtypes, extra);
  auto x = args.Tensor<float>(0);
  auto y = args.Tensor<float>(1);
  for (int64_t i = 0; i < x.size(); ++i) y[i] = 2.5f * x[i];
  return 0;
}
"""


class Daemon(TempDaemon):
    def __init__(self, root, name, config, binary=None):
        d = os.path.join(root, name)
        os.makedirs(d)
        self.spawn(config, binary, dir=d)

    def client(self):
        return opjit.Client(self.unix_address, timeout=120)

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()


def install_prefix(root):
    """<root>/usr/bin with the build's binaries (hard links where the file
    system allows, else copies) and <root>/usr/share/opjit/include: the
    layout opjitd finds its kernel headers in when installed."""
    bindir = os.path.join(root, "usr", "bin")
    os.makedirs(bindir)
    built = os.path.dirname(opjitd_binary())
    for name in BINARIES:
        src = os.path.join(built, name)
        if not os.path.exists(src):
            continue
        try:
            os.link(src, os.path.join(bindir, name))
        except OSError:
            shutil.copy2(src, bindir)
    shutil.copytree(os.path.join(REPO, "kernels", "include"),
                    os.path.join(root, "usr", "share", "opjit", "include"))
    return os.path.join(bindir, "opjitd")


@pytest.fixture(scope="module")
def tier():
    if not os.access(REDIS, os.X_OK):
        pytest.fail("%s is missing: run deploy/install-deps.sh (redis-server)" % REDIS)
    root = tempfile.mkdtemp(prefix="opjit-ck-")
    redis = Redis(root).start()
    daemons = {}
    try:
        key = os.path.join(root, "cluster.key")
        with open(key, "wb") as f:
            f.write(os.urandom(32))
        os.chmod(key, 0o600)
        remote = ('[cache.remote]\nurl = "redis://127.0.0.1:%d"\nkey_file = "%s"\n'
                  'timeout_ms = 500\n' % (redis.port, key))
        edited = os.path.join(root, "edited-include")
        shutil.copytree(os.path.join(REPO, "kernels", "include"), edited)
        with open(os.path.join(edited, "opjit", "kernel.h"), "a") as f:
            f.write("// one more line: another header content, another key\n")
        usr_opjitd = install_prefix(os.path.join(root, "prefix"))
        # Compiles past 1 s are logged ([compiler] slow_log_ms), so a compile
        # of a second or two shows the log lines on any machine; the time
        # limit is far above what a loaded sanitizer build needs.
        compiler = "[compiler]\nslow_log_ms = 1000\ntimeout_ms = 120000\n"
        daemons["build"] = Daemon(root, "build", compiler + "\n" + remote)
        daemons["usr"] = Daemon(root, "usr", compiler + "\n" + remote, binary=usr_opjitd)
        daemons["edited"] = Daemon(root, "edited", compiler +
                                   'kernel_include_dir = "%s"\n\n' % edited + remote)
        for d in daemons.values():
            wait_for(d.answers, 60, "opjitd in " + d.dir)
        yield daemons
    finally:
        for d in daemons.values():
            d.close()
        redis.close()
        shutil.rmtree(root, ignore_errors=True)


def test_install_prefixes_share_keys_and_the_tier(tier):
    with tier["build"].client() as c:
        before = c.cache_stats().remote_puts
        first = c.compile(SOURCE, entry="Scale")
        assert first.cache_hit == ""
        # Puts are asynchronous: the object, then its manifest.
        wait_for(lambda: c.cache_stats().remote_puts >= before + 2, 20,
                 "the build-tree daemon to write its entries to the tier")
    with tier["usr"].client() as c:
        stats = c.cache_stats()
        hit = c.compile(SOURCE, entry="Scale")
        after = c.cache_stats()
    assert hit.cache_hit == "remote", (hit, tier["usr"].read_log()[-3000:])
    assert hit.cache_key == first.cache_key
    assert after.compiles == stats.compiles  # nothing compiled there
    assert after.remote_hits == stats.remote_hits + 2  # manifest and object
    assert after.remote_rejected == stats.remote_rejected
    with tier["edited"].client() as c:
        other = c.compile(SOURCE, entry="Scale")
    assert other.cache_hit == ""
    assert other.cache_key != first.cache_key
    print("\nkeys: build tree %s, /usr layout %s (%s hit, %.1f ms against a %.1f ms compile), "
          "edited header %s" % (first.cache_key[:16], hit.cache_key[:16], hit.cache_hit,
                                hit.total_ms, first.total_ms, other.cache_key[:16]))


def heavy_source(n, salt):
    """A kernel whose compile time grows with `n` (n template instances,
    each optimized separately): about 1.3 ms each on a 2-core CI machine."""
    return r"""
#include <cstdint>
#include <utility>
template <int N> __attribute__((noinline)) float Step(float x) {
  for (int i = 0; i < 4 + N %% 5; ++i) x = x * 1.0001f + static_cast<float>(N %% 7) * 0.5f;
  return x;
}
template <int... I> float All(float x, std::integer_sequence<int, I...>) {
  float r[] = {Step<I>(x)...};
  float s = %d;
  for (float v : r) s += v;
  return s;
}
extern "C" int Heavy(int nparam, void** params, int* ndims, int64_t** shapes,
                     const char** dtypes, void* stream, void* extra) {
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[1]);
  y[0] = All(x[0], std::make_integer_sequence<int, %d>{});
  return 0;
}
""" % (salt, n)


def check_progress(calls, elapsed):
    assert calls, "the progress callback was never called"
    assert all(b > a for a, b in zip(calls, calls[1:])), calls  # increasing
    assert calls[0] > 0
    # The last call is the one at the end.
    assert elapsed - 1.0 <= calls[-1] <= elapsed, (calls, elapsed)
    # About once a second while waiting (a busy machine may skip a beat).
    if elapsed >= 1.5:
        assert len(calls) >= max(2, int(elapsed) // 2), (calls, elapsed)


def test_progress_callback_and_the_slow_compile_log(tier):
    d = tier["build"]
    salt = os.getpid()
    with d.client() as c:
        # A first compile long enough for the callback (> 1 s), which also
        # says how fast this machine compiles now.
        calls = []
        t = time.monotonic()
        r = c.compile(heavy_source(2000, salt), entry="Heavy", progress=calls.append)
        elapsed = time.monotonic() - t
        assert r.cache_hit == ""
        check_progress(calls, elapsed)
        print("\ncompile of 2000 instances: %.1f s, progress at %s"
              % (elapsed, ", ".join("%.2f" % v for v in calls)))
        # Then registrations (registration compiles too) long enough to pass
        # the daemon's 1 s mark (slow_log_ms above): each with its own salt,
        # so none is a cache hit, twice the size of the last while too short.
        n = 2000
        for attempt in range(3):
            name = "heavy_%d_%d" % (salt, attempt)
            spec = {"name": name, "inputs": [{"index": 0, "name": "x"}],
                    "outputs": [{"index": 0, "name": "y"}],
                    "dtype_formats": [{"dtypes": ["float32", "float32"]}],
                    "implementations": [{"target": "CPU",
                                         "source": heavy_source(n, salt * 10 + 2 + attempt),
                                         "entry": "Heavy"}]}
            calls = []
            t = time.monotonic()
            c.register(spec, progress=calls.append)
            elapsed = time.monotonic() - t
            check_progress(calls, elapsed)
            print("registration with %d instances: %.1f s, progress at %s"
                  % (n, elapsed, ", ".join("%.2f" % v for v in calls)))
            if elapsed >= 1.5:
                break
            n *= 2
        # A callback that raises gives the call up; the error propagates.
        def stop(elapsed):
            raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            c.compile(heavy_source(2000, salt + 1), entry="Heavy", progress=stop)
        with pytest.raises(opjit.InvalidArgument):
            c.compile(SOURCE, entry="Scale", progress="not callable")

    if elapsed < 1.5:
        pytest.skip("the compile took %.1f s, under the daemon's 1 s mark: its log "
                    "lines are covered by compile_watch_test" % elapsed)
    log = d.read_log()
    label = "default/" + name
    running = [l for l in log.splitlines() if "compile of %s" % label in l
               and re.search(r"still running after \d+ s", l)]
    finished = [l for l in log.splitlines() if "compile of %s" % label in l
                and re.search(r"finished after \d+\.\d s", l)]
    assert len(running) == 1, log[-3000:]
    assert len(finished) == 1, log[-3000:]
    assert re.search(r"\(CPU, key [0-9a-f]{12}\)", running[0]), running[0]
    for line in running + finished:
        assert d.dir not in line and REPO not in line, line  # no host path
    print(running[0])
    print(finished[0])
