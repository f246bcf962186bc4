// opjit._fastcall: one fast-channel call in C++ for the Python client.
//
// The pure-Python channel (opjit/_fast.py) spends ~20 µs of interpreter work
// on a call whose round trip is ~1.5 µs; this module does the same call with
// the same protocol in C++: the slot ring of proto/opjit/wire/fast_channel.h
// (included from there, the layout's one home), the same spin then futex
// wait, the same deadline and executor-death handling, the same answers.
// _fast.py uses it when it imports (and OPJIT_PURE_PYTHON is not set); the
// pure-Python path stays the fallback and the reference.
//
//   Channel(buffer, n_slots, max_tensors, spin_ns, worker_pid, closed_exc, error_exc,
//           dead_grace_ns=2e9, deadline_grace_ns=10e9, daemon_pid=0)
//     buffer: the writable mapping of the channel (an mmap; held until close()).
//     The graces are _fast.py's: how long the daemon gets to answer once the
//     executor is gone, and how long past its deadline a call waits at all.
//     daemon_pid: opjitd's (OpenChannelResponse.daemon_pid); a call waiting
//     when it exits answers 14 UNAVAILABLE / DAEMON_EXITED at once, and the
//     channel is closed.
//     call(handle, refs, deadline_ns=0, flags=0) -> (code, reason, message, kernel_ms)
//       refs: [region id, offset, ...] inputs then outputs. Raises closed_exc
//       when the call did not run (the channel is closed), error_exc for more
//       tensors than a slot holds.
//     closed, close(), bound_calls (calls served for Call objects)
//   Call(): a prepared call, subclassable (opjit._transport.PreparedCall).
//     bind(channel, handle, refs, flags=0, timeout_ns=0), unbind()
//     self() runs the bound call and returns self.result (no allocation on
//     success: the same object every call); anything else goes to the
//     subclass's self._slow(code, reason, message): code None when unbound,
//     -1 when the channel closed before the call ran, else the gRPC status
//     code of the reply (10 ABORTED / KERNEL_CRASHED when the executor died
//     mid-call, 14 UNAVAILABLE / DAEMON_EXITED when the daemon did, 4
//     DEADLINE_EXCEEDED when nothing answered past the deadline).
//
// Locks: the GIL, then Ring::mu (held briefly, never while waiting for the
// GIL). The GIL is released while a call waits for its reply and while it
// waits for a free slot.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <structmember.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "proto/opjit/wire/fast_channel.h"

namespace {

namespace fast = opjit::fast;

// As _fast.py: one FUTEX_WAIT (a lost wake-up costs at most this).
constexpr int64_t kWaitStepNs = 50'000'000;
// With the spin budget at 0, one call in this many spins the full budget.
constexpr int kProbeEvery = 32;
// A slot's tensors run to the end of the slot (the server's max_tensors is
// at most this).
constexpr uint32_t kSlotTensors =
    (fast::kSlotBytes - offsetof(fast::Slot, tensors)) / sizeof(fast::TensorRef);

inline void CpuRelax() { __builtin_ia32_pause(); }

// The mapped ring and what the callers of one channel share.
struct Ring {
  char* base = nullptr;
  uint32_t n_slots = 0;
  uint32_t max_tensors = 0;
  int64_t spin_ns = 0;
  pid_t worker_pid = 0;
  std::unique_ptr<fast::ProcessWatch> daemon;  // opjitd, when it sent its pid
  std::atomic<bool> daemon_exited{false};      // a call saw it gone: closed
  int64_t dead_grace_ns = 0;
  int64_t deadline_grace_ns = 0;
  // Adaptive spin (_fast.py): the budget halves each time a spin ends
  // without the reply and returns to spin_ns when one catches it.
  std::atomic<int64_t> budget{0};
  std::atomic<int> since_probe{0};
  std::atomic<uint64_t> seq{0};

  std::mutex mu;
  std::condition_variable freed;
  std::vector<uint32_t> free;  // guarded by mu: slots this process may take
  bool closing = false;        // guarded by mu: close() was called

  fast::Header* header() const { return fast::HeaderOf(base); }
  bool closed_flag() const {
    return header()->closed.load(std::memory_order_seq_cst) != 0 || daemon_exited.load();
  }
};

// How a call ended.
struct Outcome {
  enum Kind { kDone, kNotRun, kCrashed, kDaemonExited, kNoReply } kind = kDone;
  int32_t code = 0;
  double kernel_ms = 0;
  char reason[fast::kReasonBytes + 1] = {0};
  std::vector<char> message;   // filled on a non-zero code only
  const char* text = nullptr;  // kNotRun, kCrashed, kNoReply: what happened
  char text_buf[128];          // where `text` points when it is formatted
};

// A zombie (exited, not yet reaped by the daemon) is dead too.
bool WorkerAlive(pid_t pid) { return !fast::PidGone(static_cast<int>(pid)); }

// Waits (GIL released by the caller) for slot `s` to be kDone. Returns the
// last state seen; *gone: the channel closed or its executor died (else the
// deadline passed long ago). As _FastChannel._wait in _fast.py.
uint32_t WaitDone(Ring& r, fast::Slot* s, int64_t deadline_ns, bool* gone) {
  *gone = false;
  int64_t budget = r.budget.load(std::memory_order_relaxed);
  if (budget == 0 && r.spin_ns > 0 &&
      r.since_probe.fetch_add(1, std::memory_order_relaxed) + 1 >= kProbeEvery) {
    r.since_probe.store(0, std::memory_order_relaxed);
    budget = r.spin_ns;
  }
  if (budget > 0) {
    const int64_t end = fast::MonotonicNs() + budget;
    for (int i = 1;; ++i) {
      if (s->state.load(std::memory_order_acquire) == fast::kDone) {
        r.budget.store(r.spin_ns, std::memory_order_relaxed);
        return fast::kDone;
      }
      CpuRelax();
      if ((i & 63) == 0 && fast::MonotonicNs() >= end) break;
    }
    r.budget.store(budget >= 2000 ? budget / 2 : 0, std::memory_order_relaxed);
  }
  s->client_waiting.store(1, std::memory_order_seq_cst);
  int64_t gone_since = 0;
  for (;;) {
    uint32_t seen = s->state.load(std::memory_order_seq_cst);
    if (seen == fast::kDone) return seen;
    // The kernel's futex code orders `client_waiting = 1` before its read of
    // the state word; a wake-up lost anyway costs one step, no hang.
    fast::FutexWait(&s->state, seen, kWaitStepNs);
    seen = s->state.load(std::memory_order_seq_cst);
    if (seen == fast::kDone) return seen;
    if (r.daemon != nullptr && r.daemon->Exited()) {
      // Nobody is left to answer (its executors die with it): now, not
      // after the executor's grace.
      seen = s->state.load(std::memory_order_seq_cst);
      if (seen == fast::kDone) return seen;
      r.daemon_exited.store(true);
      *gone = true;
      return seen;
    }
    if (r.closed_flag()) {
      // The daemon sets `closed` once it answered every call in flight, or
      // handed one back as not run (kSubmitted: a crash in an executor other
      // kernels had used; run it again on a new channel).
      seen = s->state.load(std::memory_order_seq_cst);
      *gone = seen != fast::kDone;
      return seen;
    }
    const int64_t now = fast::MonotonicNs();
    bool closing;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      closing = r.closing;
    }
    if (r.closed_flag() || closing || !WorkerAlive(r.worker_pid)) {
      // The daemon writes the status of every call in flight and sets
      // kDone; give it a moment to do so.
      if (gone_since == 0) {
        gone_since = now;
      } else if (now - gone_since > r.dead_grace_ns) {
        *gone = true;
        return seen;
      }
    }
    if (deadline_ns != 0 && now > deadline_ns + r.deadline_grace_ns) return seen;
  }
}

// Runs one call (the GIL held on entry and on return; released while it
// waits). `refs` holds n (region, offset) pairs, n <= r.max_tensors.
void RunCall(Ring& r, uint64_t handle, const fast::TensorRef* refs, uint32_t n, int64_t deadline_ns,
             uint32_t flags, Outcome* out) {
  uint32_t index;
  {
    std::unique_lock<std::mutex> lock(r.mu);
    while (r.free.empty() && !r.closing && !r.closed_flag()) {
      // Every slot is busy: wait for one without the GIL (its holder may be
      // the thread about to hand one back). Another thread may take the
      // slot while this one gets the GIL back: then it waits again.
      lock.unlock();
      Py_BEGIN_ALLOW_THREADS {
        std::unique_lock<std::mutex> waiting(r.mu);
        while (r.free.empty() && !r.closing && !r.closed_flag()) {
          r.freed.wait_for(waiting, std::chrono::nanoseconds(kWaitStepNs));
        }
      }
      Py_END_ALLOW_THREADS lock.lock();
    }
    if (r.closing || r.closed_flag()) {
      out->kind = Outcome::kNotRun;
      out->text = "the fast channel is closed";
      return;
    }
    index = r.free.back();
    r.free.pop_back();
  }
  fast::Slot* s = fast::SlotAt(r.base, index);
  fast::TensorRef* slot_refs = reinterpret_cast<fast::TensorRef*>(reinterpret_cast<char*>(s) +
                                                                  offsetof(fast::Slot, tensors));
  s->n_tensors = n;
  s->flags = flags;
  s->handle = handle;
  s->seq = r.seq.fetch_add(1, std::memory_order_relaxed) + 1;
  s->deadline_ns = deadline_ns;
  std::memcpy(slot_refs, refs, n * sizeof(fast::TensorRef));
  s->client_waiting.store(0, std::memory_order_relaxed);
  s->state.store(fast::kSubmitted, std::memory_order_seq_cst);  // last: publishes the slot
  fast::Header* h = r.header();
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  // The executor announces worker_sleeping before it re-checks the doorbell
  // and sleeps; both sides are seq_cst, so one of them sees the other.
  if (h->worker_sleeping.load(std::memory_order_seq_cst) != 0) fast::FutexWake(&h->doorbell);

  uint32_t seen = s->state.load(std::memory_order_acquire);
  bool gone = false;
  if (seen != fast::kDone) {
    Py_BEGIN_ALLOW_THREADS seen = WaitDone(r, s, deadline_ns, &gone);
    Py_END_ALLOW_THREADS
  }
  if (seen != fast::kDone) {
    // In an unknown state: never handed out again.
    if (gone && r.daemon_exited.load()) {
      out->kind = Outcome::kDaemonExited;
      out->code = 14;  // UNAVAILABLE
      std::strcpy(out->reason, "DAEMON_EXITED");
      std::snprintf(out->text_buf, sizeof out->text_buf,
                    "opjitd (pid %d) exited; the call was not answered", r.daemon->pid());
      out->text = out->text_buf;
    } else if (gone && seen == fast::kSubmitted) {
      out->kind = Outcome::kNotRun;
      out->text = "the fast channel closed before the call ran";
    } else if (gone) {
      out->kind = Outcome::kCrashed;
      out->code = 10;  // ABORTED, as the gRPC path answers
      std::strcpy(out->reason, "KERNEL_CRASHED");
      out->text =
          "the executor process serving the fast channel died during the call and no "
          "reply came";
    } else {
      out->kind = Outcome::kNoReply;
      out->code = 4;  // DEADLINE_EXCEEDED
      std::snprintf(out->text_buf, sizeof out->text_buf,
                    "no reply from the fast channel's executor %.0f s after the call's deadline",
                    static_cast<double>(r.deadline_grace_ns) / 1e9);
      out->text = out->text_buf;
    }
    return;
  }
  out->kind = Outcome::kDone;
  out->code = s->code;
  out->kernel_ms = s->kernel_ms;
  if (out->code != 0) {
    std::memcpy(out->reason, s->reason, fast::kReasonBytes);
    out->reason[fast::kReasonBytes] = '\0';
    const uint32_t len = std::min<uint32_t>(s->message_len, fast::kMessageBytes);
    out->message.assign(s->message, s->message + len);
  }
  s->client_waiting.store(0, std::memory_order_relaxed);
  s->state.store(fast::kFree, std::memory_order_seq_cst);
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.free.push_back(index);
  }
  r.freed.notify_one();
}

// ---------------------------------------------------------------------------
// Channel

struct ChannelObject {
  PyObject_HEAD Ring* ring;
  Py_buffer view;  // view.obj != nullptr while held
  PyObject* closed_exc;
  PyObject* error_exc;
  unsigned long long bound_calls;
};

// Drops the buffer once no call uses it (close() called, every slot back).
void MaybeRelease(ChannelObject* self) {
  if (self->view.obj == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(self->ring->mu);
    // A slot given up on never comes back: the mapping is then left to the
    // garbage collector, as in _fast.py.
    if (!self->ring->closing || self->ring->free.size() != self->ring->n_slots) return;
  }
  PyBuffer_Release(&self->view);
  self->ring->base = nullptr;
}

// Reads `refs` (a sequence of 2n ints) into out[0..n). False with a Python
// error set when it is not one.
bool ParseRefs(ChannelObject* ch, PyObject* refs, fast::TensorRef* out, uint32_t* n) {
  PyObject* seq = PySequence_Fast(refs, "refs must be a sequence of ints");
  if (seq == nullptr) return false;
  const Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
  if (len % 2 != 0) {
    Py_DECREF(seq);
    PyErr_SetString(PyExc_ValueError, "refs holds (region id, offset) pairs");
    return false;
  }
  const Py_ssize_t pairs = len / 2;
  if (pairs > static_cast<Py_ssize_t>(ch->ring->max_tensors)) {
    Py_DECREF(seq);
    PyErr_Format(ch->error_exc, "%zd tensors; the channel takes at most %u", pairs,
                 ch->ring->max_tensors);
    return false;
  }
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < pairs; ++i) {
    out[i].region = PyLong_AsUnsignedLongLong(items[2 * i]);
    out[i].offset = PyLong_AsUnsignedLongLong(items[2 * i + 1]);
    if (PyErr_Occurred()) {
      Py_DECREF(seq);
      return false;
    }
  }
  Py_DECREF(seq);
  *n = static_cast<uint32_t>(pairs);
  return true;
}

// Runs a call on `ch` when its buffer is still held; NotRun otherwise.
void RunOn(ChannelObject* ch, uint64_t handle, const fast::TensorRef* refs, uint32_t n,
           int64_t deadline_ns, uint32_t flags, Outcome* out) {
  if (ch->view.obj == nullptr) {
    out->kind = Outcome::kNotRun;
    out->text = "the fast channel is closed";
    return;
  }
  RunCall(*ch->ring, handle, refs, n, deadline_ns, flags, out);
  MaybeRelease(ch);
}

// The reply's strings, decoded as _fast.py does (an executor may write any
// bytes there).
PyObject* ReasonOf(const Outcome& o) {
  return PyUnicode_DecodeUTF8(o.reason, static_cast<Py_ssize_t>(std::strlen(o.reason)), "replace");
}

PyObject* MessageOf(const Outcome& o) {
  if (o.kind != Outcome::kDone) return PyUnicode_FromString(o.text);
  return PyUnicode_DecodeUTF8(o.message.data(), static_cast<Py_ssize_t>(o.message.size()),
                              "replace");
}

int Channel_init(ChannelObject* self, PyObject* args, PyObject* kwds) {
  static const char* kwlist[] = {
      "buffer",     "n_slots",   "max_tensors",   "spin_ns",           "worker_pid",
      "closed_exc", "error_exc", "dead_grace_ns", "deadline_grace_ns", "daemon_pid", nullptr};
  PyObject *buffer, *closed_exc, *error_exc;
  unsigned int n_slots, max_tensors;
  long long spin_ns, dead_grace_ns = 2'000'000'000, deadline_grace_ns = 10'000'000'000;
  int worker_pid, daemon_pid = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OIILiOO|LLi", const_cast<char**>(kwlist), &buffer,
                                   &n_slots, &max_tensors, &spin_ns, &worker_pid, &closed_exc,
                                   &error_exc, &dead_grace_ns, &deadline_grace_ns, &daemon_pid)) {
    return -1;
  }
  if (self->ring != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Channel.__init__ called twice");
    return -1;
  }
  if (n_slots == 0 || max_tensors == 0 || max_tensors > kSlotTensors) {
    PyErr_Format(PyExc_ValueError, "%u slots of at most %u tensors: not a channel", n_slots,
                 max_tensors);
    return -1;
  }
  if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) != 0) return -1;
  if (static_cast<uint64_t>(self->view.len) <
          fast::kHeaderBytes + uint64_t{n_slots} * fast::kSlotBytes ||
      reinterpret_cast<uintptr_t>(self->view.buf) % 64 != 0) {
    PyBuffer_Release(&self->view);
    PyErr_Format(PyExc_ValueError, "a buffer of %zd bytes cannot hold %u slots", self->view.len,
                 n_slots);
    return -1;
  }
  auto* ring = new Ring;
  ring->base = static_cast<char*>(self->view.buf);
  ring->n_slots = n_slots;
  ring->max_tensors = max_tensors;
  ring->spin_ns = spin_ns > 0 ? spin_ns : 0;
  ring->budget = ring->spin_ns;
  ring->worker_pid = worker_pid;
  if (daemon_pid > 0) {
    ring->daemon = std::make_unique<fast::ProcessWatch>(daemon_pid, fast::kDaemonComm);
  }
  ring->dead_grace_ns = dead_grace_ns;
  ring->deadline_grace_ns = deadline_grace_ns;
  for (uint32_t i = n_slots; i > 0; --i) ring->free.push_back(i - 1);
  self->ring = ring;
  Py_INCREF(closed_exc);
  self->closed_exc = closed_exc;
  Py_INCREF(error_exc);
  self->error_exc = error_exc;
  return 0;
}

int Channel_traverse(ChannelObject* self, visitproc visit, void* arg) {
  Py_VISIT(self->closed_exc);
  Py_VISIT(self->error_exc);
  return 0;
}

int Channel_clear(ChannelObject* self) {
  Py_CLEAR(self->closed_exc);
  Py_CLEAR(self->error_exc);
  return 0;
}

void Channel_dealloc(ChannelObject* self) {
  PyObject_GC_UnTrack(self);
  if (self->view.obj != nullptr) PyBuffer_Release(&self->view);
  delete self->ring;
  Channel_clear(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* Channel_call(ChannelObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 4) {
    PyErr_SetString(PyExc_TypeError, "call(handle, refs, deadline_ns=0, flags=0)");
    return nullptr;
  }
  const uint64_t handle = PyLong_AsUnsignedLongLong(args[0]);
  const int64_t deadline_ns = nargs > 2 ? PyLong_AsLongLong(args[2]) : 0;
  const uint32_t flags = nargs > 3 ? static_cast<uint32_t>(PyLong_AsUnsignedLong(args[3])) : 0;
  if (PyErr_Occurred()) return nullptr;
  fast::TensorRef refs[kSlotTensors];
  uint32_t n = 0;
  if (self->ring == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Channel was not initialised");
    return nullptr;
  }
  if (!ParseRefs(self, args[1], refs, &n)) return nullptr;
  Outcome o;
  RunOn(self, handle, refs, n, deadline_ns, flags, &o);
  if (o.kind == Outcome::kNotRun) {
    PyErr_SetString(self->closed_exc, o.text);
    return nullptr;
  }
  PyObject* reason = ReasonOf(o);
  PyObject* message = reason != nullptr ? MessageOf(o) : nullptr;
  if (message == nullptr) {
    Py_XDECREF(reason);
    return nullptr;
  }
  return Py_BuildValue("(iNNd)", o.code, reason, message, o.kernel_ms);
}

PyObject* Channel_close(ChannelObject* self, PyObject*) {
  if (self->ring != nullptr) {
    {
      std::lock_guard<std::mutex> lock(self->ring->mu);
      self->ring->closing = true;
    }
    self->ring->freed.notify_all();
    MaybeRelease(self);
  }
  Py_RETURN_NONE;
}

PyObject* Channel_get_closed(ChannelObject* self, void*) {
  if (self->ring == nullptr || self->view.obj == nullptr) Py_RETURN_TRUE;
  bool closing;
  {
    std::lock_guard<std::mutex> lock(self->ring->mu);
    closing = self->ring->closing;
  }
  return PyBool_FromLong(closing || self->ring->closed_flag());
}

PyObject* Channel_get_released(ChannelObject* self, void*) {
  return PyBool_FromLong(self->view.obj == nullptr);
}

PyMethodDef kChannelMethods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Channel_call)),
     METH_FASTCALL,
     "call(handle, refs, deadline_ns=0, flags=0) -> (code, reason, message, kernel_ms)"},
    {"close", reinterpret_cast<PyCFunction>(Channel_close), METH_NOARGS,
     "Takes no more calls; the buffer is released once no call uses it."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef kChannelGetSet[] = {{"closed", reinterpret_cast<getter>(Channel_get_closed), nullptr,
                                 "close() was called or the daemon closed the channel", nullptr},
                                {"released", reinterpret_cast<getter>(Channel_get_released),
                                 nullptr, "the buffer is no longer held", nullptr},
                                {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMemberDef kChannelMembers[] = {
    {"bound_calls", T_ULONGLONG, offsetof(ChannelObject, bound_calls), READONLY,
     "calls Call objects completed on this channel (status OK)"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject ChannelType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "opjit._fastcall.Channel",  // tp_name
    sizeof(ChannelObject),                                        // tp_basicsize
};

// ---------------------------------------------------------------------------
// Call

struct CallObject {
  PyObject_HEAD ChannelObject* channel;  // nullptr: unbound
  PyObject* result;
  PyObject* dict;
  PyObject* weakrefs;
  uint64_t handle;
  int64_t timeout_ns;
  uint32_t flags;
  uint32_t n;
  double kernel_ms;
  fast::TensorRef refs[kSlotTensors];
};

// self._slow(code, reason, message); takes the references to reason and
// message (either may be nullptr after a failed decode).
PyObject* Slow(CallObject* self, PyObject* code, PyObject* reason, PyObject* message) {
  static PyObject* name = nullptr;
  PyObject* out = nullptr;
  if (reason != nullptr && message != nullptr &&
      (name != nullptr || (name = PyUnicode_InternFromString("_slow")) != nullptr)) {
    PyObject* args[] = {reinterpret_cast<PyObject*>(self), code, reason, message};
    out = PyObject_VectorcallMethod(name, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  }
  Py_XDECREF(reason);
  Py_XDECREF(message);
  return out;
}

PyObject* Call_call(CallObject* self, PyObject* args, PyObject* kwds) {
  if (PyTuple_GET_SIZE(args) != 0 || (kwds != nullptr && PyDict_GET_SIZE(kwds) != 0)) {
    PyErr_SetString(PyExc_TypeError, "a prepared call takes no arguments");
    return nullptr;
  }
  ChannelObject* ch = self->channel;
  if (ch == nullptr) return Slow(self, Py_None, PyUnicode_FromString(""), PyUnicode_FromString(""));
  const int64_t deadline_ns = self->timeout_ns > 0 ? fast::MonotonicNs() + self->timeout_ns : 0;
  Outcome o;
  Py_INCREF(ch);  // a _slow elsewhere may rebind this call while it waits
  RunOn(ch, self->handle, self->refs, self->n, deadline_ns, self->flags, &o);
  if (o.kind == Outcome::kDone && o.code == 0) {
    ch->bound_calls++;
    Py_DECREF(ch);
    self->kernel_ms = o.kernel_ms;
    PyObject* result = self->result != nullptr ? self->result : Py_None;
    Py_INCREF(result);
    return result;
  }
  Py_DECREF(ch);
  PyObject* code = PyLong_FromLong(o.kind == Outcome::kNotRun ? -1 : o.code);
  if (code == nullptr) return nullptr;
  PyObject* out = Slow(self, code, ReasonOf(o), MessageOf(o));
  Py_DECREF(code);
  return out;
}

PyObject* Call_bind(CallObject* self, PyObject* args, PyObject* kwds) {
  static const char* kwlist[] = {"channel", "handle", "refs", "flags", "timeout_ns", nullptr};
  PyObject *channel, *refs;
  unsigned long long handle;
  unsigned int flags = 0;
  long long timeout_ns = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!KO|IL", const_cast<char**>(kwlist), &ChannelType,
                                   &channel, &handle, &refs, &flags, &timeout_ns)) {
    return nullptr;
  }
  auto* ch = reinterpret_cast<ChannelObject*>(channel);
  if (ch->ring == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Channel was not initialised");
    return nullptr;
  }
  uint32_t n = 0;
  fast::TensorRef parsed[kSlotTensors];
  if (!ParseRefs(ch, refs, parsed, &n)) return nullptr;
  std::memcpy(self->refs, parsed, n * sizeof(fast::TensorRef));
  self->n = n;
  self->handle = handle;
  self->flags = flags;
  self->timeout_ns = timeout_ns;
  Py_INCREF(ch);
  Py_XSETREF(self->channel, ch);
  Py_RETURN_NONE;
}

PyObject* Call_unbind(CallObject* self, PyObject*) {
  Py_CLEAR(self->channel);
  Py_RETURN_NONE;
}

PyObject* Call_get_channel(CallObject* self, void*) {
  PyObject* ch = self->channel != nullptr ? reinterpret_cast<PyObject*>(self->channel) : Py_None;
  Py_INCREF(ch);
  return ch;
}

int Call_traverse(CallObject* self, visitproc visit, void* arg) {
  Py_VISIT(self->channel);
  Py_VISIT(self->result);
  Py_VISIT(self->dict);
  return 0;
}

int Call_clear(CallObject* self) {
  Py_CLEAR(self->channel);
  Py_CLEAR(self->result);
  Py_CLEAR(self->dict);
  return 0;
}

// A subclass's instances come here through subtype_dealloc, which drops the
// reference to their (heap) type itself.
void Call_dealloc(CallObject* self) {
  PyObject_GC_UnTrack(self);
  if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(reinterpret_cast<PyObject*>(self));
  Call_clear(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMethodDef kCallMethods[] = {
    {"bind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Call_bind)),
     METH_VARARGS | METH_KEYWORDS,
     "bind(channel, handle, refs, flags=0, timeout_ns=0): run on this channel from now on"},
    {"unbind", reinterpret_cast<PyCFunction>(Call_unbind), METH_NOARGS,
     "Runs through self._slow(None, '', '') from now on."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef kCallMembers[] = {
    {"result", T_OBJECT, offsetof(CallObject, result), 0, "what a successful call returns"},
    {"kernel_ms", T_DOUBLE, offsetof(CallObject, kernel_ms), 0, "the last call's kernel time"},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef kCallGetSet[] = {
    {"channel", reinterpret_cast<getter>(Call_get_channel), nullptr, "the bound Channel, or None",
     nullptr},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject CallType = {
    PyVarObject_HEAD_INIT(nullptr, 0) "opjit._fastcall.Call",  // tp_name
    sizeof(CallObject),                                        // tp_basicsize
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT,
                       "_fastcall",
                       "The fast channel's call loop in C++ (see opjit/_fast.py).",
                       -1,
                       nullptr,
                       nullptr,
                       nullptr,
                       nullptr,
                       nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__fastcall() {
  ChannelType.tp_dealloc = reinterpret_cast<destructor>(Channel_dealloc);
  ChannelType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  ChannelType.tp_doc = "A mapped fast channel (see the module docstring).";
  ChannelType.tp_traverse = reinterpret_cast<traverseproc>(Channel_traverse);
  ChannelType.tp_clear = reinterpret_cast<inquiry>(Channel_clear);
  ChannelType.tp_methods = kChannelMethods;
  ChannelType.tp_members = kChannelMembers;
  ChannelType.tp_getset = kChannelGetSet;
  ChannelType.tp_init = reinterpret_cast<initproc>(Channel_init);
  ChannelType.tp_new = PyType_GenericNew;

  CallType.tp_dealloc = reinterpret_cast<destructor>(Call_dealloc);
  CallType.tp_call = reinterpret_cast<ternaryfunc>(Call_call);
  CallType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  CallType.tp_doc = "A prepared call bound to a Channel (see the module docstring).";
  CallType.tp_traverse = reinterpret_cast<traverseproc>(Call_traverse);
  CallType.tp_clear = reinterpret_cast<inquiry>(Call_clear);
  CallType.tp_methods = kCallMethods;
  CallType.tp_members = kCallMembers;
  CallType.tp_getset = kCallGetSet;
  CallType.tp_dictoffset = offsetof(CallObject, dict);
  CallType.tp_weaklistoffset = offsetof(CallObject, weakrefs);
  CallType.tp_new = PyType_GenericNew;

  if (PyType_Ready(&ChannelType) < 0 || PyType_Ready(&CallType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  Py_INCREF(&ChannelType);
  Py_INCREF(&CallType);
  if (PyModule_AddObject(m, "Channel", reinterpret_cast<PyObject*>(&ChannelType)) < 0 ||
      PyModule_AddObject(m, "Call", reinterpret_cast<PyObject*>(&CallType)) < 0 ||
      PyModule_AddIntConstant(m, "MAX_TENSORS", kSlotTensors) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
