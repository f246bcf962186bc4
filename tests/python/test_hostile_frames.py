"""A hostile kernel against its executor's control socket (issue 26).

A kernel runs inside its executor process, so it can write anything to the
executor's control socket (fd 3). It used to make the daemon allocate what
a 5-byte header claimed (`[len = 1<<30][type = 2]`: 1 GiB a call), hang the
call until kernel_timeout_ms and blame the kernel's time. Now every frame
from an executor is bounded before it is read (server/common/frame_io.h):
the call fails at once with ABORTED / KERNEL_CRASHED (cause "protocol"),
the executor is stopped, the daemon's peak memory does not move, and the
next call runs in a fresh executor.

These tests run on their own daemon with a 60 s kernel time limit, so a
call that waited for it would be seen.
"""

import re
import threading
import time

import grpc
import numpy as np
import pytest

import opjit

from conftest import TempDaemon, health, unary_kernel, unary_spec, vm_hwm_kb

KERNEL_TIMEOUT_MS = 60000
FAST = 20.0  # seconds: far below the kernel time limit, generous for a loaded machine

# y = x. x[0] picks what the kernel writes to fd 3 (its executor's control
# socket), x[1] how long it then sleeps before it returns.
HOSTILE = r"""#include <cstdint>
#include <ctime>
#include <unistd.h>
extern "C" int K(int n, void** p, int* nd, int64_t** s, const char** d, void* st, void* e) {
  int64_t k = 1;
  for (int i = 0; i < nd[0]; ++i) k *= s[0][i];
  const float* x = static_cast<const float*>(p[0]);
  float* y = static_cast<float*>(p[1]);
  const unsigned char huge[5] = {0, 0, 0, 0x40, 2};  // len = 1 << 30, type 2 (doorbell)
  const unsigned char cut[5] = {100, 0, 0, 0, 2};    // len = 100, then nothing
  const char noise[] = "not a frame at all, only noise from a kernel";
  const int mode = static_cast<int>(x[0]);
  if (mode == 1) (void)!write(3, huge, sizeof huge);
  if (mode == 2) (void)!write(3, cut, sizeof cut);
  if (mode == 3) (void)!write(3, noise, sizeof noise);
  if (k > 1 && x[1] > 0) {
    timespec t{static_cast<time_t>(x[1]), 0};
    nanosleep(&t, nullptr);
  }
  for (int64_t i = 0; i < k; ++i) y[i] = x[i];
  return 0;
}
"""

MODES = {"huge_length": 1, "header_then_silence": 2, "garbage": 3}


@pytest.fixture(scope="module")
def daemon():
    d = TempDaemon()
    # Four executors, so four calls run at once; no quarantine, so each
    # hostile call meets the protocol check, not the quarantine.
    d.spawn("[exec]\nkernel_timeout_ms = %d\nworkers = 4\nquarantine_after = 1000\n"
            % KERNEL_TIMEOUT_MS, prefix="opjit-hf-", serving=True)
    with opjit.Client(d.unix_address, timeout=120) as c:
        c.register(unary_spec("hf_hostile", HOSTILE))
        c.register(unary_spec("hf_twice", unary_kernel()))
    yield d
    d.close()


def daemon_ok(d, pid):
    assert d.proc.poll() is None, "opjitd died:\n" + d.read_log()[-3000:]
    assert d.proc.pid == pid
    assert health(d.unix_address) == "SERVING"
    with opjit.Client(d.unix_address, timeout=60, fast="off") as c:
        np.testing.assert_array_equal(c.op("hf_twice")(np.array([1, 2], np.float32)), [2, 4])


def hostile_call(address, mode, sleep_s, fast="off"):
    """(error or None, seconds) of one call of hf_hostile."""
    with opjit.Client(address, timeout=KERNEL_TIMEOUT_MS / 1000 + 60, fast=fast) as c:
        x = np.array([mode, sleep_s, 7, 8], np.float32)
        t0 = time.monotonic()
        try:
            y = c.op("hf_hostile")(x)
        except opjit.OpjitError as e:
            return e, time.monotonic() - t0
        np.testing.assert_array_equal(y, x)
        return None, time.monotonic() - t0


def assert_protocol_violation(err, took):
    assert took < FAST, "the call took %.1f s (kernel limit %d s)" % (took, KERNEL_TIMEOUT_MS // 1000)
    assert err is not None, "a call whose kernel broke the protocol succeeded"
    assert err.code == grpc.StatusCode.ABORTED, err
    assert err.reason == "KERNEL_CRASHED", err
    assert err.metadata.get("cause") == "protocol", err.metadata
    assert "protocol" in err.message, err.message
    assert "time limit" not in err.message and "deadline" not in err.message, err.message
    assert not re.search(r"/(tmp|work|usr|home|proc|dev|var|opt)\b", err.message), err.message


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("sleep_s", [0, 3])
def test_a_kernel_that_breaks_the_protocol_fails_only_its_call(daemon, mode, sleep_s):
    """The kernel writes to fd 3 and returns at once (the daemon may be
    spinning on the slot) or after 3 s (the daemon sleeps on the socket, as
    in the issue's reproduction): the call fails fast, as a protocol
    violation, and the daemon and the next call are fine."""
    pid = daemon.proc.pid
    err, took = hostile_call(daemon.unix_address, MODES[mode], sleep_s)
    assert_protocol_violation(err, took)
    daemon_ok(daemon, pid)
    # The same op without the hostile write runs in a fresh executor.
    err, _ = hostile_call(daemon.unix_address, 0, 0)
    assert err is None, err


def test_four_concurrent_huge_frames_keep_the_daemons_memory(daemon):
    """The issue's measurement: four concurrent calls whose kernels claim a
    1 GiB frame took the daemon's VmHWM from 79 MB to 3.23 GB. Now it stays
    within 200 MB of its baseline, and every call fails fast."""
    pid = daemon.proc.pid
    daemon_ok(daemon, pid)
    base = vm_hwm_kb(pid)
    for sleep_s in (3, 0):
        results = []

        def one():
            results.append(hostile_call(daemon.unix_address, MODES["huge_length"], sleep_s))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(KERNEL_TIMEOUT_MS / 1000 + 120)
        assert len(results) == 4
        for err, took in results:
            assert_protocol_violation(err, took)
    grew_mb = (vm_hwm_kb(pid) - base) / 1024
    assert grew_mb < 200, "the daemon's peak memory grew by %.0f MB" % grew_mb
    daemon_ok(daemon, pid)


@pytest.mark.skipif(not opjit._fast.supported(), reason="the fast channel is x86-64 Linux only")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_fast_channel_kernel_that_breaks_the_protocol(daemon, mode):
    """The same kernels behind a fast channel (whose executor also has the
    control socket on fd 3): the call ends fast (it may have answered before
    the daemon read the bytes; then its channel ends after it), the daemon's
    memory stays put, and new calls work."""
    pid = daemon.proc.pid
    base = vm_hwm_kb(pid)
    err, took = hostile_call(daemon.unix_address, MODES[mode], 1, fast="on")
    assert took < FAST, err
    if err is not None:
        assert err.code != grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert (vm_hwm_kb(pid) - base) / 1024 < 200
    daemon_ok(daemon, pid)
    with opjit.Client(daemon.unix_address, timeout=60, fast="on") as c:
        np.testing.assert_array_equal(c.op("hf_twice")(np.array([3], np.float32)), [6])
