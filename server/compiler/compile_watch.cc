#include "server/compiler/compile_watch.h"

#include <algorithm>

#include "server/common/logging.h"

namespace opjit::compiler {
namespace {

double SecondsSince(CompileWatch::Clock::time_point t0, CompileWatch::Clock::time_point now) {
  return std::chrono::duration<double>(now - t0).count();
}

}  // namespace

CompileWatch::CompileWatch(std::chrono::milliseconds after, std::chrono::milliseconds every)
    : after_(after), every_(std::max(every, std::chrono::milliseconds(1))) {
  if (after_.count() > 0) thread_ = std::thread([this] { Run(); });
}

CompileWatch::~CompileWatch() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  if (thread_.joinable()) thread_.join();
}

uint64_t CompileWatch::Begin(std::string what) {
  if (after_.count() <= 0) return 0;
  const auto now = Clock::now();
  uint64_t ticket;
  {
    MutexLock lock(&mu_);
    ticket = next_ticket_++;
    running_[ticket] = Entry{std::move(what), now, now + after_};
  }
  cv_.SignalAll();
  return ticket;
}

void CompileWatch::End(uint64_t ticket, bool ok) {
  if (ticket == 0) return;
  const auto now = Clock::now();
  Entry e;
  {
    MutexLock lock(&mu_);
    auto it = running_.find(ticket);
    if (it == running_.end()) return;
    e = std::move(it->second);
    running_.erase(it);
  }
  if (e.reported || now - e.start >= after_) {
    Logger("compiler")->info("compile of {} {} after {:.1f} s", e.what,
                             ok ? "finished" : "failed", SecondsSince(e.start, now));
  }
}

uint64_t CompileWatch::reported() const {
  MutexLock lock(&mu_);
  return reported_;
}

void CompileWatch::Run() {
  MutexLock lock(&mu_);
  while (!stop_) {
    auto next = Clock::time_point::max();
    for (const auto& [ticket, e] : running_) next = std::min(next, e.next_report);
    if (next == Clock::time_point::max()) {
      cv_.Wait(&mu_);
      continue;
    }
    if (Clock::now() < next) {
      cv_.WaitUntil(&mu_, next);
      continue;
    }
    const auto now = Clock::now();
    for (auto& [ticket, e] : running_) {
      if (e.next_report > now) continue;
      // Whole seconds ("after 5 s", "after 35 s"), tenths below one.
      const double s = SecondsSince(e.start, now);
      Logger("compiler")->warn("compile of {} still running after {:.{}f} s", e.what, s,
                               s < 1 ? 1 : 0);
      if (!e.reported) ++reported_;
      e.reported = true;
      e.next_report = now + every_;
    }
  }
}

}  // namespace opjit::compiler
