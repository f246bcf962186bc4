// The CUDA driver wrappers without a GPU: Get() must fail cleanly here, and
// the wrappers run against tests/unit/gpu/fake_cuda.cc, a host-only stand-in
// for libcuda.so.1 that exports the same versioned entry points.
#include "server/gpu/cuda_driver.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "server/gpu/nvrtc_compiler.h"

namespace opjit::gpu {
namespace {

TEST(CudaDriverTest, GetFailsCleanlyWithoutADriver) {
  void* probe = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (probe != nullptr) {
    dlclose(probe);
    GTEST_SKIP() << "a CUDA driver is installed on this host; this test is for hosts without one";
  }
  absl::StatusOr<CudaDriver*> d = CudaDriver::Get();
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  const std::string msg(d.status().message());
  EXPECT_NE(msg.find("no CUDA driver: libcuda.so.1 not found"), std::string::npos) << msg;
  // Remembered: the same answer again.
  EXPECT_EQ(CudaDriver::Get().status(), d.status());
}

TEST(CudaDriverTest, NotADriverIsUnavailable) {
  absl::StatusOr<std::unique_ptr<CudaDriver>> d = CudaDriver::Open("libm.so.6");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(d.status().message()).find("lacks cuInit"), std::string::npos)
      << d.status();
}

TEST(CudaDriverTest, StatusMapping) {
  using C = absl::StatusCode;
  EXPECT_EQ(CuResultToStatusCode(0), C::kOk);
  EXPECT_EQ(CuResultToStatusCode(2), C::kResourceExhausted);    // OUT_OF_MEMORY
  EXPECT_EQ(CuResultToStatusCode(701), C::kResourceExhausted);  // LAUNCH_OUT_OF_RESOURCES
  EXPECT_EQ(CuResultToStatusCode(100), C::kUnavailable);        // NO_DEVICE
  EXPECT_EQ(CuResultToStatusCode(3), C::kUnavailable);          // NOT_INITIALIZED
  EXPECT_EQ(CuResultToStatusCode(34), C::kUnavailable);         // STUB_LIBRARY
  EXPECT_EQ(CuResultToStatusCode(1), C::kInvalidArgument);      // INVALID_VALUE
  EXPECT_EQ(CuResultToStatusCode(209), C::kInvalidArgument);    // NO_BINARY_FOR_GPU
  EXPECT_EQ(CuResultToStatusCode(218), C::kInvalidArgument);    // INVALID_PTX
  EXPECT_EQ(CuResultToStatusCode(500), C::kInvalidArgument);    // NOT_FOUND
  EXPECT_EQ(CuResultToStatusCode(700), C::kInternal);           // ILLEGAL_ADDRESS
  EXPECT_EQ(CuResultToStatusCode(719), C::kInternal);           // LAUNCH_FAILED
  EXPECT_EQ(CuResultToStatusCode(999), C::kInternal);           // UNKNOWN
}

// ---- against the fake driver ----

using Configure = void (*)(int, int, size_t, int);
using Live = void (*)(int*, int*, int*, int*);
using LastLaunch = int (*)(unsigned*, unsigned*, unsigned*, long long*);
using Timing = void (*)(int, int, int);
using LiveEvents = int (*)();
using TakeTrace = void (*)(char*, size_t);

class FakeDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_ = dlopen(OPJIT_FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(fake_, nullptr) << dlerror();
    configure_ = reinterpret_cast<Configure>(dlsym(fake_, "FakeCudaConfigure"));
    live_ = reinterpret_cast<Live>(dlsym(fake_, "FakeCudaLive"));
    last_launch_ = reinterpret_cast<LastLaunch>(dlsym(fake_, "FakeCudaLastLaunch"));
    timing_ = reinterpret_cast<Timing>(dlsym(fake_, "FakeCudaTiming"));
    live_events_ = reinterpret_cast<LiveEvents>(dlsym(fake_, "FakeCudaLiveEvents"));
    take_trace_ = reinterpret_cast<TakeTrace>(dlsym(fake_, "FakeCudaTakeTrace"));
    ASSERT_TRUE(configure_ && live_ && last_launch_ && timing_ && live_events_ && take_trace_);
    configure_(0, 2, 1 << 20, 0);
  }
  void TearDown() override {
    if (fake_ != nullptr) dlclose(fake_);
  }
  std::vector<int> LiveCounts() {
    int b, s, m, c;
    live_(&b, &s, &m, &c);
    return {b, s, m, c};
  }
  std::unique_ptr<CudaDriver> OpenFake() {
    absl::StatusOr<std::unique_ptr<CudaDriver>> d = CudaDriver::Open(OPJIT_FAKE_CUDA_PATH);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? std::move(*d) : nullptr;
  }
  std::string Trace() {
    char buf[4096];
    take_trace_(buf, sizeof(buf));
    return buf;
  }

  void* fake_ = nullptr;
  Configure configure_ = nullptr;
  Live live_ = nullptr;
  LastLaunch last_launch_ = nullptr;
  Timing timing_ = nullptr;
  LiveEvents live_events_ = nullptr;
  TakeTrace take_trace_ = nullptr;
};

TEST_F(FakeDriverTest, OpensAndDescribesDevices) {
  auto d = OpenFake();
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->device_count(), 2);
  EXPECT_EQ(d->Version(), "cuda driver 13.0");
  absl::StatusOr<Device*> dev = d->GetDevice(1);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ((*dev)->name(), "Fake GPU");
  EXPECT_EQ((*dev)->Arch(), "sm_90");
  EXPECT_EQ((*dev)->total_memory(), 1u << 20);
  EXPECT_EQ((*dev)->l2_cache_bytes(), 4u << 20);  // CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
  EXPECT_EQ(*d->GetDevice(1), *dev);  // retained once
  EXPECT_EQ(LiveCounts()[3], 1);
  EXPECT_EQ(d->GetDevice(2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d->GetDevice(-1).status().code(), absl::StatusCode::kInvalidArgument);
  d.reset();
  EXPECT_EQ(LiveCounts()[3], 0);  // primary context released
}

TEST_F(FakeDriverTest, InitFailureAndNoDevicesAreUnavailable) {
  configure_(100 /* CUDA_ERROR_NO_DEVICE */, 0, 1 << 20, 0);
  absl::StatusOr<std::unique_ptr<CudaDriver>> d = CudaDriver::Open(OPJIT_FAKE_CUDA_PATH);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(std::string(d.status().message()),
            "cuInit failed: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected");
  configure_(0, 0, 1 << 20, 0);
  d = CudaDriver::Open(OPJIT_FAKE_CUDA_PATH);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(d.status().message()).find("no GPU devices"), std::string::npos);
}

TEST_F(FakeDriverTest, BuffersAndStreams) {
  auto d = OpenFake();
  ASSERT_NE(d, nullptr);
  Device* dev = *d->GetDevice(0);
  {
    absl::StatusOr<Stream> stream = Stream::Create(*dev);
    ASSERT_TRUE(stream.ok()) << stream.status();
    absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(*dev, 64);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_NE(buf->ptr(), 0u);
    EXPECT_EQ(buf->size(), 64u);
    const char in[16] = "hello, device!";
    ASSERT_TRUE(buf->CopyFromHost(in, sizeof(in), *stream, 8).ok());
    char out[16] = {0};
    ASSERT_TRUE(buf->CopyToHost(out, sizeof(out), *stream, 8).ok());
    ASSERT_TRUE(stream->Synchronize().ok());
    EXPECT_STREQ(out, in);
    EXPECT_EQ(buf->CopyToHost(out, sizeof(out), *stream, 60).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(buf->CopyFromHost(in, 65, *stream).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(LiveCounts()[0], 1);
    EXPECT_EQ(LiveCounts()[1], 1);
    // Moves transfer ownership; nothing is freed twice.
    DeviceBuffer moved = std::move(*buf);
    EXPECT_EQ(buf->ptr(), 0u);
    Stream s2 = std::move(*stream);
    EXPECT_EQ(LiveCounts()[0], 1);
    // Empty buffers need no memory.
    absl::StatusOr<DeviceBuffer> empty = DeviceBuffer::Allocate(*dev, 0);
    ASSERT_TRUE(empty.ok());
    EXPECT_EQ(empty->ptr(), 0u);
    EXPECT_TRUE(empty->CopyFromHost(in, 0, s2).ok());
    // Out of memory is RESOURCE_EXHAUSTED, naming the call and the size.
    absl::StatusOr<DeviceBuffer> huge = DeviceBuffer::Allocate(*dev, 2 << 20);
    ASSERT_FALSE(huge.ok());
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(std::string(huge.status().message()),
              "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory (2097152 bytes)");
  }
  EXPECT_EQ(LiveCounts()[0], 0);
  EXPECT_EQ(LiveCounts()[1], 0);
}

TEST_F(FakeDriverTest, AsyncFaultSurfacesAtSynchronize) {
  configure_(0, 1, 1 << 20, 700 /* CUDA_ERROR_ILLEGAL_ADDRESS */);
  auto d = OpenFake();
  ASSERT_NE(d, nullptr);
  absl::StatusOr<Stream> stream = Stream::Create(**d->GetDevice(0));
  ASSERT_TRUE(stream.ok());
  absl::Status s = stream->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(std::string(s.message()).find("cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS"),
            std::string::npos)
      << s;
}

// Events time what runs between them on the stream: the fake's launch
// "runs" for 30 ms, and a 40 ms stream sync afterwards does not count.
TEST_F(FakeDriverTest, EventsTimeTheWorkBetweenThem) {
  timing_(30, 40, 0);
  auto d = OpenFake();
  ASSERT_NE(d, nullptr);
  Device* dev = *d->GetDevice(0);
  {
    absl::StatusOr<Stream> stream = Stream::Create(*dev);
    ASSERT_TRUE(stream.ok());
    absl::StatusOr<Event> start = Event::Create(*dev);
    absl::StatusOr<Event> end = Event::Create(*dev);
    ASSERT_TRUE(start.ok() && end.ok()) << start.status() << end.status();
    EXPECT_EQ(live_events_(), 2);
    // Not recorded yet: the driver's error, mapped.
    EXPECT_EQ(Event::ElapsedMs(*start, *end).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(Event().Record(*stream).code(), absl::StatusCode::kFailedPrecondition);

    static constexpr char kEmpty[] = ".entry spin(\n";
    absl::StatusOr<std::unique_ptr<Module>> m = Module::Load(*dev, kEmpty);
    ASSERT_TRUE(m.ok()) << m.status();
    absl::StatusOr<Kernel> k = (*m)->GetKernel("spin");
    ASSERT_TRUE(k.ok()) << k.status();
    uint64_t arg = 0;
    void* params[] = {&arg};
    LaunchConfig cfg;
    Trace();
    ASSERT_TRUE(start->Record(*stream).ok());
    ASSERT_TRUE(k->Launch(cfg, *stream, params).ok());
    ASSERT_TRUE(end->Record(*stream).ok());
    ASSERT_TRUE(stream->Synchronize().ok());
    EXPECT_EQ(Trace(), "record launch record");
    absl::StatusOr<double> ms = Event::ElapsedMs(*start, *end);
    ASSERT_TRUE(ms.ok()) << ms.status();
    EXPECT_GE(*ms, 29.0);
    EXPECT_LT(*ms, 69.0);  // not the sync's time
    // Moves hand the event over; it is destroyed once.
    Event moved = std::move(*start);
    EXPECT_EQ(start->get(), nullptr);
    EXPECT_EQ(live_events_(), 2);
  }
  EXPECT_EQ(live_events_(), 0);
}

TEST_F(FakeDriverTest, EventCreationErrorsAreStatuses) {
  timing_(0, 0, 2 /* CUDA_ERROR_OUT_OF_MEMORY */);
  auto d = OpenFake();
  ASSERT_NE(d, nullptr);
  absl::StatusOr<Event> e = Event::Create(**d->GetDevice(0));
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(e.status().message()).find("cuEventCreate failed"), std::string::npos)
      << e.status();
}

// Fill is cuMemsetD8Async of the whole buffer on the stream.
TEST_F(FakeDriverTest, FillSetsEveryByte) {
  auto d = OpenFake();
  ASSERT_NE(d, nullptr);
  Device* dev = *d->GetDevice(0);
  absl::StatusOr<Stream> stream = Stream::Create(*dev);
  absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(*dev, 100);
  ASSERT_TRUE(stream.ok() && buf.ok());
  Trace();
  ASSERT_TRUE(buf->Fill(0x3c, *stream).ok());
  std::string out(100, '\0');
  ASSERT_TRUE(buf->CopyToHost(out.data(), out.size(), *stream).ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  EXPECT_EQ(out, std::string(100, '\x3c'));
  EXPECT_EQ(Trace(), "memset:100");
}

// NVRTC output through Module and Kernel: the loader path the daemon takes.
TEST_F(FakeDriverTest, ModulesFromNvrtcAndLaunch) {
  NvrtcOptions o;
  o.cuda_root = OPJIT_TEST_CUDA_ROOT;
  auto compiler = NvrtcCompiler::Create(o);
  ASSERT_TRUE(compiler.ok()) << compiler.status();
  GpuCompileRequest req;
  req.source =
      "template <typename T> __global__ void scale(T* x, long long n, T a) { x[0] *= a; }\n";
  req.name_expressions = {"scale<float>"};
  req.archs = {"sm_90"};
  auto out = (*compiler)->Compile(req);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::string mangled = out->lowered_names["scale<float>"];

  auto d = OpenFake();
  ASSERT_NE(d, nullptr);
  Device* dev = *d->GetDevice(0);
  {
    for (const std::string* image : {&out->cubins["sm_90"], &out->ptx}) {
      absl::StatusOr<std::unique_ptr<Module>> m = Module::Load(*dev, *image);
      ASSERT_TRUE(m.ok()) << m.status();
      absl::StatusOr<Kernel> k = (*m)->GetKernel(mangled);
      ASSERT_TRUE(k.ok()) << k.status();
      EXPECT_EQ(k->name(), mangled);
      absl::StatusOr<Kernel> missing = (*m)->GetKernel("scale");
      ASSERT_FALSE(missing.ok());
      EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(std::string(missing.status().message()).find("no kernel named 'scale'"),
                std::string::npos);

      absl::StatusOr<Stream> stream = Stream::Create(*dev);
      ASSERT_TRUE(stream.ok());
      absl::StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(*dev, 16);
      ASSERT_TRUE(buf.ok());
      uint64_t ptr = buf->ptr();
      long long n = 4;
      float a = 2.0f;
      void* params[] = {&ptr, &n, &a};
      LaunchConfig cfg;
      cfg.grid[0] = 3;
      cfg.block[0] = 128;
      cfg.shared_mem = 64 * 1024;  // above 48 KiB: the opt-in path
      ASSERT_TRUE(k->Launch(cfg, *stream, params).ok());
      unsigned grid[3], block[3], shared;
      long long first;
      last_launch_(grid, block, &shared, &first);
      EXPECT_EQ(grid[0], 3u);
      EXPECT_EQ(block[0], 128u);
      EXPECT_EQ(shared, 64u * 1024);
      EXPECT_EQ(static_cast<uint64_t>(first), ptr);
      cfg.shared_mem = 300 * 1024;  // more than the device has
      EXPECT_EQ(k->Launch(cfg, *stream, params).code(), absl::StatusCode::kInvalidArgument);
      cfg.shared_mem = 0;
      cfg.grid[0] = 0;
      absl::Status bad = k->Launch(cfg, *stream, params);
      EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(std::string(bad.message()).find("cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"),
                std::string::npos)
          << bad;
    }
    // Garbage and host ELF files are refused.
    absl::StatusOr<std::unique_ptr<Module>> bad = Module::Load(*dev, "not ptx at all");
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(bad.status().message()).find("ptxas fatal"), std::string::npos)
        << bad.status();
    EXPECT_EQ(Module::Load(*dev, "").status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(LiveCounts(), (std::vector<int>{0, 0, 0, 1}));
}

}  // namespace
}  // namespace opjit::gpu
