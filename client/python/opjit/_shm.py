"""A pool of daemon-created shared-memory regions that tensors travel in.

How memory is handed out:

* Each region is one POSIX shm object the daemon created (CreateRegion) and
  this process mapped (``/dev/shm/<key>``, ``mmap``). Blocks in it are 64-byte
  aligned and tracked in a sorted list.
* An input that already lives in a region of the pool (an output of an
  earlier call, or an array from ``Client.empty``) is passed by reference:
  zero copies. Any other input is copied once into a free block (no
  serialization), which is freed when the call returns.
* Outputs are placed by the server with ``alloc_in``: a call reserves the free
  tail of one region for its outputs; when the reply comes, the reservation
  shrinks to the outputs' blocks and the rest is free again.
* An output is returned as an ndarray view over the mapping. Its block stays
  allocated while any array derived from it is alive: every view's ``.base``
  chain ends in one private uint8 "owner" array per output, and a
  ``weakref.finalize`` on that owner frees the block. Nothing is reused under
  a live view.
* Frees from finalizers are queued and applied under the lock by the next
  allocation, so a garbage collection inside an allocation cannot deadlock.
* Leases: regions are leased to this client's id; a daemon thread renews them
  every ``lease_ms / 3``. ``close()`` calls ReleaseClient; mappings stay valid
  for views that are still alive (unlinking a shm object does not unmap it).
"""

import collections
import logging
import math
import mmap
import os
import threading
import weakref

import grpc
import numpy as np

from opjit._proto import memory_pb2

_log = logging.getLogger("opjit")

ALIGN = 64
_MIB = 1 << 20


def _align(n):
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class ShmUnavailable(Exception):
    """Shared memory cannot be used with this server (remote, mapping failed...).

    permanent=False: only this call cannot (a quota or /dev/shm is full).
    """

    def __init__(self, message, permanent=True):
        super().__init__(message)
        self.permanent = permanent


class _Region:
    def __init__(self, name, key, size, mm, rid=0):
        self.name = name
        self.id = rid  # RegionInfo.id: the region's number on the fast channel (0: none)
        self.key = key
        self.size = size
        self.mm = mm
        self.base = np.frombuffer(mm, dtype=np.uint8)  # keeps mm exported: never closed
        self.addr = self.base.ctypes.data
        self.blocks = []  # sorted [start, end) pairs
        self.live = True  # False once the server forgot it (lease lapsed, released)

    def tail(self):
        return _align(self.blocks[-1][1]) if self.blocks else 0

    def find(self, nbytes):
        """First fit: the offset of a free gap of nbytes, or None."""
        prev = 0
        for start, end in self.blocks:
            cand = _align(prev)
            if cand + nbytes <= start:
                return cand
            prev = end
        cand = _align(prev)
        return cand if cand + nbytes <= self.size else None

    def take(self, start, end):
        i = 0
        while i < len(self.blocks) and self.blocks[i][0] < start:
            i += 1
        self.blocks.insert(i, (start, end))

    def release(self, start):
        for i, (s, _) in enumerate(self.blocks):
            if s == start:
                del self.blocks[i]
                return True
        return False


class ShmPool:
    """Thread-safe. See the module docstring for the allocation rules."""

    def __init__(self, memory_stub, namespace, client_id, lease_ms=60000,
                 region_bytes=16 * _MIB, timeout=30.0):
        self._stub = memory_stub
        self._ns = namespace
        self._client_id = client_id
        self._lease_ms = lease_ms
        self._region_bytes = region_bytes
        self._timeout = timeout
        self._lock = threading.Lock()
        self._regions = []
        self._pending = collections.deque()
        self._next_name = 0
        self._closed = False

    # ---- regions ------------------------------------------------------------

    def _new_region(self, min_bytes):
        """Creates and maps a region; caller holds the lock."""
        size = max(self._region_bytes, ((2 * min_bytes + _MIB - 1) // _MIB) * _MIB)
        name = "%s.%d" % (self._client_id, self._next_name)
        self._next_name += 1
        try:
            info = self._stub.CreateRegion(memory_pb2.CreateRegionRequest(
                namespace=self._ns, name=name, byte_size=size, client_id=self._client_id,
                lease_ms=self._lease_ms), timeout=self._timeout)
        except grpc.RpcError as e:
            code = e.code()
            raise ShmUnavailable("CreateRegion of %d bytes: %s: %s" % (size, code.name, e.details()),
                                 permanent=code != grpc.StatusCode.RESOURCE_EXHAUSTED) from None
        path = "/dev/shm/" + info.shm_key.lstrip("/")
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, info.byte_size, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as e:
            # Another host or container: the key is not in our /dev/shm.
            try:
                self._stub.UnregisterRegion(memory_pb2.UnregisterRegionRequest(
                    namespace=self._ns, name=name), timeout=self._timeout)
            except Exception:
                pass
            raise ShmUnavailable("cannot map %s: %s" % (path, e)) from e
        region = _Region(info.name or name, info.shm_key, info.byte_size, mm, info.id)
        self._regions.append(region)
        _log.debug("opjit: mapped region %s (%d bytes) at %s", region.name, region.size, path)
        return region

    def forget_regions(self):
        """Drops every region (the server no longer knows them); live views stay valid."""
        with self._lock:
            for r in self._regions:
                r.live = False
            self._regions = []

    def _drain(self):
        while self._pending:
            region, start = self._pending.popleft()
            region.release(start)

    def _defer_free(self, region, start):
        self._pending.append((region, start))

    # ---- blocks ---------------------------------------------------------------

    def alloc(self, nbytes):
        """(region, offset) of a fresh block of nbytes (> 0)."""
        nbytes = max(int(nbytes), 1)
        with self._lock:
            if self._closed:
                raise ShmUnavailable("the client is closed")
            self._drain()
            for r in self._regions:
                off = r.find(nbytes)
                if off is not None:
                    r.take(off, off + nbytes)
                    return r, off
            r = self._new_region(nbytes)
            r.take(0, nbytes)
            return r, 0

    def reserve_tail(self, min_bytes):
        """(region, offset): [offset, end of region) is reserved for alloc_in outputs."""
        min_bytes = max(int(min_bytes), ALIGN)
        with self._lock:
            if self._closed:
                raise ShmUnavailable("the client is closed")
            self._drain()
            best = None
            for r in self._regions:
                t = r.tail()
                if r.size - t >= min_bytes and (best is None or r.size - t > best[0].size - best[1]):
                    best = (r, t)
            if best is None:
                r = self._new_region(min_bytes)
                best = (r, 0)
            r, t = best
            r.take(t, r.size)
            return r, t

    def free(self, region, start):
        with self._lock:
            region.release(start)

    def view(self, region, offset, dtype, shape, track=True):
        """An ndarray over [offset, offset + nbytes) of region.

        With track=True the block [offset, ...) is marked allocated (if it is
        not already) and freed once no array derived from the result is alive.
        """
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        if not track:
            return region.base[offset:offset + nbytes].view(dtype).reshape(shape)
        owner = np.frombuffer(region.mm, dtype=np.uint8, count=nbytes, offset=offset)
        if track:
            weakref.finalize(owner, self._defer_free, region, offset)
        return owner.view(dtype).reshape(shape)

    def write(self, region, offset, arr):
        """Copies arr's elements into region at offset (row-major, arr's dtype)."""
        if arr.flags.c_contiguous:
            region.base[offset:offset + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        else:
            np.copyto(self.view(region, offset, arr.dtype, arr.shape, track=False), arr)

    def place_outputs(self, region, reserved_at, outputs):
        """Turns the tail reservation into one tracked block per output.

        outputs: (offset, dtype, shape) for the outputs the server put in
        `region`. Returns their ndarray views.
        """
        with self._lock:
            region.release(reserved_at)
            blocks = []
            for off, dtype, shape in outputs:
                n = math.prod(int(d) for d in shape)
                nbytes = n * np.dtype(dtype).itemsize
                if nbytes:
                    region.take(off, off + nbytes)
                blocks.append(nbytes)
        return [self.view(region, off, dtype, shape, track=nbytes > 0)
                for (off, dtype, shape), nbytes in zip(outputs, blocks)]

    def empty(self, shape, dtype):
        """An uninitialised array in shared memory (passed to ops without a copy)."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in np.atleast_1d(shape)) if not isinstance(shape, int) \
            else (shape,)
        n = math.prod(int(d) for d in shape)
        nbytes = n * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        region, off = self.alloc(nbytes)
        return self.view(region, off, dtype, shape, track=True)

    def locate(self, arr):
        """(region, offset) if arr is a C-contiguous array inside a live region."""
        if not arr.flags.c_contiguous or arr.nbytes == 0:
            return None
        addr = arr.__array_interface__["data"][0]
        with self._lock:
            for r in self._regions:
                if r.live and r.addr <= addr and addr + arr.nbytes <= r.addr + r.size:
                    off = addr - r.addr
                    if off % arr.dtype.itemsize == 0:
                        return r, off
        return None

    def stats(self):
        with self._lock:
            self._drain()
            return {
                "regions": len(self._regions),
                "bytes": sum(r.size for r in self._regions),
                "blocks": sum(len(r.blocks) for r in self._regions),
                "used_bytes": sum(e - s for r in self._regions for s, e in r.blocks),
            }

    # ---- leases ---------------------------------------------------------------

    def renew(self, force=False):
        """RenewLease for this client in the pool's namespace (when it holds
        regions, or `force`: handles and channels share the lease)."""
        if (self._regions or force) and not self._closed:
            self._stub.RenewLease(memory_pb2.RenewLeaseRequest(
                namespace=self._ns, client_id=self._client_id, lease_ms=self._lease_ms),
                timeout=self._timeout)

    def close(self, force=False):
        """Forgets the regions and calls ReleaseClient (when the pool held any,
        or `force`: the client's channel and handles go with it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            had = bool(self._regions) or force
            for r in self._regions:
                r.live = False
            self._regions = []
        if had:
            try:
                self._stub.ReleaseClient(memory_pb2.ReleaseClientRequest(
                    namespace=self._ns, client_id=self._client_id), timeout=5.0)
            except Exception as e:  # the daemon may be gone already
                _log.debug("opjit: ReleaseClient failed: %s", e)
