"""A guilty kernel fails alone, on every transport (issue 40, item 5).

MindSpore's own aot test kernel add_with_attr.cc asks for a workspace of N
bytes (N = the input's element count) and writes N*N floats into it. It
returned normally, having corrupted its executor's heap, and the next calls
of other ops in its namespace failed: on the fast channel (the default for a
same-host client), where nothing is run again, every one of them.

Now each workspace ends at a guard page (server/runner/guard_pages.h): the
kernel faults in its own call, whose error names the kernel and the fault,
and the client's next calls of other ops run on a new channel. A crash in a
channel executor that other kernels had used is handed back to the client
as a call that never ran, and runs once more in a fresh executor (as the
pool does): a neighbour's corruption is never the reason a call fails.
A write into a workspace's alignment slack fails its call, and one past the
executor's inline-tensor arena faults at the arena's guard page.
"""

import numpy as np
import pytest

import opjit

from conftest import TempDaemon, unary_kernel, unary_spec

# add_with_attr.cc's bug, written anew: an N-byte workspace, N*N floats.
ADD_WITH_ATTR = r"""#include <cstdint>
#include <vector>
#include "custom_aot_extra.h"
extern "C" int AddWithAttrInit(int* nd, int64_t** s, const char** d, AotExtra* extra) {
  size_t n = 1;
  for (int i = 0; i < nd[0]; ++i) n *= s[0][i];
  extra->SetWorkSpace(std::vector<size_t>{n});  // bytes, though it holds floats
  return 0;
}
extern "C" int AddWithAttr(int np, void** p, int* nd, int64_t** s, const char** d, void* st,
                           void* e) {
  int64_t n = 1;
  for (int i = 0; i < nd[0]; ++i) n *= s[0][i];
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  float* tmp = static_cast<float*>(p[2]);
  for (int64_t i = 0; i < n * n; ++i) tmp[i] = x[i % n];
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] + tmp[i];
  return 0;
}
"""

# Writes one float past its 16-byte workspace: into the slack before the
# guard page (the workspace is rounded up to 64-byte alignment).
SLACK = r"""#include <cstdint>
#include <vector>
#include "custom_aot_extra.h"
extern "C" int KInit(int* nd, int64_t** s, const char** d, AotExtra* extra) {
  extra->SetWorkSpace(std::vector<size_t>{16});
  return 0;
}
extern "C" int K(int np, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  float* ws = static_cast<float*>(p[2]);
  ws[4] = 1.0f;
  return 0;
}
"""

# Writes a byte in each page after its output, as far as it gets: inline, its
# output is in its executor's arena, whose end is a guard page.
PAST_THE_ARENA = r"""#include <cstdint>
extern "C" int K(int np, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  volatile char* y = static_cast<char*>(p[1]);
  for (int64_t i = 0; i < (int64_t{1} << 32); i += 4096) y[i] = 1;
  return 0;
}
"""

SOFTPLUS = r"""#include <cmath>
#include <cstdint>
extern "C" int K(int np, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  int64_t n = 1;
  for (int i = 0; i < nd[0]; ++i) n *= s[0][i];
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  for (int64_t i = 0; i < n; ++i) y[i] = std::log1p(std::exp(x[i]));
  return 0;
}
"""


@pytest.fixture(scope="module")
def daemon():
    d = TempDaemon()
    # A small arena (2.5 x max_message_mb) for test_a_write_past_the_arena.
    d.spawn("max_message_mb = 4\n[exec]\nworkers = 1\n", prefix="opjit-gk-", serving=True)
    c = opjit.Client(d.unix_address, timeout=120, fast="off")
    spec = unary_spec("gk_add_with_attr", ADD_WITH_ATTR)
    spec["implementations"][0]["entry"] = "AddWithAttr"
    for s in (spec, unary_spec("gk_softplus", SOFTPLUS), unary_spec("gk_double", unary_kernel()),
              unary_spec("gk_slack", SLACK), unary_spec("gk_arena", PAST_THE_ARENA)):
        s["output_rules"] = [{"kind": "same_as", "input": 0}]
        c.register(s)
    c.close()
    yield d
    d.close()


def softplus(x):
    return np.log1p(np.exp(x))


def test_add_with_attr_fails_alone_on_the_fast_channel(daemon):
    c = opjit.Client(daemon.unix_address, timeout=120, fast="on")
    x = c.asarray(np.linspace(-2, 2, 16, dtype=np.float32))
    # Other ops first, so the guilty call runs in an executor they used.
    np.testing.assert_allclose(c.op("gk_softplus")(x), softplus(x), rtol=1e-5)
    prepared = c.op("gk_double").prepare(x)
    np.testing.assert_array_equal(prepared(), 2 * x)
    assert prepared.path == "fast", prepared.path
    fast_before = c.call_counts()["fast"]

    with pytest.raises(opjit.Aborted) as e:
        c.op("gk_add_with_attr")(x)
    msg = str(e.value)
    assert e.value.reason == "KERNEL_CRASHED", msg
    assert "kernel AddWithAttr: SIGSEGV, a write" in msg, msg
    assert "past the end of its workspace 0 (16 bytes" in msg, msg

    # 100 calls of other ops in the same namespace, on the same client: all
    # succeed, on a new channel (Op calls and the prepared call alike).
    for i in range(50):
        np.testing.assert_allclose(c.op("gk_softplus")(x), softplus(x), rtol=1e-5,
                                   err_msg="call %d" % i)
        np.testing.assert_array_equal(prepared(), 2 * x, err_msg="call %d" % i)
    assert c.call_counts()["fast"] >= fast_before + 100, c.call_counts()
    assert prepared.path == "fast", prepared.path
    log = daemon.read_log()
    assert "AddWithAttr: SIGSEGV" in log, log[-4000:]
    c.close()


def test_add_with_attr_fails_alone_on_the_pool(daemon):
    c = opjit.Client(daemon.unix_address, timeout=120, fast="off")
    x = np.linspace(-2, 2, 16, dtype=np.float32)
    np.testing.assert_allclose(c.op("gk_softplus")(x), softplus(x), rtol=1e-5)
    with pytest.raises(opjit.Aborted) as e:
        c.op("gk_add_with_attr")(x)
    assert e.value.reason == "KERNEL_CRASHED", str(e.value)
    assert "past the end of its workspace 0 (16 bytes" in str(e.value), str(e.value)
    for i in range(10):
        np.testing.assert_allclose(c.op("gk_softplus")(x), softplus(x), rtol=1e-5,
                                   err_msg="call %d" % i)
    c.close()


def test_a_write_into_the_workspace_slack_fails_the_call(daemon):
    # Short of the guard page: the bytes after the workspace are checked
    # after the call, which fails; the executor lives on.
    with opjit.Client(daemon.unix_address, timeout=120, fast="on") as c:
        x = c.asarray(np.ones(16, dtype=np.float32))
        for _ in range(2):
            with pytest.raises(opjit.Aborted) as e:
                c.op("gk_slack")(x)
            assert e.value.reason == "KERNEL_FAILED", str(e.value)
            assert "wrote past the end (or before the start) of its workspace 0 (16 bytes" \
                in str(e.value), str(e.value)
        np.testing.assert_array_equal(c.op("gk_double")(x), 2 * x)


def test_a_write_past_the_arena_faults_in_its_own_call(daemon):
    with opjit.Client(daemon.unix_address, timeout=120, fast="off", transport="inline") as c:
        x = np.ones(16, dtype=np.float32)
        with pytest.raises(opjit.Aborted) as e:
            c.op("gk_arena")(x)
        assert e.value.reason == "KERNEL_CRASHED", str(e.value)
        assert "kernel K: SIGSEGV, a write" in str(e.value), str(e.value)
        assert "past the end of the executor's inline-tensor arena" in str(e.value), str(e.value)
        np.testing.assert_array_equal(c.op("gk_double")(x), 2 * x)


# A neighbour that corrupts its executor without a fault (it breaks libc's
# `stdout`), and a healthy kernel that dies of it.
CORRUPT = r"""#include <cstdint>
#include <cstdio>
extern "C" int K(int np, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  stdout = reinterpret_cast<FILE*>(16);
  static_cast<float*>(p[1])[0] = static_cast<const float*>(p[0])[0];
  return 0;
}
"""
HEALTHY = r"""#include <cstdint>
#include <cstdio>
extern "C" int K(int np, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  std::fputc('.', stdout);
  static_cast<float*>(p[1])[0] = 2 * static_cast<const float*>(p[0])[0];
  return 0;
}
"""


def test_a_victims_call_runs_again_unless_it_keeps_its_output_bytes(daemon):
    # The healthy kernel dies in the executor its neighbour broke: its call
    # is handed back and runs again on a new channel. With keep_output_bytes
    # (an output may be written in place over an input) a run that died
    # part-way may have changed its memory: it fails instead, counted
    # against no kernel.
    with opjit.Client(daemon.unix_address, timeout=120, fast="off") as admin:
        for name, src in (("gk_corrupt", CORRUPT), ("gk_healthy", HEALTHY)):
            s = unary_spec(name, src)
            s["output_rules"] = [{"kind": "same_as", "input": 0}]
            admin.register(s)
    with opjit.Client(daemon.unix_address, timeout=120, fast="on") as c:
        x = c.asarray(np.full(4, 3, dtype=np.float32))
        corrupt = c.op("gk_corrupt").prepare(x)
        healthy = c.op("gk_healthy").prepare(x)
        kept = c.op("gk_healthy").prepare(x, keep_output_bytes=True)
        handed_back = "the call goes back to its client to run again"
        before = daemon.read_log().count(handed_back)
        corrupt()
        assert healthy()[0] == 6
        assert healthy.path == "fast", healthy.path
        assert daemon.read_log().count(handed_back) == before + 1
        corrupt()
        with pytest.raises(opjit.Aborted) as e:
            kept()
        assert e.value.reason == "KERNEL_CRASHED", str(e.value)
        assert "not counted towards the kernel's quarantine" in str(e.value), str(e.value)
        assert kept()[0] == 6  # on a new channel
