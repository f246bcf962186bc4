"""The same-host fast channel: a shared-memory slot ring served by an executor.

This mirrors ``proto/opjit/wire/fast_channel.h`` (the byte offsets are fixed
there and checked by static_asserts; they are repeated here with ``struct``).
The ring is an ``mmap`` of ``/dev/shm/<key>``. A call runs in one of two
ways, with the same protocol, waits, deadlines and answers:

* the compiled extension ``opjit._fastcall`` (``_fastcall.cc``, built by the
  CMake build next to this file), which includes the wire header and runs
  the whole call in C++ with the GIL released while it waits: used whenever
  it imports, unless ``OPJIT_PURE_PYTHON=1`` (:data:`EXTENSION`);
* pure Python (the fallback, and where there is no compiler): the 32-bit
  state words are ``ctypes.c_uint32`` objects over the mapping, and the
  doorbell is a futex (``syscall(SYS_futex)`` through ctypes, without
  FUTEX_PRIVATE_FLAG: the words live in a mapping shared with another process).

A call (:meth:`FastChannel.call`):

1. take a free slot (client-local: a lock and a free list);
2. write the handle, a sequence number, the deadline, the tensor count and
   one (region id, offset) pair per input then per output;
3. publish ``state = SUBMITTED`` (the state word is written last), bump the
   header's doorbell and wake the executor. Python cannot issue a memory
   fence, so the pure path always issues FUTEX_WAKE: the syscall orders the
   stores before it, and x86-64 keeps plain stores in program order, which is
   why the channel is only used there (the extension uses seq_cst atomics and
   wakes only a sleeping executor, as the C++ client does);
4. spin on the slot's state for up to ``spin_us``, then announce
   ``client_waiting = 1`` and FUTEX_WAIT on the state word in 50 ms steps,
   watching the header's ``closed`` flag and whether the executor process
   and the daemon itself are still alive (a call waiting when the daemon
   exits answers UNAVAILABLE / ``DAEMON_EXITED`` at once, and the channel is
   closed);
5. read the reply (a gRPC status code, an ErrorInfo reason, a message, the
   kernel's time), then hand the slot back (``state = FREE``).

:data:`Call` is a prepared call bound to a channel (the handle and the
tensor refs written once): calling it runs the call and returns its
``result`` attribute, or hands anything else to its ``_slow`` method
(``opjit._transport.PreparedCall`` says what that does).
"""

import ctypes
import mmap
import os
import platform
import struct
import sys
import threading
import time

# Layout (proto/opjit/wire/fast_channel.h).
MAGIC = 0x314A504F  # "OPJ1"
VERSION = 1
HEADER_BYTES = 4096
SLOT_BYTES = 4096
REASON_BYTES = 40
MESSAGE_BYTES = 1024

FREE, SUBMITTED, RUNNING, DONE = 0, 1, 2, 3

# Header offsets.
H_MAGIC, H_VERSION, H_SLOTS, H_SLOT_BYTES, H_MAX_TENSORS, H_WORKER_PID = 0, 4, 8, 12, 16, 20
H_DOORBELL, H_WORKER_SLEEPING, H_CLOSED, H_SPIN_US = 24, 28, 32, 40
# Slot offsets.
S_STATE, S_CLIENT_WAITING, S_N_TENSORS, S_FLAGS, S_HANDLE, S_SEQ, S_DEADLINE = 0, 4, 8, 12, 16, 24, 32
S_CODE, S_MESSAGE_LEN, S_KERNEL_MS, S_REASON, S_MESSAGE, S_TENSORS = 40, 44, 48, 56, 96, 1152

_HEADER = struct.Struct("<IIIIII")           # magic .. worker_pid
_REQUEST = struct.Struct("<IIQQq")           # n_tensors, flags, handle, seq, deadline_ns (at 8)
F_KEEP_OUTPUT_BYTES = 1                      # Slot.flags: outputs keep their bytes
_REPLY = struct.Struct("<iId")               # code, message_len, kernel_ms (at 40)

_WAIT_STEP_NS = 50_000_000      # one FUTEX_WAIT: a lost wake-up costs at most this
_DEAD_GRACE_NS = 2_000_000_000  # after the executor died: how long the daemon gets to answer
_DEADLINE_GRACE_NS = 10_000_000_000  # past the call's deadline without any reply

# syscall(2) is variadic: every argument is passed as a full C long.
_PROBE_EVERY = 32  # with the spin budget at 0: one full spin per this many calls
_SYS_FUTEX = ctypes.c_long(202)  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = ctypes.c_long(0), ctypes.c_long(1)
_ONE, _ZERO = ctypes.c_long(1), ctypes.c_long(0)


def supported():
    """True where the channel's memory-ordering assumptions hold (x86-64 Linux)."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


class ChannelClosed(Exception):
    """The channel is gone (executor died, region released) and this call never ran."""


class ChannelError(Exception):
    """The channel's memory is not what the protocol says (an incompatible server)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


class Reply:
    """A slot's answer: ``code`` (a gRPC status number, 0 = OK), ``reason``,
    ``message`` and ``kernel_ms``."""

    __slots__ = ("code", "reason", "message", "kernel_ms")

    def __init__(self, code, reason, message, kernel_ms):
        self.code = code
        self.reason = reason
        self.message = message
        self.kernel_ms = kernel_ms


def _load_extension():
    """opjit._fastcall, or None: not built here, not importable, a platform
    without the channel, or OPJIT_PURE_PYTHON set (to anything but 0)."""
    if os.environ.get("OPJIT_PURE_PYTHON", "") not in ("", "0") or not supported():
        return None
    try:
        from opjit import _fastcall
    except ImportError:
        return None
    return _fastcall


EXTENSION = _load_extension()  # the compiled call loop, or None: pure Python


class _Mapped:
    """What both channels share: the mapping of an OpenChannel answer and its
    checked header.

    Args:
      info: the opjit.v1.OpenChannelResponse.
      spin_us: how long a caller spins on its slot before it sleeps (None:
        the server's advice, ``info.spin_us``).
    """

    def __init__(self, info, spin_us=None):
        self.channel_id = info.channel_id
        self.region = info.region
        self.shm_key = info.shm_key
        self.worker_pid = int(info.worker_pid)
        self.daemon_pid = int(getattr(info, "daemon_pid", 0))
        path = "/dev/shm/" + info.shm_key.lstrip("/")
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, int(info.byte_size), mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        mm = self._mm
        magic, version, n_slots, slot_bytes, max_tensors, pid = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION or slot_bytes != SLOT_BYTES or n_slots == 0 or \
                HEADER_BYTES + n_slots * SLOT_BYTES > len(mm):
            raise ChannelError("channel %s: unexpected header (magic %#x, version %d, %d slots of "
                               "%d bytes in %d)" % (info.region, magic, version, n_slots,
                                                    slot_bytes, len(mm)))
        if pid and not self.worker_pid:
            self.worker_pid = pid
        self.n_slots = n_slots
        self.max_tensors = min(int(max_tensors), int(info.max_tensors or max_tensors),
                               (SLOT_BYTES - S_TENSORS) // 16)
        server_spin = info.spin_us if info.spin_us > 0 else 0
        self.spin_ns = int((server_spin if spin_us is None else spin_us) * 1000)

    def worker_alive(self):
        if not self.worker_pid:
            return True
        try:
            os.kill(self.worker_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another uid (a sandbox): it exists
            pass
        try:  # a zombie (exited, not yet reaped by the daemon) is dead too
            with open("/proc/%d/stat" % self.worker_pid, "rb") as f:
                stat = f.read()
            return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")
        except OSError:
            return True

    def _daemon_watch(self):
        """A function telling whether the daemon exited (None: not watched).

        A pidfd where the kernel has them (a reused pid is never taken for
        the daemon); else kill(pid, 0) and a zombie check, as worker_alive.
        The pid is watched only when /proc/<pid>/comm is "opjitd" (a pid
        from another pid namespace names some other process here).
        """
        pid = self.daemon_pid
        if pid <= 0:
            return None
        try:
            with open("/proc/%d/comm" % pid, "rb") as f:
                if f.read().strip() != b"opjitd":
                    return None
        except OSError:
            return None
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = -1
        if fd >= 0:
            import select
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            self._daemon_fd = fd  # closed with the object (os.close in __del__)
            return lambda: bool(poller.poll(0))
        probe = _Mapped.__new__(_Mapped)
        probe.worker_pid = pid
        return lambda: not probe.worker_alive()

    def __del__(self):
        fd = getattr(self, "_daemon_fd", -1)
        if fd >= 0:
            self._daemon_fd = -1
            try:
                os.close(fd)
            except OSError:
                pass

    def _unmap(self):
        try:
            self._mm.close()
        except (BufferError, ValueError):  # still exported somewhere: left to the GC
            pass


class PyFastChannel(_Mapped):
    """One mapped channel, calls in pure Python. Thread-safe. Args as _Mapped."""

    def __init__(self, info, spin_us=None):
        super().__init__(info, spin_us)
        mm = self._mm
        n_slots = self.n_slots
        # Adaptive spin: the budget halves each time a spin ends without the
        # reply (on a busy machine the spinning core is what the executor
        # waits for) and returns to spin_ns when a spin catches it; at 0,
        # one call in _PROBE_EVERY spins the full budget to notice the change.
        self._budget = self.spin_ns
        self._since_probe = 0
        # ctypes views over the shared words; they pin the mapping until close().
        self._doorbell = ctypes.c_uint32.from_buffer(mm, H_DOORBELL)
        self._closed = ctypes.c_uint32.from_buffer(mm, H_CLOSED)
        self._bases = [HEADER_BYTES + i * SLOT_BYTES for i in range(n_slots)]
        self._state = [ctypes.c_uint32.from_buffer(mm, b + S_STATE) for b in self._bases]
        self._waiting = [ctypes.c_uint32.from_buffer(mm, b + S_CLIENT_WAITING) for b in self._bases]
        sc = _syscall()
        self._syscall = sc
        self._doorbell_addr = ctypes.c_void_p(ctypes.addressof(self._doorbell))
        self._state_addr = [ctypes.c_void_p(ctypes.addressof(s)) for s in self._state]
        self._step = _Timespec(0, _WAIT_STEP_NS)
        self._step_ref = ctypes.byref(self._step)
        self._lock = threading.Lock()
        self._free_cv = threading.Condition(self._lock)
        self._free = list(range(n_slots - 1, -1, -1))
        self._seq = 0
        self._refs = {}
        self._is_closed = False
        self._daemon_exited = self._daemon_watch()
        self.bound_calls = 0  # calls PyCall objects completed (status OK)

    @property
    def native(self):
        """What Call.bind takes."""
        return self

    # ---- state --------------------------------------------------------------

    @property
    def closed(self):
        """True once the daemon closed the channel, or close() was called."""
        return self._is_closed or self._closed.value != 0

    def close(self):
        """Stops using the channel (the daemon closes it with the client's regions).

        The mapping is released once no call is using it.
        """
        with self._lock:
            self._is_closed = True
            self._free_cv.notify_all()
            if len(self._free) == self.n_slots:
                self._release()

    def _release(self):
        """Drops the views over the mapping and unmaps it (no call may be using it)."""
        self._doorbell = self._closed = None
        self._state = self._waiting = []
        self._unmap()

    # ---- a call -------------------------------------------------------------

    def _refs_struct(self, n):
        s = self._refs.get(n)
        if s is None:
            s = self._refs[n] = struct.Struct("<%dQ" % (2 * n))
        return s

    def call(self, handle, refs, deadline_ns=0, keep_output_bytes=False):
        """Runs one prepared call; returns its Reply.

        refs: a flat list [region id, offset, region id, offset, ...], inputs
        then outputs (region 0: an absent input). deadline_ns: a
        CLOCK_MONOTONIC time (time.monotonic_ns()), 0 for none.
        keep_output_bytes: the outputs are not zero-filled before the kernel
        (they are all in this client's regions).

        Raises ChannelClosed when the channel is gone and the call did not run.
        """
        return self._call(handle, refs, deadline_ns, F_KEEP_OUTPUT_BYTES if keep_output_bytes else 0)

    def _call(self, handle, refs, deadline_ns, flags):
        n = len(refs) // 2
        if n > self.max_tensors:
            raise ChannelError("%d tensors; the channel takes at most %d" % (n, self.max_tensors))
        mm = self._mm
        with self._lock:
            while not self._free and not self._is_closed:
                self._free_cv.wait(0.05)
            if self._is_closed or self._closed.value:
                raise ChannelClosed("the fast channel is closed")
            i = self._free.pop()
            self._seq += 1
            seq = self._seq
        base = self._bases[i]
        state = self._state[i]
        reusable = True
        try:
            _REQUEST.pack_into(mm, base + S_N_TENSORS, n, flags, handle, seq, deadline_ns)
            self._refs_struct(n).pack_into(mm, base + S_TENSORS, *refs)
            state.value = SUBMITTED  # last: publishes the slot
            with self._lock:
                self._doorbell.value = (self._doorbell.value + 1) & 0xFFFFFFFF
            # Always wake: the syscall also orders the stores above before the
            # executor can miss them (Python has no fence of its own).
            self._syscall(_SYS_FUTEX, self._doorbell_addr, _FUTEX_WAKE, _ONE, None, None, _ZERO)
            seen, gone = self._wait(i, deadline_ns)
            if seen != DONE:
                reusable = False  # in an unknown state: never handed out again
                if gone == "daemon":
                    return Reply(14, "DAEMON_EXITED",  # UNAVAILABLE
                                 "opjitd (pid %d) exited; the call was not answered"
                                 % self.daemon_pid, 0.0)
                if gone and seen == SUBMITTED:
                    raise ChannelClosed("the fast channel closed before the call ran")
                if gone:
                    return Reply(10, "KERNEL_CRASHED",  # ABORTED, as the gRPC path answers
                                 "the executor process serving the fast channel died during "
                                 "the call and no reply came", 0.0)
                return Reply(4, "", "no reply from the fast channel's executor %.0f s after the "
                                    "call's deadline" % (_DEADLINE_GRACE_NS / 1e9), 0.0)
            code, msg_len, kernel_ms = _REPLY.unpack_from(mm, base + S_CODE)
            reason = message = ""
            if code != 0:
                raw = mm[base + S_REASON:base + S_REASON + REASON_BYTES]
                reason = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
                msg_len = min(msg_len, MESSAGE_BYTES)
                message = mm[base + S_MESSAGE:base + S_MESSAGE + msg_len].decode("utf-8", "replace")
            return Reply(code, reason, message, kernel_ms)
        finally:
            if reusable:
                self._waiting[i].value = 0
                state.value = FREE
                with self._lock:
                    self._free.append(i)
                    self._free_cv.notify()
                    if self._is_closed and len(self._free) == self.n_slots:
                        self._release()

    def _wait(self, i, deadline_ns):
        """Waits for slot i to be DONE. Returns (state, gone): the last state
        seen (DONE, or what it was left in), and whether the channel closed
        or its executor died (else the deadline passed long ago): "daemon"
        when the daemon itself exited."""
        state = self._state[i]
        if state.value == DONE:
            return DONE, False
        budget = self._budget
        if budget == 0 and self.spin_ns:
            self._since_probe += 1
            if self._since_probe >= _PROBE_EVERY:
                self._since_probe = 0
                budget = self.spin_ns
        if budget > 0:
            clock = time.perf_counter_ns
            end = clock() + budget
            while state.value != DONE:
                if clock() >= end:
                    break
            else:
                self._budget = self.spin_ns
                return DONE, False
            self._budget = budget // 2 if budget >= 2000 else 0
        waiting = self._waiting[i]
        waiting.value = 1
        addr = self._state_addr[i]
        sc = self._syscall
        gone_since = 0
        while True:
            seen = state.value
            if seen == DONE:
                return DONE, False
            # The kernel's futex code orders `waiting = 1` before its read of
            # the state word; a wake-up lost anyway costs one step, no hang.
            sc(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_long(seen), self._step_ref, None, _ZERO)
            seen = state.value
            if seen == DONE:
                return DONE, False
            if self._daemon_exited is not None and self._daemon_exited():
                # Nobody is left to answer (its executors die with it): now,
                # not after the executor's grace.
                seen = state.value
                if seen == DONE:
                    return DONE, False
                self._is_closed = True
                return seen, "daemon"
            if self._closed.value != 0:
                # The daemon sets `closed` once it answered every call in
                # flight, or handed one back as not run (SUBMITTED: a crash
                # in an executor other kernels had used; run it again on a
                # new channel): nothing more will come.
                seen = state.value
                return seen, seen != DONE
            now = time.monotonic_ns()
            gone = self._is_closed or not self.worker_alive()
            if gone:
                # The daemon writes the status of every call in flight and
                # sets DONE; give it a moment to do so.
                if not gone_since:
                    gone_since = now
                elif now - gone_since > _DEAD_GRACE_NS:
                    return seen, True
            if deadline_ns and now > deadline_ns + _DEADLINE_GRACE_NS:
                return seen, False


class ExtFastChannel(_Mapped):
    """One mapped channel, calls in C++ (opjit._fastcall). Thread-safe. Args
    as _Mapped."""

    def __init__(self, info, spin_us=None):
        super().__init__(info, spin_us)
        self._ext = EXTENSION.Channel(self._mm, self.n_slots, self.max_tensors, self.spin_ns,
                                      self.worker_pid, ChannelClosed, ChannelError,
                                      _DEAD_GRACE_NS, _DEADLINE_GRACE_NS, self.daemon_pid)

    @property
    def native(self):
        """What Call.bind takes."""
        return self._ext

    @property
    def closed(self):
        """True once the daemon closed the channel, or close() was called."""
        return self._ext.closed

    @property
    def bound_calls(self):
        """Calls Call objects completed on this channel (status OK)."""
        return self._ext.bound_calls

    def close(self):
        """Stops using the channel; the mapping is released once no call uses it."""
        self._ext.close()
        if self._ext.released:
            self._unmap()

    def call(self, handle, refs, deadline_ns=0, keep_output_bytes=False):
        """As PyFastChannel.call."""
        return Reply(*self._ext.call(handle, refs, deadline_ns,
                                     F_KEEP_OUTPUT_BYTES if keep_output_bytes else 0))


class PyCall:
    """A prepared call bound to a PyFastChannel: the pure-Python twin of
    opjit._fastcall.Call (see the module docstring).

    ``bind(channel.native, handle, refs, flags=0, timeout_ns=0)``; calling it
    returns ``self.result`` when the call answered OK (``kernel_ms`` holds
    the kernel's time), else ``self._slow(code, reason, message)``: code
    None when unbound, -1 when the channel closed before the call ran, else
    the reply's gRPC status code.
    """

    result = None
    kernel_ms = 0.0
    _ch = None

    def bind(self, channel, handle, refs, flags=0, timeout_ns=0):
        refs = list(refs)
        if len(refs) % 2:
            raise ValueError("refs holds (region id, offset) pairs")
        if len(refs) // 2 > channel.max_tensors:
            raise ChannelError("%d tensors; the channel takes at most %d"
                               % (len(refs) // 2, channel.max_tensors))
        self._ch, self._handle, self._refs = channel, handle, refs
        self._flags, self._timeout_ns = flags, timeout_ns

    def unbind(self):
        self._ch = None

    @property
    def channel(self):
        return self._ch

    def __call__(self):
        ch = self._ch
        if ch is None:
            return self._slow(None, "", "")
        t = self._timeout_ns
        try:
            r = ch._call(self._handle, self._refs, time.monotonic_ns() + t if t > 0 else 0,
                         self._flags)
        except ChannelClosed as e:
            return self._slow(-1, "", str(e))
        if r.code:
            return self._slow(r.code, r.reason, r.message)
        ch.bound_calls += 1
        self.kernel_ms = r.kernel_ms
        return self.result


FastChannel = ExtFastChannel if EXTENSION is not None else PyFastChannel
Call = EXTENSION.Call if EXTENSION is not None else PyCall
